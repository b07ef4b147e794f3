"""Keras optimizer internals: `apply` of one optimizer instance that can accumulate instead (strategy.no_sync()).

While `skipping()` is true (read when the step is traced), `optimizer.apply(grads, variables)` /
`apply_gradients` adds each replica's gradients into accumulators on that replica's device and returns:
no all-reduce, no update, no iteration counted. The next `apply` outside it adds the accumulators to its
gradients and zeroes them, then runs the stock `apply` (one all-reduce of the sum, one update). Only this
instance changes (`install`); BatchNorm statistics and metrics update as usual in every micro-step.
"""

from __future__ import annotations

import threading
import types
import weakref
from collections.abc import Callable

import tensorflow as tf

from tfdist._compat.tf_runtime import outside_any_strategy

__all__ = ["Accumulators", "install"]


class Accumulators:
    """Per (replica device, variable position) sums of gradients, in variables made when first needed."""

    def __init__(self):
        self.sums: dict[tuple[str, int], tf.Variable] = {}
        self.synced_without = False  # a sync step was traced before any accumulator existed
        self._lock = threading.Lock()  # MirroredStrategy traces each replica in a thread of its own

    def add(self, grads: list, positions: list[int]) -> None:
        for g, i in zip(grads, positions):
            if g is not None:
                self._sum(g, i).assign_add(tf.convert_to_tensor(g))

    def take(self, grads: list, positions: list[int]) -> list:
        out = []
        for g, i in zip(grads, positions):
            key = (_device(g), i)
            if g is None or key not in self.sums:
                out.append(g)
                continue
            total = tf.convert_to_tensor(g) + self.sums[key].read_value()
            with tf.control_dependencies([total]):
                self.sums[key].assign(tf.zeros_like(total))
            out.append(total)
        return out

    def _sum(self, g, i: int) -> tf.Variable:
        key = (_device(g), i)
        with self._lock:
            if key not in self.sums:
                g = tf.convert_to_tensor(g)

                def make(device=key[0], shape=g.shape, dtype=g.dtype):
                    with tf.device(device):
                        return tf.Variable(tf.zeros(shape, dtype), trainable=False, name=f"no_sync_sum_{i}")

                with tf.init_scope():
                    self.sums[key] = outside_any_strategy(make)
        return self.sums[key]


def _device(t) -> str:
    return tf.DeviceSpec.from_string(getattr(t, "device", "") or "").to_string()


def install(optimizer, skipping: Callable[[], bool], accumulators: Accumulators) -> None:
    """Makes `optimizer.apply` (this instance) accumulate while `skipping()`; once per instance."""
    if _installed.get(optimizer) is accumulators:
        return

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        variables = list(trainable_variables) if trainable_variables is not None else list(self._trainable_variables)
        positions = [_position(self, v, k) for k, v in enumerate(variables)]
        if skipping():
            accumulators.add(grads, positions)
            return self._iterations
        if not accumulators.sums:
            accumulators.synced_without = True
        return type(self).apply(self, accumulators.take(grads, positions), trainable_variables)

    object.__setattr__(optimizer, "apply", types.MethodType(apply, optimizer))
    _installed[optimizer] = accumulators


# The accumulators installed on each optimizer instance, kept beside it (not as an attribute: dir(optimizer)
# stays that of plain Keras).
_installed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _position(optimizer, variable, fallback: int) -> int:
    if not optimizer.built:
        return fallback  # unbuilt: the order given is the order it will be built with
    return optimizer._get_variable_index(variable)


def applied_steps(optimizer) -> int:
    """The optimizer's applied-step counter, read eagerly."""
    with tf.init_scope():
        return int(optimizer._iterations.numpy())
