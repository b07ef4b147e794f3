"""Lookup gradients (`tf.IndexedSlices`) kept as slices through ZeRO's flat shards, so that Adam-like optimizers
update an embedding exactly as stock Keras on TensorFlow does.

Keras on TensorFlow hands the optimizer an embedding's gradient as `tf.IndexedSlices`, one slice per lookup, and
stock `tf.distribute` all-reduces slices by concatenating every replica's. Keras' ops square (or take the absolute
value of) each slice separately and sum duplicates only when a slice meets a dense tensor, so Adam's second moment
of a token looked up k times gets the sum of k squares, not the square of the sum. ZeRO's reduce-scatter sums
gradients densely; to give the optimizer what stock gives it, each owner also receives every replica's slices
(one all-gather, of what stock all-gathers) and passes its update step one gradient for its flat shard as
element slices: every element once (zero for a looked-up variable's), then each looked-up row's elements of its
shard once per lookup, in replica order. The optimizer's own ops then sum and square exactly as on the rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from tfdist.zero.collectives import ShardCollectives
from tfdist.zero.flat_layout import FlatLayout

__all__ = ["Slices", "element_slices", "gather_slices", "piece_slices", "rows_of", "shard_gradient"]


class Slices:
    """Every replica's lookups of one variable, in replica order: `indices` [M] (rows) and `values` [M, row size]."""

    def __init__(self, indices: tf.Tensor, values: tf.Tensor):
        self.indices, self.values = indices, values


def rows_of(slices: tf.IndexedSlices, shape: Sequence[int]) -> tuple[tf.Tensor, tf.Tensor]:
    """(indices as int64 [n], values as [n, elements per row]) of one replica's slices of a variable of `shape`."""
    row = int(np.prod(shape[1:], dtype=np.int64))
    # New tensors, never the caller's: indices made outside the replica function are one object on every replica,
    # which merge_call would hand back as one value instead of one per replica.
    return tf.identity(tf.cast(slices.indices, tf.int64)), tf.reshape(slices.values, [-1, row])


def gather_slices(comm: ShardCollectives, indices: Sequence[tf.Tensor], values: Sequence[tf.Tensor]) -> list[Slices]:
    """All-gathers every replica's slices of one variable: `indices[i]` [n_i] and `values[i]` [n_i, row] are local
    replica i's. Replicas may look up different numbers of rows, and a collective gathers equal lengths: each pads
    to the longest (the lengths gathered first) and the padding is dropped again. Returns, for each local replica,
    the slices of all replicas in global replica order, on its device."""
    lengths = comm.all_gather([tf.reshape(tf.cast(tf.shape(ix)[0], tf.float64), [1]) for ix in indices])
    out = []
    padded_indices, padded_values, masks = [], [], []
    for ix, vals, counts, device in zip(indices, values, lengths, comm.devices):
        with tf.device(device):
            counts = tf.cast(counts, tf.int32)  # float64 carries any count exactly
            longest = tf.reduce_max(counts)
            pad = longest - tf.shape(ix)[0]
            # Row numbers travel as float64 (exact below 2**53), the dtype every transport gathers.
            padded_indices.append(tf.pad(tf.cast(ix, tf.float64), [[0, pad]]))
            padded_values.append(tf.reshape(tf.pad(vals, [[0, pad], [0, 0]]), [-1]))
            masks.append((tf.reshape(tf.sequence_mask(counts, longest), [-1]), longest))
    all_indices = comm.all_gather(padded_indices)
    all_values = comm.all_gather(padded_values)
    for gathered_ix, gathered_vals, (mask, longest), vals, device in zip(all_indices, all_values, masks, values,
                                                                            comm.devices):
        with tf.device(device):
            row = int(vals.shape[1])
            out.append(Slices(tf.cast(tf.boolean_mask(gathered_ix, mask), tf.int64),
                              tf.boolean_mask(tf.reshape(gathered_vals, [-1, row]), mask)))
    return out


def element_slices(rows: Slices, first: int, size: int) -> tuple[tf.Tensor, tf.Tensor]:
    """(positions, values) of the looked-up elements that fall into a range of `size` elements of the flattened
    variable, whose element 0 sits at position `first` of that range (negative when the range starts later).
    A row looked up k times gives k entries per element, in the order of `rows`."""
    width = int(rows.values.shape[1])
    elements = tf.reshape(first + rows.indices[:, None] * width + tf.range(width, dtype=tf.int64)[None, :], [-1])
    inside = (elements >= 0) & (elements < size)
    return tf.boolean_mask(elements, inside), tf.boolean_mask(tf.reshape(rows.values, [-1]), inside)


def piece_slices(comm: ShardCollectives, indices: Sequence[tf.Tensor], values: Sequence[tf.Tensor],
                 piece_size: int) -> list[tuple[tf.Tensor, tf.Tensor]]:
    """Stage 3: every replica's lookups of one variable (`gather_slices`' arguments) as element slices of each local
    replica's piece (piece r: elements [r * piece_size, (r + 1) * piece_size) of the flattened variable)."""
    out = []
    for rows, shard, device in zip(gather_slices(comm, indices, values), comm.shard_ids, comm.devices):
        with tf.device(device):
            out.append(element_slices(rows, -shard * piece_size, piece_size))
    return out


def shard_gradient(layout: FlatLayout, shard: int, dense: tf.Tensor, sliced: dict[int, Slices],
                   clip=None) -> tf.Tensor | tf.IndexedSlices:
    """The gradient of flat shard `shard` for the optimizer's update: `dense` (the shard of the reduced dense
    gradient) itself when the shard holds no element of a variable in `sliced`; otherwise element slices: every
    element once with its dense value, zero for the elements of the variables in `sliced` (a zero adds nothing to a
    sum or a sum of squares), then one slice per looked-up element of this shard (a row looked up k times gives k).
    `clip(values, positions)` scales or clips the slices' values as the dense shard was (`positions`: theirs in the
    shard)."""
    size = layout.shard_size
    mine = [p for p in layout.pieces(shard) if p.var in sliced]
    if not mine:
        return dense
    everywhere = tf.range(size, dtype=tf.int64)
    looked_up = tf.zeros([size], tf.bool)
    for p in mine:
        looked_up |= (everywhere >= p.offset) & (everywhere < p.offset + p.size)
    positions, values = [everywhere], [tf.where(looked_up, tf.zeros_like(dense), dense)]
    for j in sorted({p.var for p in mine}):
        at, picked = element_slices(sliced[j], layout.offsets[j] - shard * size, size)
        positions.append(at)
        values.append(clip(picked, at) if clip is not None else picked)
    return tf.IndexedSlices(tf.concat(values, 0), tf.concat(positions, 0), tf.constant([size], tf.int64))
