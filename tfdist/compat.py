"""Every reach into TensorFlow and Keras private internals, in one place, behind a version check."""

from __future__ import annotations

import itertools
import warnings

import keras
import tensorflow as tf

# Versions this module was written and tested against. A TF or Keras upgrade should only have to
# revisit this file: every `tensorflow.python.*` / `keras.src.*` import in tfdist lives here.
TESTED_TF = ("2.21",)
TESTED_KERAS_MAJOR = 3


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


if _major_minor(tf.__version__) not in TESTED_TF:
    warnings.warn(
        f"tfdist was tested with TensorFlow {', '.join(TESTED_TF)}; found {tf.__version__}. "
        "Private TF internals used by tfdist (tfdist/compat.py) may have moved.",
        RuntimeWarning,
        stacklevel=2,
    )
if int(keras.__version__.split(".")[0]) != TESTED_KERAS_MAJOR:
    raise ImportError(
        f"tfdist needs Keras 3 (the default tf.keras of TF 2.16+); found keras {keras.__version__}. "
        "Install it with: pip install 'keras>=3.15'"
    )


# --- Collective keys -------------------------------------------------------------------------
# MirroredExtended numbers its collective groups from `container_strategy._collective_key_base`.
# Every stock MirroredStrategy starts at 0, so two strategies over different device sets in one
# process join the same group and fail ("joining a group with size 2, but that group has size 4").
# Giving each tfdist strategy its own base keeps them apart (TF's own tests do the same).
_KEY_STRIDE = 100_000
_key_bases = itertools.count(start=_KEY_STRIDE, step=_KEY_STRIDE)


def fresh_collective_key_base() -> int:
    """Returns a collective key base no other tfdist strategy in this process uses."""
    return next(_key_bases)


# --- Optimizer-state partitioning (tfdist.sharding.zero) -----------------------------------------
# Keras 3 gives a strategy no handle on the optimizer before it creates its slots. Every Keras
# optimizer's build() calls BaseOptimizer.build() (via super()) before it creates any slot, so a
# hook there can turn the optimizer into a ZeRO one in time. The hook decides; for optimizers
# that are not under a ZeRO strategy it returns without doing anything.
_build_hooks: list = []


def install_optimizer_build_hook(hook) -> None:
    """Calls `hook(optimizer, variables)` at the start of every Keras optimizer's base build().

    Installed once per hook (idempotent); hooks run in installation order.
    """
    from keras.src.optimizers import base_optimizer

    if hook in _build_hooks:
        return
    _build_hooks.append(hook)
    base = base_optimizer.BaseOptimizer
    if getattr(base.build, "_tfdist_hooked", False):
        return
    original = base.build

    def build(self, variables):
        for h in list(_build_hooks):
            h(self, variables)
        return original(self, variables)

    build._tfdist_hooked = True
    build.__wrapped__ = original
    base.build = build


def optimizer_strategy(optimizer) -> tf.distribute.Strategy | None:
    """The tf.distribute strategy a Keras TF optimizer captured when it was created."""
    return getattr(optimizer, "_distribution_strategy", None)


def optimizer_variable_index(optimizer, variable) -> int:
    """Position of `variable` in the list the Keras optimizer was built with."""
    return optimizer._get_variable_index(variable)


def optimizer_all_reduce_sum(optimizer, grads: list, variables: list) -> list:
    """Keras' own gradient all-reduce (TFOptimizer._all_reduce_sum_gradients), in replica context.

    ZeRO-1 reduces exactly like stage 0 through this, so both see bit-identical gradients.
    """
    pairs = optimizer._all_reduce_sum_gradients(list(zip(grads, [getattr(v, "value", v) for v in variables])))
    return [g for g, _ in pairs]


def optimizer_apply_weight_decay(optimizer, variables: list) -> None:
    """Keras' decoupled weight decay of the optimizer (honours exclude_from_weight_decay)."""
    optimizer._apply_weight_decay(variables)


def override_method(obj, name: str, function) -> None:
    """Binds `function(obj, ...)` as `obj.name` on this instance only (no Keras/TF attribute tracking)."""
    import types

    object.__setattr__(obj, name, types.MethodType(function, obj))


class SavedTensor(tf.__internal__.tracking.Trackable):
    """A Trackable saved by tf.train.Checkpoint as one tensor, like a variable ("VARIABLE_VALUE").

    Subclasses implement `read() -> tf.Tensor` and `write(value)`; a checkpoint written from it
    reads back into a plain tf.Variable of the same shape, and the reverse.
    """

    def read(self) -> tf.Tensor:
        raise NotImplementedError

    def write(self, value) -> None:
        raise NotImplementedError

    def _serialize_to_tensors(self):
        return {"VARIABLE_VALUE": self.read()}

    def _restore_from_tensors(self, restored_tensors):
        self.write(restored_tensors["VARIABLE_VALUE"])
        return tf.no_op()
