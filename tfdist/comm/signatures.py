"""Agreement across ranks before a collective: every rank's operation, dtype and shape, exchanged in
one small all-gather, so ranks that call different collectives or pass different tensors get an error
naming each rank's call (on every rank alike) instead of a hang, a TF shape error or wrong bytes.

A signature is one int64 row: [operation, dtype enum, number of dimensions, number of elements, the
first MAX_DIMS dimensions (-1 beyond the rank)].

Example (2 processes, eagerly):
    >>> x = tf.ones([2], tf.float32 if tfdist.comm.rank() == 0 else tf.int32)
    >>> tfdist.comm.all_reduce(x)
    ConfigError: tfdist.comm.all_reduce: the processes passed different tensors (rank 0: float32 (2,);
    rank 1: int32 (2,)). Every rank of the group must pass the same dtype and shape.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfdist.comm.process_group import Backend, Group
from tfdist.comm.state import guard
from tfdist.errors import ConfigError

__all__ = ["MAX_DIMS", "check_same", "describe", "first_dims", "signatures"]

MAX_DIMS = 8  # dimensions a signature carries (the element count covers the rest)
#: the collectives that exchange signatures; a signature's first column is the index here
OPERATIONS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all")
_FIRST_DIM = 4  # column of the first dimension


def signatures(backend: Backend, x: tf.Tensor, group: Group, what: str) -> tf.Tensor:
    """[group.size, 4 + MAX_DIMS] int64: every member's signature of its call `what`(x), in group-rank order."""
    dims = tf.shape(x, out_type=tf.int64)[:MAX_DIMS]
    pad = tf.fill([MAX_DIMS - tf.size(dims, out_type=tf.int32)], tf.constant(-1, tf.int64))
    head = tf.constant([OPERATIONS.index(what), x.dtype.as_datatype_enum, x.shape.rank], tf.int64)
    own = tf.concat([head, [tf.size(x, out_type=tf.int64)], dims, pad], 0)
    return backend.all_gather(own[None, :], group)


def first_dims(table: tf.Tensor) -> tf.Tensor:
    """Every member's first dimension, from a signature table."""
    return table[:, _FIRST_DIM]


def describe(row: np.ndarray) -> str:
    """'float32 (2, 3)' for a signature row."""
    ndims = int(row[2])
    dims = tuple(int(d) for d in row[_FIRST_DIM:_FIRST_DIM + min(ndims, MAX_DIMS)])
    return f"{tf.as_dtype(int(row[1])).name} {dims}"


def check_same(backend: Backend, x: tf.Tensor, group: Group, what: str,
               first_dim_free: bool = False) -> tuple[tf.Tensor, tf.Tensor]:
    """Exchanges the members' signatures and fails (on every member alike) when they differ: in the
    operation, dtype and shape, or, with `first_dim_free`, in all but the first dimension.

    Returns (x, table). Inside tf.function the check is an Assert, and the returned `x` waits for it:
    give that `x` to the collective, so a mismatch stops the function before the collective starts.
    """
    table = guard(what, group.ranks, lambda: signatures(backend, x, group, what))
    columns = [0, 1, 2] + list(range(_FIRST_DIM + 1 if first_dim_free else 3, _FIRST_DIM + MAX_DIMS))
    picked = tf.gather(table, columns, axis=1)
    if tf.executing_eagerly():
        values = picked.numpy()
        if not (values == values[0]).all():
            raise ConfigError(_mismatch(what, group, table.numpy(), first_dim_free))
        return x, table
    same = tf.reduce_all(tf.equal(picked, picked[:1]))
    message = (f"tfdist.comm.{what}: the ranks of group {list(group.ranks)} called different collectives or passed "
               f"different dtypes or shapes. One row per rank: [operation in {OPERATIONS}, dtype enum, ndims, "
               "size, dims...]:")
    with tf.control_dependencies([tf.debugging.Assert(same, [message, table], summarize=64)]):
        return tf.identity(x), tf.identity(table)


def _mismatch(what: str, group: Group, rows: np.ndarray, first_dim_free: bool) -> str:
    if not (rows[:, 0] == rows[0, 0]).all():
        calls = "; ".join(f"rank {r}: {OPERATIONS[int(row[0])]}" for r, row in zip(group.ranks, rows))
        return (f"tfdist.comm.{what}: the processes called different collectives ({calls}). Every process of the "
                "group must call the same collectives in the same order.")
    per_rank = "; ".join(f"rank {r}: {describe(row)}" for r, row in zip(group.ranks, rows))
    need = ("the same dtype, number of dimensions and all but the first dimension" if first_dim_free
            else "the same dtype and shape")
    return (f"tfdist.comm.{what}: the processes passed different tensors ({per_rank}). Every rank of the group must "
            f"pass {need}.")
