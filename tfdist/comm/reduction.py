"""Reductions: the ops of all_reduce / reduce / reduce_scatter, over ranks and locally, in every dtype.

'mean' is a sum divided by the group size: floating and complex divide, integers floor-divide (like
NumPy's `//`), bool has no mean ('max' is any, 'min' is all). Complex 'max'/'min' are undefined.

Example:
    >>> local_reduce(tf.constant([[1, 2], [4, 7]]), "mean", "all_reduce").numpy()   # two rows = two ranks
    array([2, 4], dtype=int32)
"""

from __future__ import annotations

import tensorflow as tf

from tfdist.comm.process_group import Backend, Group
from tfdist.comm.wire import carry, encode_reduce
from tfdist.errors import ConfigError

__all__ = ["REDUCE_OPS", "all_reduce_over", "check_op_for", "local_reduce", "reduce_op_name"]

#: the reductions of all_reduce / reduce / reduce_scatter
REDUCE_OPS = ("sum", "mean", "max", "min", "prod")
_LOCAL = {"sum": tf.reduce_sum, "mean": tf.reduce_sum, "prod": tf.reduce_prod, "max": tf.reduce_max,
          "min": tf.reduce_min}


def reduce_op_name(op: object, what: str) -> str:
    """'sum', 'mean', 'max', 'min' or 'prod' for `op` (any case, or a tf.distribute.ReduceOp)."""
    if isinstance(op, tf.distribute.ReduceOp):
        op = op.value
    name = op.lower() if isinstance(op, str) else None
    if name not in REDUCE_OPS:
        raise ConfigError(f"tfdist.comm.{what}: op must be one of {list(REDUCE_OPS)} (or "
                          f"tf.distribute.ReduceOp.SUM/MEAN), got {op!r}.")
    return name


def check_op_for(dtype: tf.DType, op: str, what: str) -> None:
    """ConfigError when `op` has no meaning for `dtype` (checked before anything is sent)."""
    if dtype == tf.bool and op == "mean":
        raise ConfigError(f"tfdist.comm.{what}: op='mean' is not defined for bool tensors; use 'max' (any) or "
                          "'min' (all).")
    if dtype.is_complex and op in ("max", "min"):
        raise ConfigError(f"tfdist.comm.{what}: op={op!r} is not defined for complex tensors ({dtype.name}); use "
                          "'sum', 'mean' or 'prod', or reduce tf.math.abs(x).")


def _mean(total: tf.Tensor, n) -> tf.Tensor:
    count = tf.cast(n, total.dtype)
    return total / count if (total.dtype.is_floating or total.dtype.is_complex) else tf.math.floordiv(total, count)


def local_reduce(stacked: tf.Tensor, op: str, what: str) -> tf.Tensor:
    """Reduces axis 0 of `stacked` (one row per rank) with `op`, in its own dtype."""
    check_op_for(stacked.dtype, op, what)
    if stacked.dtype == tf.bool:
        return (tf.reduce_any if op in ("sum", "max") else tf.reduce_all)(stacked, axis=0)
    out = _LOCAL[op](stacked, axis=0)
    if op != "mean":
        return out
    return _mean(out, stacked.shape[0] if stacked.shape[0] is not None else tf.shape(stacked)[0])


def all_reduce_over(backend: Backend, x: tf.Tensor, op: str, group: Group, what: str) -> tf.Tensor:
    """The `op` reduction of every member's `x` through `backend`, in `x`'s dtype."""
    check_op_for(x.dtype, op, what)
    base = "sum" if op == "mean" else op
    encoded = encode_reduce(x, base, backend.reduce_dtypes, what)
    if encoded is None:  # complex product: gather every rank's tensor, multiply here
        stacked = carry(x[None], backend.move_dtypes, lambda w: backend.all_gather(w, group))
        return local_reduce(stacked, op, what)
    wire, back = encoded
    total = back(backend.all_reduce(wire, base, group))
    return _mean(total, group.size) if op == "mean" else total
