"""Updates of a sharded variable that run shard by shard, each on the shard's own parameter server.

Keras 3 updates a variable with `extended.update(var, apply_grad_to_update_var, args=(grad, lr))`
(keras/src/backend/tensorflow/optimizer.py, `TFOptimizer._distributed_tf_update_step`), and its update
math on a ShardedVariable container would read every shard (and every slot) into one tensor on the
worker. tfdist's PSExtended instead calls the same function once per shard, colocated with the shard:

- `ByShard` splits the arguments by the shard's rows: an IndexedSlices gradient into the rows each shard
  owns (re-indexed from 0), a dense gradient into row slices, a variable sharded the same way into its
  shard; the learning rate and other values pass unchanged;
- `optimizer_on_shard` lets Keras' `update_step(grad, shard, lr)` find the shard's slots: the shard gets its
  variable's optimizer index, and each slot of the variable is backed by its own shard i meanwhile.

The result equals Keras' update of the whole variable for optimizers whose update is elementwise
(SHARD_WISE_OPTIMIZERS). Whether an update touches only the gradient's rows is Keras' own behaviour on
an IndexedSlices gradient: SGD without momentum scatters (`scatter_sub`) and Adagrad's accumulator
scatters; Adam and the others compute dense updates of the whole shard (on its server).
"""

from __future__ import annotations

import tfdist._compat  # noqa: F401  (the TF/Keras version check, before any reach-in below)

import contextlib
import inspect
import logging
import threading
from collections.abc import Iterator

import keras
import tensorflow as tf
from keras.src.backend import Variable as _KerasVariable
from tensorflow.python.distribute import sharded_variable as _sharded_variable

__all__ = ["SHARD_WISE_OPTIMIZERS", "ByShard", "is_shard_wise", "keras_optimizer_of", "optimizer_on_shard",
           "row_offsets", "warn_whole_update"]

log = logging.getLogger("tfdist")

# Keras optimizers whose update of a variable is elementwise in it, its gradient and its slots: updating
# each shard with the same shard of every slot is exactly the update of the whole variable. (Lamb's
# trust ratio and Adafactor's factored slots are per-variable; Muon is matrix-wise.)
SHARD_WISE_OPTIMIZERS = ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Nadam", "Ftrl", "Lion")
_SHARD_WISE_STEPS = frozenset(getattr(keras.optimizers, name).update_step for name in SHARD_WISE_OPTIMIZERS)


def row_offsets(sharded) -> list[int]:
    """First row of every shard, then the number of rows: [0, n0, n0 + n1, ..., rows]."""
    out = [0]
    for shard in sharded.variables:
        out.append(out[-1] + int(shard.shape[0]))
    return out


def _sharded(value):
    b = value._value if isinstance(value, _KerasVariable) else value
    return b if isinstance(b, _sharded_variable.ShardedVariable) else None


class ByShard:
    """Splits update arguments by the row ranges of a sharded variable (see the module docstring)."""

    def __init__(self, var: _sharded_variable.ShardedVariable):
        self.var, self.offsets = var, row_offsets(var)
        self._slices: dict[int, list] = {}

    def select(self, structure, i: int):
        """`structure` (args or kwargs of an update) as shard i's update takes it."""
        return tf.nest.map_structure(lambda value: self._part(value, i), structure)

    def _part(self, value, i: int):
        if isinstance(value, tf.IndexedSlices):
            if id(value) not in self._slices:  # split once, for every shard
                self._slices[id(value)] = self._split_slices(value)
            return self._slices[id(value)][i]
        sharded = _sharded(value)
        if sharded is not None:
            if row_offsets(sharded) != self.offsets:
                raise ValueError(f"tfdist: updating {self.var.name} (row offsets {self.offsets}) with {sharded.name}, "
                                 f"sharded at rows {row_offsets(sharded)}; expected the same row ranges")
            return sharded.variables[i]
        if tf.is_tensor(value) and value.shape.rank and value.shape[0] == self.offsets[-1]:
            return value[self.offsets[i]:self.offsets[i + 1]]
        return value

    def _split_slices(self, g: tf.IndexedSlices) -> list[tf.IndexedSlices]:
        # Runs where the gradient is (the worker): only the gradient's rows travel to each server.
        n, rest = len(self.offsets) - 1, self.var.shape[1:].as_list()
        rows = tf.cast(g.indices, tf.int64)
        owner = tf.searchsorted(tf.constant(self.offsets[1:-1], tf.int64), rows, side="right", out_type=tf.int32)
        values, rows = tf.dynamic_partition(g.values, owner, n), tf.dynamic_partition(rows, owner, n)
        return [tf.IndexedSlices(values[i], rows[i] - self.offsets[i],
                                 tf.constant([self.offsets[i + 1] - self.offsets[i], *rest], tf.int64))
                for i in range(n)]


def keras_optimizer_of(fn):
    """The Keras optimizer whose gradient update `fn` is, or None: `_distributed_tf_update_step` hands
    `extended.update` its inner `apply_grad_to_update_var(var, grad, learning_rate)`, a closure over the
    optimizer (`self`). tf.distribute wraps it for autograph (`tf_convert`), hence the unwrap."""
    try:
        fn = inspect.unwrap(fn)
    except ValueError:  # a cycle of __wrapped__
        return None
    code = getattr(fn, "__code__", None)
    if code is None or fn.__name__ != "apply_grad_to_update_var" or "self" not in code.co_freevars:
        return None
    owner = fn.__closure__[code.co_freevars.index("self")].cell_contents
    return owner if isinstance(owner, keras.optimizers.Optimizer) else None


def is_shard_wise(optimizer) -> bool:
    """True when `optimizer`'s update_step is one of SHARD_WISE_OPTIMIZERS' (not overridden)."""
    return type(optimizer).update_step in _SHARD_WISE_STEPS


_view_lock = threading.RLock()


@contextlib.contextmanager
def optimizer_on_shard(optimizer, var: _sharded_variable.ShardedVariable, i: int) -> Iterator[None]:
    """While open (one shard's update being traced), Keras' `optimizer.update_step(grad, shard, lr)` works
    on shard i: the shard has its variable's index (`_trainable_variables_indices`, which
    `_get_variable_index` reads) and every slot of the variable (a Keras variable whose `_value` is a
    sharded variable with `reference is var`) is backed by its shard i. Restored on exit; the lock keeps
    two traces from interleaving their views. A no-op for optimizer None (updates that are not Keras
    gradient updates: weight decay, EMA, gradient accumulators, which get their shards as arguments)."""
    if optimizer is None:
        yield
        return
    with _view_lock:
        key, index = optimizer._var_key(var.variables[i]), optimizer._get_variable_index(var)
        slots = [s for s in optimizer.variables if getattr(_sharded(s), "reference", None) is var]
        saved = [s._value for s in slots]
        optimizer._trainable_variables_indices[key] = index
        for slot, whole in zip(slots, saved):
            slot._value = whole.variables[i]
        try:
            yield
        finally:
            for slot, whole in zip(slots, saved):
                slot._value = whole
            optimizer._trainable_variables_indices.pop(key, None)


_warned: set[str] = set()


def warn_whole_update(optimizer, var) -> None:
    """Logs once per optimizer class that its updates of sharded variables run whole on the worker."""
    kind = type(optimizer).__name__
    if kind not in _warned:
        _warned.add(kind)
        log.warning("tfdist: %s is not known to update elementwise, so %s (sharded over %d servers) is updated "
                    "whole, read onto the worker; shard-by-shard updates on the servers cover %s",
                    kind, var.variables[0].name.rsplit("/part_", 1)[0], len(var.variables), ", ".join(SHARD_WISE_OPTIMIZERS))
