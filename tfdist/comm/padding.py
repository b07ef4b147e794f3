"""Per-rank shapes through collectives that need one shape: pad to the longest, move, cut back.

- all_gather with first dimensions that differ per rank: each rank pads its rows to the longest
  count (known from the signature table), gathers, and keeps each rank's own rows;
- scatter: the root flattens its pieces, pads them to the longest and sends one row per rank, with
  a table of the pieces' shapes so every rank can cut and reshape its own.

Example (2 processes, rank r passes r + 1 rows):
    >>> gather_uneven(backend, tf.ones([comm.rank() + 1, 2]), backend.world, table).shape
    TensorShape([3, 2])
"""

from __future__ import annotations

import tensorflow as tf

from tfdist.comm.process_group import Backend, Group
from tfdist.comm.signatures import first_dims, signatures
from tfdist.comm.wire import carry

__all__ = ["gather_uneven", "pack_pieces", "unpack_piece"]


def gather_uneven(backend: Backend, x: tf.Tensor, group: Group, table: tf.Tensor | None) -> tf.Tensor:
    """All-gather along axis 0 where first dimensions may differ per member. `table` is the members'
    signature table (computed here when None)."""
    def gather(t: tf.Tensor) -> tf.Tensor:
        return carry(t, backend.move_dtypes, lambda w: backend.all_gather(w, group))

    if backend.uneven_all_gather:
        return gather(x)
    sizes = first_dims(signatures(backend, x, group, "all_gather") if table is None else table)
    if tf.executing_eagerly() and int(tf.reduce_min(sizes)) == int(tf.reduce_max(sizes)):
        return gather(x)
    longest = tf.reduce_max(sizes)
    rest = tf.shape(x, out_type=tf.int64)[1:]
    padded = tf.pad(x, tf.concat([[[0, longest - tf.shape(x, out_type=tf.int64)[0]]],
                                  tf.zeros([x.shape.rank - 1, 2], tf.int64)], 0))
    rows = tf.reshape(gather(padded), tf.concat([[group.size, longest], rest], 0))
    return tf.boolean_mask(rows, tf.sequence_mask(sizes, longest))


def pack_pieces(pieces: list[tf.Tensor]) -> tuple[tf.Tensor, tf.Tensor]:
    """(rows, meta): rows[r] is piece r flattened and zero-padded to the longest piece; meta[r] is
    piece r's shape followed by that padded length (all int64)."""
    flats = [tf.reshape(p, [-1]) for p in pieces]
    longest = tf.reduce_max([tf.size(f, out_type=tf.int64) for f in flats])
    rows = tf.stack([tf.pad(f, [[0, longest - tf.size(f, out_type=tf.int64)]]) for f in flats])
    meta = tf.stack([tf.concat([tf.shape(p, out_type=tf.int64), [longest]], 0) for p in pieces])
    return rows, meta


def unpack_piece(row: tf.Tensor, meta_row: tf.Tensor) -> tf.Tensor:
    """The piece a padded row carries, in its shape (`meta_row` from `pack_pieces`)."""
    shape = meta_row[:-1]
    return tf.reshape(row[:tf.reduce_prod(shape)], shape)
