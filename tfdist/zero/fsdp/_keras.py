"""Keras and tf.distribute internals ZeRO stage 3 needs: a layer's own variables, per-instance call wrapping,
the local replica index, the compiled step functions of a model, and Keras' mixed-precision autocast (which a
layer's backward recompute must enter again)."""

from __future__ import annotations

import tfdist._compat  # noqa: F401  (the TF/Keras version check, before any reach-in below)

import contextlib
import weakref
from collections.abc import Callable, Iterator

import tensorflow as tf

__all__ = ["autocast", "autocast_dtype", "direct_trainable_variables", "local_replica_index", "original_call",
           "reset_step_functions", "set_call", "sublayers"]


def direct_trainable_variables(layer) -> list:
    """Trainable variables a layer created itself (`add_weight`), not those of its sublayers."""
    return [v for v in getattr(layer, "_trainable_variables", []) if v.trainable]


def sublayers(layer) -> list:
    """The layers directly inside `layer` (one level)."""
    return list(layer._flatten_layers(include_self=False, recursive=False))


def set_call(layer, fn: Callable) -> None:
    """Makes this layer instance's `__call__` run `fn` instead of its class's `call` (Keras' Layer.__call__
    calls `self.call`); the stock bound method stays available through `original_call`. Bypasses Keras'
    attribute tracking, which would otherwise record the function as layer state."""
    if layer not in _stock_calls:
        _stock_calls[layer] = layer.call
    object.__setattr__(layer, "call", fn)


def original_call(layer) -> Callable:
    """The layer's stock `call` (bound), also after `set_call`."""
    return _stock_calls.get(layer, layer.call)


# Each wrapped layer's stock bound `call`, kept beside the layer (an attribute would show in dir(layer)).
_stock_calls: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def local_replica_index(ctx: tf.distribute.ReplicaContext) -> int:
    """Index of the replica whose function runs in this thread, among this process's local replicas
    (MirroredStrategy keeps the global index as a Python int; the public `replica_id_in_sync_group` is a
    tensor; MultiWorkerMirroredStrategy / HorovodStrategy map global to local with `_get_local_replica_id`)."""
    replica = ctx._replica_id_in_sync_group
    if not isinstance(replica, int):
        replica = tf.get_static_value(replica)
    # Multi-process strategies number replicas globally (worker * M + local); the pieces are per process.
    return int(ctx.strategy.extended._get_local_replica_id(int(replica)))


def reset_step_functions(model) -> None:
    """Drops a model's traced train/test/predict functions: they captured the replicated variables that
    ZeRO stage 3 has just replaced, and `fit`/`evaluate`/`predict` trace them again when None."""
    for name in ("train_function", "test_function", "predict_function"):
        if getattr(model, name, None) is not None:
            setattr(model, name, None)


def autocast_dtype() -> str | None:
    """The dtype Keras casts float variables to in the layer call running now (a mixed-precision policy's
    compute dtype, set by Layer.__call__), or None."""
    from keras.src.backend.common.variables import get_autocast_scope

    scope = get_autocast_scope()
    return None if scope is None else scope.dtype


@contextlib.contextmanager
def autocast(dtype: str | None) -> Iterator[None]:
    """Keras' autocast of float variables to `dtype`, as Layer.__call__ sets it; nothing when None."""
    from keras.src.backend.common.variables import AutocastScope

    if dtype is None:
        yield
        return
    with AutocastScope(dtype):
        yield
