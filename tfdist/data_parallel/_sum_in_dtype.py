"""StrategyExtended internals: a step's gradient reduction carried in another dtype, gradient by gradient.

Reaches into `StrategyExtended._batch_reduce_to` and `_replica_ctx_all_reduce` (TF 2.21; see _compat's version
check), as `_grad_path` does. `_grad_path` concatenates a step's gradients into buckets on each replica's device;
a mesh cannot: the gradients of a split layer's shard k live on every row's k-th device, and summing them there is
the point of the mesh. So here each gradient is cast where each of its components lives, reduced by the class's
own reduction (same destinations, same collective), and cast back where each result lives.

Only the gradients' sum is cast: SUM reductions of floating values while a Keras optimizer applies gradients
(`keras_optimizer.applying()`), never a metric's or a synchronized statistic's.
"""

from __future__ import annotations

import tfdist._compat  # noqa: F401  (the TF/Keras version check, before any reach-in below)

import functools

import tensorflow as tf
from tensorflow.python.distribute import distribute_utils as _distribute_utils
from tensorflow.python.distribute import values as _values

from tfdist.comm.sum_dtype import gradient_sum_dtype

__all__ = ["sum_gradients_in"]


def sum_gradients_in(extended, dtype: tf.DType | None, where: str):
    """`extended` (a StrategyExtended tfdist made, not yet handed to its strategy) summing gradients in `dtype`;
    unchanged when `dtype` is None. `where` names the strategy in errors."""
    if dtype is None:
        return extended
    # The extended is tfdist's own object of one of several classes (in one process, across processes, over
    # Horovod): giving it the subclass here keeps every place that creates one unaware of grad_dtype.
    extended.__class__ = _summing_in(type(extended))
    extended.tfdist_sum_dtype, extended.tfdist_sum_where = dtype, where
    return extended


@functools.cache
def _summing_in(extended_class: type) -> type:
    class SumInDtypeExtended(extended_class):
        tfdist_sum_dtype: tf.DType | None = None
        tfdist_sum_where = ""

        def _sum_dtype(self, reduce_op) -> tf.DType | None:
            if reduce_op != tf.distribute.ReduceOp.SUM:
                return None
            return gradient_sum_dtype(self.tfdist_sum_dtype, self.tfdist_sum_where)

        def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
            dtype = self._sum_dtype(reduce_op)
            if dtype is None:
                return super()._batch_reduce_to(reduce_op, value_destination_pairs, options)
            sent = [(_cast(v, dtype), d) for v, d in value_destination_pairs]
            out = super()._batch_reduce_to(reduce_op, sent, options)
            return [_cast(o, _dtype_of(v)) for o, (v, _) in zip(out, value_destination_pairs)]

        def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
            # With merge_call the replicas meet in _batch_reduce_to above; without it (MirroredStrategy does so
            # for a step compiled by XLA on GPUs only) each replica reduces here.
            dtype = None if self._use_merge_call() else self._sum_dtype(reduce_op)
            if dtype is None:
                return super()._replica_ctx_all_reduce(reduce_op, value, options)
            flat = tf.nest.flatten(value)
            out = tf.nest.flatten(super()._replica_ctx_all_reduce(reduce_op, [_cast(v, dtype) for v in flat], options))
            return tf.nest.pack_sequence_as(value, [_cast(o, _dtype_of(v)) for o, v in zip(out, flat)])

    SumInDtypeExtended.__name__ = SumInDtypeExtended.__qualname__ = f"SumInDtype{extended_class.__name__}"
    return SumInDtypeExtended


def _dtype_of(value) -> tf.DType | None:
    parts = value.values if isinstance(value, tf.distribute.DistributedValues) else (value,)
    return parts[0].dtype if parts and tf.is_tensor(parts[0]) else None


def _cast(value, dtype: tf.DType | None):
    """`value` (a tensor or per-replica/mirrored tensors) cast to `dtype` where each component lives; anything
    that is not a dense floating tensor (IndexedSlices, integers, a variable) is left as it is."""
    if dtype is None:
        return value
    if isinstance(value, tf.distribute.DistributedValues):
        parts = value.values
        if not all(_dense_float(p) for p in parts) or all(p.dtype == dtype for p in parts):
            return value
        cast = []
        for p in parts:
            with tf.device(p.device):
                cast.append(tf.cast(p, dtype))
        wrap = _values.Mirrored if isinstance(value, _values.Mirrored) else _values.PerReplica
        return _distribute_utils.regroup(cast, wrap_class=wrap, always_wrap=True)
    if not _dense_float(value) or value.dtype == dtype:
        return value
    with tf.device(value.device):
        return tf.cast(value, dtype)


def _dense_float(value) -> bool:
    return (tf.is_tensor(value) and not isinstance(value, (tf.IndexedSlices, tf.Variable))
            and not isinstance(value, _values.DistributedVariable) and value.dtype.is_floating)
