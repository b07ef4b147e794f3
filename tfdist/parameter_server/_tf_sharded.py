"""Parameter-server internals: sharded creation, slots and updates, gradients of sharded Keras variables,
Keras' data adapter.

TF's ParameterServerStrategy splits a variable over the parameter servers as a `ShardedVariable`
(a container of one `tf.Variable` per server). Keras 3 was never taught about it, in four places:

- Keras hands tf.Variable a shapeless lambda, so TF computes the whole initial value on the
  coordinator and slices it (the whole table in one process);
- the optimizer creates a slot "colocated with" its variable, and TF never partitions colocated
  variables: Adam's two slots of a sharded embedding table would be whole tables on one server;
- `extended.update(var, ...)` colocates the update with `var`, which a ShardedVariable refuses, and
  Keras' update math on the container reads every shard into one tensor;
- Keras' `train_step` calls `tape.gradient(loss, keras_variables)`, which asks every Keras variable for
  its `.handle`; a ShardedVariable has none (one handle per shard).

`PSExtended` fixes the first three in the strategy: each shard is initialised by itself on its server
(tfdist.parameter_server._shard_init), slots are sharded like their variable, and an update runs shard by shard,
each on the shard's server (Keras' optimizer sees the shard and the same shard of every slot).
`sharded_gradients()` fixes the fourth while a tfdist worker function is traced.
"""

from __future__ import annotations

import tfdist._compat  # noqa: F401  (the TF/Keras version check, before any reach-in below)

import contextlib
import logging
import threading
import weakref
from collections.abc import Iterator

import numpy as np
import tensorflow as tf
from keras.src.backend import Variable as _KerasVariable
from keras.src.backend.common.stateless_scope import in_stateless_scope as _in_stateless_scope
from keras.src.trainers.data_adapters.data_adapter import DataAdapter
from tensorflow.python.distribute import distribute_lib as _distribute_lib
from tensorflow.python.distribute import parameter_server_strategy_v2 as _ps_v2
from tensorflow.python.distribute import sharded_variable as _sharded_variable
from tensorflow.python.framework import ops as _ops

from tfdist.parameter_server import _shard_init as shard_init
from tfdist.parameter_server import _shard_updates as shard_updates

__all__ = ["DataAdapter", "PSExtended", "ShardedVariable", "atomic_updates", "init_ps_strategy", "is_sharded",
           "sharded_gradients",
           "sharded_value", "shards_of"]

log = logging.getLogger("tfdist")


class ShardedVariable(_sharded_variable.ShardedVariable):
    """TF's ShardedVariable that NumPy (and so Keras' `.keras`/`.weights.h5` saving) can read whole, and
    that knows its row offsets and, for an optimizer slot, the variable it belongs to (`reference`)."""

    def __init__(self, variables, name: str = "ShardedVariable", reference=None):
        super().__init__(variables, name=name)
        self._reference = None if reference is None else weakref.ref(reference)

    @property
    def reference(self):
        """The sharded variable this one is a slot of (same rows, same servers), or None."""
        return None if self._reference is None else self._reference()

    def __array__(self, dtype=None, copy=None):
        return np.asarray(tf.convert_to_tensor(self).numpy(), dtype=dtype)

    # Checkpoints (`tf.train.Checkpoint`, which reaches this through the Keras variable): one entry per shard,
    # read and written by the shard's own server, so neither a save nor a restore holds the whole table anywhere.
    # TF's own ShardedVariable saves slices of one logical entry, but a Keras variable takes the newer
    # `_serialize_to_tensors` path, whose restore keeps one slice per name; so each shard has its own name,
    # from its rows. A checkpoint restores into the same split of rows (the same number of servers).
    def _serialize_to_tensors(self):
        return {key: shard._serialize_to_tensors()[_VALUE]
                for key, shard in zip(self._checkpoint_keys(), self._variables)}

    def _restore_from_tensors(self, restored_tensors):
        return tf.group([shard._restore_from_tensors({_VALUE: restored_tensors[key]})
                         for key, shard in zip(self._checkpoint_keys(), self._variables)])

    def _checkpoint_keys(self) -> list[str]:
        starts = [offset[0] for offset in self._var_offsets]
        return [f"{_VALUE}_rows_{start}_{start + int(v.shape[0])}" for start, v in zip(starts, self._variables)]


_VALUE = "VARIABLE_VALUE"  # the entry name of a variable's value in a checkpoint (TF's VARIABLE_VALUE_KEY)


def _backend(v):  # the tf.Variable (or ShardedVariable) behind a Keras variable, never autocast
    return v._value if isinstance(v, _KerasVariable) else v


def is_sharded(v) -> bool:
    """True for a ShardedVariable or a Keras variable backed by one."""
    return isinstance(_backend(v), _sharded_variable.ShardedVariable)


def sharded_value(v) -> ShardedVariable | None:
    """The ShardedVariable behind `v` (a Keras or TF variable), or None when it is not sharded. Unlike
    Keras' `v.value` it never casts (a cast under mixed precision would read the whole table)."""
    b = _backend(v)
    return b if isinstance(b, _sharded_variable.ShardedVariable) else None


def shards_of(v) -> list[tf.Variable]:
    """The per-server variables of a sharded (Keras or TF) variable; [v] for an ordinary one."""
    b = _backend(v)
    return list(b.variables) if isinstance(b, _sharded_variable.ShardedVariable) else [b]


class PSExtended(_ps_v2.ParameterServerStrategyV2Extended):
    """ParameterServerStrategyV2's extended, with per-shard initial values, slots sharded like their
    variable and updates that run shard by shard on the shards' servers."""

    def _create_variable(self, next_creator, **kwargs):
        like = kwargs.get("colocate_with")
        if isinstance(like, _sharded_variable.ShardedVariable):
            return self._create_sharded_like(like, next_creator, **kwargs)
        found = shard_init.keras_initializer(kwargs.get("initial_value")) if like is None else None
        if found is not None and found[1] and shard_init.for_shard(found[0], found[1], 0) is not None:
            kwargs = _zeros_per_shard(kwargs, *found)
        elif found is not None and found[1] and self._splits(found[1], found[2]):
            log.warning("tfdist: the %s initializer of %s %s has no per-shard form; TensorFlow computes the whole "
                        "value on the coordinator and sends it to the servers", type(found[0]).__name__,
                        kwargs.get("name"), found[1])
            found = None
        else:
            found = None
        var = super()._create_variable(next_creator, **kwargs)
        if type(var) is _sharded_variable.ShardedVariable:
            if found is not None:
                shard_init.fill(var.variables, *found)
            return ShardedVariable(var.variables, name=var.name)
        return var

    def _splits(self, shape: tuple, dtype) -> bool:
        """Whether TF's parameter-server strategy will split a variable of this shape over the servers."""
        if self._variable_partitioner is None:
            return False
        return self._variable_partitioner(shape=tf.TensorShape(shape), dtype=tf.as_dtype(dtype))[0] > 1

    def _create_sharded_like(self, like: ShardedVariable, next_creator, **kwargs):
        # A slot of a sharded variable: one shard per shard of `like`, on the same server, each created as
        # zeros there and filled there when Keras' initializer has a per-shard form (every built-in slot's).
        kwargs.pop("colocate_with")
        initial = kwargs.pop("initial_value")
        name = kwargs.pop("name", None) or "slot"
        found = shard_init.keras_initializer(initial)
        if found is not None and shard_init.for_shard(found[0], found[1], 0) is None:
            found = None
        offsets = shard_updates.row_offsets(like)
        full = None if found else (initial() if callable(initial) else initial)  # whole, on the coordinator
        shards = []
        for i, part in enumerate(like.variables):
            rows = part.shape[0]
            value = _zeros((rows, *part.shape[1:]), found[2]) if found else full[offsets[i]:offsets[i] + rows]
            with _ops.device(None), _ops.colocate_with(part):
                shards.append(super()._create_variable(
                    next_creator, colocate_with=part, initial_value=value, name=f"{name}/part_{i}", **kwargs))
        if found:
            shard_init.fill(shards, *found)
        return ShardedVariable(shards, name=name, reference=like)

    def _update(self, var, fn, args, kwargs, group):
        if not isinstance(var, _sharded_variable.ShardedVariable):
            return super()._update(var, fn, args, kwargs, group)
        optimizer = shard_updates.keras_optimizer_of(fn)
        if optimizer is not None and not shard_updates.is_shard_wise(optimizer):
            shard_updates.warn_whole_update(optimizer, var)
            with _distribute_lib.UpdateContext(None):  # the whole container at once, as TF would
                result = fn(var, *self._select_single_value(args), **self._select_single_value(kwargs))
                return result if group else tf.nest.map_structure(self._local_results, result)
        # One update per shard, colocated with it (so on its server), with the gradient's rows of that shard
        # and the same shard of every slot; the split of the gradient itself runs where the gradient is.
        parts = shard_updates.ByShard(var)
        results = []
        for i, shard in enumerate(var.variables):
            shard_args, shard_kwargs = parts.select(args, i), parts.select(kwargs, i)
            with shard_updates.optimizer_on_shard(optimizer, var, i):
                results.append(super()._update(shard, fn, shard_args, shard_kwargs, group))
        return tuple(results)


def _zeros(shape: tuple, dtype):
    # Called inside the shard's creation, under its server's device: the zeros are made there.
    return lambda: tf.zeros(shape, dtype)


def _zeros_per_shard(kwargs: dict, initializer, shape: tuple, dtype) -> dict:
    """kwargs whose initial value TF can call per shard (`partition_shape`, parameter_server_strategy_v2.py
    `init_shard_fn`): zeros of the shard's shape, made on its server (filled afterwards, `shard_init.fill`).
    Called without a partition (a variable placed whole) it is Keras' own initializer, as before."""

    def initial_value(partition_shape=None, partition_offset=None):
        if partition_shape is None:
            return initializer(shape, dtype=dtype)
        return tf.zeros(partition_shape, dtype)

    return {**kwargs, "initial_value": initial_value, "shape": tf.TensorShape(shape), "dtype": tf.as_dtype(dtype)}


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


# --- Atomic updates of Keras variables ----------------------------------------------------------------
# Keras 3's Variable.assign_add is `assign(self + value)`: a read, then a write. Workers run steps at once
# against the same variables on the servers, so two of them can read the same total and one update is lost;
# a metric's total and count then disagree (a distributed evaluate's accuracy came out far below the model's).
_stock_assign_add = _KerasVariable.assign_add
_stock_assign_sub = _KerasVariable.assign_sub
_own = {name: name in vars(_KerasVariable) for name in ("assign_add", "assign_sub")}  # else inherited
_atomic_open = 0


def _atomic(stock, op: str):
    def update(self, value):
        backend = _backend(self)
        if _in_stateless_scope() or isinstance(backend, _sharded_variable.ShardedVariable):
            return stock(self, value)
        value = tf.cast(self._convert_to_tensor(value, dtype=self._dtype), backend.dtype)
        return getattr(backend, op)(value)  # one AssignAdd/AssignSub op, on the variable's server

    return update


@contextlib.contextmanager
def atomic_updates() -> Iterator[None]:
    """While open, `assign_add`/`assign_sub` of Keras variables are single AssignAddVariableOp /
    AssignSubVariableOp ops (atomic on the server that holds the variable), as tf.Variable's are.

    Opened around the tracing of a tfdist worker function, like `sharded_gradients()`, and process-wide for
    the same reason; the stock methods come back when the last block closes."""
    global _atomic_open
    with _lock:
        if not _atomic_open:
            _KerasVariable.assign_add = _atomic(_stock_assign_add, "assign_add")
            _KerasVariable.assign_sub = _atomic(_stock_assign_sub, "assign_sub")
        _atomic_open += 1
    try:
        yield
    finally:
        with _lock:
            _atomic_open -= 1
            if not _atomic_open:
                for name, stock in (("assign_add", _stock_assign_add), ("assign_sub", _stock_assign_sub)):
                    if _own[name]:
                        setattr(_KerasVariable, name, stock)
                    else:
                        delattr(_KerasVariable, name)
