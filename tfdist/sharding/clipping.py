"""ZeRO's gradient clipping, on the global (reduced) gradient: as flat shards (stages 1/2) or per-variable pieces
(stage 3). Stock Keras clips each replica's local gradient before the all-reduce; here the norms are those of the
summed gradient: clipnorm per variable, global_clipnorm over all variables, clipvalue element-wise on the sum."""

from __future__ import annotations

import tensorflow as tf

from tfdist.comm.shard_collectives import ShardCollectives

__all__ = ["clip_flat_shards", "clip_pieces"]


def clip_pieces(optimizer, comm: ShardCollectives, grads: list) -> list:
    """Keras' clipping options applied to the summed gradient, given as pieces: `grads[i][j]` is local
    replica i's piece of variable j's reduced gradient (padding elements are zero, so they add nothing
    to a norm). clipvalue clips element-wise; clipnorm scales each variable by its own global norm and
    global_clipnorm all variables by the norm of all, the squares summed over every replica's pieces
    (one small all-reduce). Returns the pieces in the same layout.

    Stock Keras clips each replica's local gradient before the all-reduce; ZeRO's norms are those of the
    summed gradient, as at stages 1 and 2 (`clip_flat_shards`).

    Example:
        >>> opt = keras.optimizers.SGD(clipnorm=1.0)
        >>> [[g.numpy().tolist() for g in row] for row in clip_pieces(opt, tfdist.sharding.LocalCollectives(
        ...     ["/cpu:0", "/cpu:0"]), [[tf.constant([3.0])], [tf.constant([4.0])]])]   # norm 5
        [[[0.6000000238418579]], [[0.800000011920929]]]
    """
    if optimizer.clipvalue:
        return [[tf.clip_by_value(g, -optimizer.clipvalue, optimizer.clipvalue) for g in row] for row in grads]
    if optimizer.global_clipnorm:
        limit = optimizer.global_clipnorm
        totals = comm.all_reduce_sum([tf.add_n([tf.reduce_sum(tf.square(g)) for g in row]) for row in grads])
        return [[g * tf.cast(limit / tf.maximum(tf.sqrt(total), limit), g.dtype) for g in row]
                for row, total in zip(grads, totals)]
    if optimizer.clipnorm:
        limit = optimizer.clipnorm
        totals = comm.all_reduce_sum([tf.stack([tf.reduce_sum(tf.square(g)) for g in row]) for row in grads])
        out = []
        for row, total in zip(grads, totals):
            factors = limit / tf.maximum(tf.sqrt(total), limit)
            out.append([g * tf.cast(factors[j], g.dtype) for j, g in enumerate(row)])
        return out
    return grads


def clip_flat_shards(optimizer, comm: ShardCollectives, layout, shards: list, global_norm: bool = True) -> list:
    """The same on flat shards (stages 1/2): `shards[i]` is local replica i's shard of the concatenated reduced
    gradient, `layout` the engine's FlatLayout (which variable each element belongs to). `global_norm=False`
    leaves global_clipnorm to the caller (a GroupedZeroEngine clips by the norm over all its engines)."""
    opt = optimizer
    if opt.global_clipnorm and not global_norm:
        return shards
    if opt.clipvalue:
        return [tf.clip_by_value(s, -opt.clipvalue, opt.clipvalue) for s in shards]
    if opt.global_clipnorm:
        sq = [tf.reduce_sum(tf.square(s)) for s in shards]
        totals = comm.all_reduce_sum(sq)
        out = []
        for s, total in zip(shards, totals):
            norm = tf.sqrt(total)
            out.append(s * tf.cast(opt.global_clipnorm / tf.maximum(norm, opt.global_clipnorm), s.dtype))
        return out
    if opt.clipnorm:
        nvar = len(layout.sizes)
        seg = [tf.constant(layout.segment_ids(sid)) for sid in comm.shard_ids]
        sq = [tf.math.unsorted_segment_sum(tf.square(s), ids, nvar + 1) for s, ids in zip(shards, seg)]
        totals = comm.all_reduce_sum(sq)
        out = []
        for s, total, ids in zip(shards, totals, seg):
            factor = opt.clipnorm / tf.maximum(tf.sqrt(total), opt.clipnorm)
            out.append(s * tf.gather(tf.cast(factor, s.dtype), ids))
        return out
    return shards
