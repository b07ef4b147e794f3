"""Parameter-server internals: sharded slots and updates, gradients of sharded Keras variables, Keras' data adapter.

TF's ParameterServerStrategy splits a variable over the parameter servers as a `ShardedVariable`
(a container of one `tf.Variable` per server). Keras 3 was never taught about it, in three places:

- the optimizer creates a slot "colocated with" its variable, and TF never partitions colocated
  variables: Adam's two slots of a sharded embedding table would be whole tables on one server;
- `extended.update(var, ...)` colocates the update with `var`, which a ShardedVariable refuses;
- Keras' `train_step` calls `tape.gradient(loss, keras_variables)`, which asks every Keras variable for
  its `.handle`; a ShardedVariable has none (one handle per shard).

`PSExtended` fixes the first two in the strategy (slots sharded like their variable; sharded updates
without colocation), `sharded_gradients()` the third while a tfdist worker function is traced.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import numpy as np
import tensorflow as tf
from keras.src.backend import Variable as _KerasVariable
from keras.src.trainers.data_adapters.data_adapter import DataAdapter
from tensorflow.python.distribute import distribute_lib as _distribute_lib
from tensorflow.python.distribute import parameter_server_strategy_v2 as _ps_v2
from tensorflow.python.distribute import sharded_variable as _sharded_variable
from tensorflow.python.framework import ops as _ops

__all__ = ["DataAdapter", "PSExtended", "ShardedVariable", "init_ps_strategy", "is_sharded", "shards_of",
           "sharded_gradients"]



class ShardedVariable(_sharded_variable.ShardedVariable):
    """TF's ShardedVariable that NumPy (and so Keras' `.keras`/`.weights.h5` saving) can read whole."""

    def __array__(self, dtype=None, copy=None):
        return np.asarray(tf.convert_to_tensor(self).numpy(), dtype=dtype)


def _backend(v):  # the tf.Variable (or ShardedVariable) behind a Keras variable
    return v.value if isinstance(v, _KerasVariable) else v


def is_sharded(v) -> bool:
    """True for a ShardedVariable or a Keras variable backed by one."""
    return isinstance(_backend(v), _sharded_variable.ShardedVariable)


def shards_of(v) -> list[tf.Variable]:
    """The per-server variables of a sharded (Keras or TF) variable; [v] for an ordinary one."""
    b = _backend(v)
    return list(b.variables) if isinstance(b, _sharded_variable.ShardedVariable) else [b]


class PSExtended(_ps_v2.ParameterServerStrategyV2Extended):
    """ParameterServerStrategyV2's extended, with slots sharded like their variable and sharded updates."""

    def _create_variable(self, next_creator, **kwargs):
        like = kwargs.get("colocate_with")
        if isinstance(like, _sharded_variable.ShardedVariable):
            return self._create_sharded_like(like, next_creator, **kwargs)
        var = super()._create_variable(next_creator, **kwargs)
        if type(var) is _sharded_variable.ShardedVariable:
            return ShardedVariable(var.variables, name=var.name)
        return var

    def _create_sharded_like(self, like: ShardedVariable, next_creator, **kwargs):
        # A slot of a sharded variable: one shard per shard of `like`, on the same server.
        kwargs.pop("colocate_with")
        initial = kwargs.pop("initial_value")
        name = kwargs.pop("name", None) or "slot"
        full = initial() if callable(initial) else initial
        shards, start = [], 0
        for i, part in enumerate(like.variables):
            rows = part.shape[0]
            with _ops.device(None), _ops.colocate_with(part):
                shards.append(super()._create_variable(
                    next_creator, colocate_with=part, initial_value=full[start:start + rows],
                    name=f"{name}/part_{i}", **kwargs))
            start += rows
        return ShardedVariable(shards, name=name)

    def _update(self, var, fn, args, kwargs, group):
        if isinstance(var, _sharded_variable.ShardedVariable):
            # The update reads and writes every shard through the container (each shard's ops run on
            # its server); there is no single device to colocate with.
            with _distribute_lib.UpdateContext(None):
                result = fn(var, *self._select_single_value(args), **self._select_single_value(kwargs))
                return result if group else tf.nest.map_structure(self._local_results, result)
        return super()._update(var, fn, args, kwargs, group)


def init_ps_strategy(strategy, cluster_resolver, variable_partitioner) -> None:
    """What ParameterServerStrategyV2.__init__ does, with `PSExtended`: checks the cluster, connects this
    process (the coordinator, job "chief") to every ps and worker, and builds the extended."""
    strategy._cluster_resolver = cluster_resolver
    strategy._verify_args_and_config(cluster_resolver)
    strategy._cluster_coordinator = None
    strategy._connect_to_cluster(coordinator_name="chief")
    strategy._extended = PSExtended(strategy, cluster_resolver, variable_partitioner)
    _distribute_lib.Strategy.__init__(strategy, strategy._extended)
    strategy._should_use_with_coordinator = True
    strategy._canonicalize_devices = False
    strategy._is_parameter_server_strategy_v2 = True


# --- Gradients of sharded Keras variables -------------------------------------------------------------
_stock_gradient = tf.GradientTape.gradient
_lock = threading.Lock()
_open = 0


def _gradient(self, target, sources, output_gradients=None, unconnected_gradients=tf.UnconnectedGradients.NONE):
    flat = tf.nest.flatten(sources)
    if not any(is_sharded(v) for v in flat):
        return _stock_gradient(self, target, sources, output_gradients, unconnected_gradients)
    expanded = [shards_of(v) if is_sharded(v) else v for v in flat]
    grads = _stock_gradient(self, target, expanded, output_gradients, unconnected_gradients)
    joined = [_join_shard_gradients(v, g) if is_sharded(v) else g for v, g in zip(flat, grads)]
    return tf.nest.pack_sequence_as(sources, joined)


def _join_shard_gradients(v, grads: list):
    """One gradient for the whole variable from its shards' gradients (dense, or IndexedSlices if any is)."""
    shards = shards_of(v)
    if not any(isinstance(g, tf.IndexedSlices) for g in grads):
        return tf.concat([tf.zeros_like(s) if g is None else g for s, g in zip(shards, grads)], axis=0)
    values, indices, offset = [], [], 0
    for s, g in zip(shards, grads):
        if g is not None:
            if not isinstance(g, tf.IndexedSlices):
                g = tf.IndexedSlices(g, tf.range(tf.shape(g, out_type=tf.int64)[0]))
            values.append(g.values)
            indices.append(tf.cast(g.indices, tf.int64) + offset)
        offset += s.shape[0]
    return tf.IndexedSlices(tf.concat(values, 0), tf.concat(indices, 0),
                            tf.constant(v.shape.as_list(), tf.int64))


@contextlib.contextmanager
def sharded_gradients() -> Iterator[None]:
    """While open, `tape.gradient(loss, keras_variables)` works for Keras variables backed by
    ShardedVariables: the gradient of each shard, joined into one for the whole variable.

    Gradients of other variables go through the stock method unchanged; the class is restored when the
    last block closes. (Process-wide rather than per thread: TF may trace a scheduled function on
    another thread than the one that scheduled it.)"""
    global _open
    with _lock:
        if not _open:
            tf.GradientTape.gradient = _gradient
        _open += 1
    try:
        yield
    finally:
        with _lock:
            _open -= 1
            if not _open:
                tf.GradientTape.gradient = _stock_gradient
