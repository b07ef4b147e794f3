"""ZeRO's gradient clipping, on the global (reduced) gradient: as flat shards (stages 1/2) or per-variable pieces
(stage 3). Stock Keras clips each replica's local gradient before the all-reduce; here the norms are those of the
summed gradient: clipnorm per variable, global_clipnorm over all variables, clipvalue element-wise on the sum. A
lookup's slices (`tfdist.zero.sliced_gradients`) are scaled by their variable's factor, or clipped slice by slice."""

from __future__ import annotations

import tensorflow as tf

from tfdist.zero.collectives import ShardCollectives

__all__ = ["clip_flat_shards", "clip_pieces", "flat_clip_factors", "flat_scale_factors", "logical_clip_factors",
           "piece_clip_factors", "piece_scale_factors"]


def clip_pieces(optimizer, comm: ShardCollectives, grads: list) -> list:
    """Keras' clipping options applied to the summed gradient, given as pieces: `grads[i][j]` is local
    replica i's piece of variable j's reduced gradient (padding elements are zero, so they add nothing
    to a norm). clipvalue clips element-wise; clipnorm scales each variable by its own global norm and
    global_clipnorm all variables by the norm of all, the squares summed over every replica's pieces
    (one small all-reduce). Returns the pieces in the same layout.

    Stock Keras clips each replica's local gradient before the all-reduce; ZeRO's norms are those of the
    summed gradient, as at stages 1 and 2 (`flat_clip_factors`).

    Example:
        >>> opt = keras.optimizers.SGD(clipnorm=1.0)
        >>> [[g.numpy().tolist() for g in row] for row in clip_pieces(opt, tfdist.zero.collectives.LocalCollectives(
        ...     ["/cpu:0", "/cpu:0"]), [[tf.constant([3.0])], [tf.constant([4.0])]])]   # norm 5
        [[[0.6000000238418579]], [[0.800000011920929]]]
    """
    if optimizer.clipvalue:
        return [[tf.clip_by_value(g, -optimizer.clipvalue, optimizer.clipvalue) for g in row] for row in grads]
    factors = piece_clip_factors(optimizer, comm, grads)
    return grads if factors is None else [[g * f for g, f in zip(row, fs)] for row, fs in zip(grads, factors)]


def piece_clip_factors(optimizer, comm: ShardCollectives, grads: list) -> list | None:
    """What `clip_pieces` multiplies local replica i's piece of variable j by (`factors[i][j]`, a scalar); None
    without norm clipping. The engine scales an embedding's slices by the same factors."""
    if optimizer.global_clipnorm:
        limit = optimizer.global_clipnorm
        totals = comm.all_reduce_sum([tf.add_n([tf.reduce_sum(tf.square(g)) for g in row]) for row in grads])
        return [[tf.cast(limit / tf.maximum(tf.sqrt(total), limit), g.dtype) for g in row]
                for row, total in zip(grads, totals)]
    if optimizer.clipnorm:
        limit = optimizer.clipnorm
        totals = comm.all_reduce_sum([tf.stack([tf.reduce_sum(tf.square(g)) for g in row]) for row in grads])
        out = []
        for row, total in zip(grads, totals):
            factors = limit / tf.maximum(tf.sqrt(total), limit)
            out.append([tf.cast(factors[j], g.dtype) for j, g in enumerate(row)])
        return out
    return None


def flat_clip_factors(optimizer, comm: ShardCollectives, layout, shards: list) -> list | None:
    """What the flat shards (stages 1/2) are clipped by: for local replica i's shard of the concatenated reduced
    gradient (`layout`: the engine's FlatLayout), a scalar (global_clipnorm) or one factor per element of the shard
    (clipnorm: its variable's); None without norm clipping (clipvalue clips element-wise). A GroupedZeroEngine's
    groups scale by `logical_clip_factors` instead (norms over all its groups). The engine scales an embedding's
    slices by the same factors (`tfdist.zero.sliced_gradients`)."""
    opt = optimizer
    if opt.global_clipnorm:
        totals = comm.all_reduce_sum([tf.reduce_sum(tf.square(s)) for s in shards])
        return [tf.cast(opt.global_clipnorm / tf.maximum(tf.sqrt(total), opt.global_clipnorm), s.dtype)
                for s, total in zip(shards, totals)]
    if opt.clipnorm:
        nvar = len(layout.sizes)
        seg = [tf.constant(layout.segment_ids(sid)) for sid in comm.shard_ids]
        sq = [tf.math.unsorted_segment_sum(tf.square(s), ids, nvar + 1) for s, ids in zip(shards, seg)]
        totals = comm.all_reduce_sum(sq)
        return [tf.gather(tf.cast(opt.clipnorm / tf.maximum(tf.sqrt(total), opt.clipnorm), s.dtype), ids)
                for s, total, ids in zip(shards, totals, seg)]
    return None


def logical_clip_factors(optimizer, squares: list, members: list[list[int]], devices: list[list[str]]) -> list:
    """Clip factors for variables held in several groups (a split variable's shards: one per group), as one
    device computes them on the logical variables. `squares[g][i]` is group g's vector of per-variable sums of
    squares of the summed gradient (over every replica) at its local replica i, on `devices[g][i]`;
    `members[g][j]` the logical variable group g's variable j belongs to (shards of one split variable share
    it). clipnorm: the norm of a logical variable is sqrt(the sum of its shards' squares); global_clipnorm: the
    norm over everything. Returns `factors[g][i]`: a vector (one factor per variable of group g) or a scalar.

    Example:
        >>> opt = keras.optimizers.SGD(clipnorm=1.0)    # one logical variable in two groups: norm 5
        >>> f = logical_clip_factors(opt, [[tf.constant([9.0])], [tf.constant([16.0])]], [[0], [0]],
        ...                          [["/cpu:0"], ["/cpu:0"]])
        >>> [round(float(g[0][0]), 6) for g in f]
        [0.2, 0.2]
    """
    global_norm = bool(optimizer.global_clipnorm)
    limit = optimizer.global_clipnorm if global_norm else optimizer.clipnorm
    ids = tf.constant([m for group in members for m in group], tf.int32)
    count = max(m for group in members for m in group) + 1
    factors = [[None] * len(row) for row in devices]
    for i in range(len(devices[0])):
        with tf.device(devices[0][i]):  # one sum per local replica, so every shard of a variable gets one factor
            flat = tf.concat([squares[g][i] for g in range(len(devices))], 0)
            if global_norm:
                total = tf.reduce_sum(flat)
                factor = limit / tf.maximum(tf.sqrt(total), limit)
            else:
                totals = tf.math.unsorted_segment_sum(flat, ids, count)
                by_logical = limit / tf.maximum(tf.sqrt(totals), limit)
        for g in range(len(devices)):
            with tf.device(devices[g][i]):
                factors[g][i] = tf.identity(factor) if global_norm else tf.gather(by_logical, members[g])
    return factors


def flat_scale_factors(layout, shard_ids: list, devices: list, dtype, factors: list) -> list:
    """`logical_clip_factors`' factors of a group, per local replica, as flat shards (stages 1/2) take them: a
    scalar, or one factor per element of the shard (the padding elements, zero, keep factor 1)."""
    out = []
    for sid, device, f in zip(shard_ids, devices, factors):
        with tf.device(device):
            f = tf.cast(f, dtype)
            if f.shape.rank:
                f = tf.gather(tf.concat([f, tf.ones([1], dtype)], 0), tf.constant(layout.segment_ids(sid)))
            out.append(f)
    return out


def piece_scale_factors(grads: list, factors: list) -> list:
    """`logical_clip_factors`' factors of a group (scalar or per variable, per local replica) as `factors[i][j]`: one
    scalar for local replica i's gradient piece `grads[i][j]` of variable j (stage 3)."""
    return [[tf.cast(f if f.shape.rank == 0 else f[j], g.dtype) for j, g in enumerate(row)]
            for row, f in zip(grads, factors)]


def clip_flat_shards(optimizer, comm: ShardCollectives, layout, shards: list, dtype,
                     clip_factors: list | None = None) -> tuple[list, list]:
    """Keras' clipping options on flat shards (stages 1/2) of the summed gradient: `clip_factors` when a
    GroupedZeroEngine found them over every group, else clipvalue or `flat_clip_factors`. Returns the clipped shards
    and, per local replica, what clips a lookup's slices alike (`fn(values, positions in the shard)`)."""
    if clip_factors is not None:
        factors = flat_scale_factors(layout, comm.shard_ids, comm.devices, dtype, clip_factors)
    elif optimizer.clipvalue:
        limit = optimizer.clipvalue
        clipped = []
        for s, device in zip(shards, comm.devices):
            with tf.device(device):
                clipped.append(tf.clip_by_value(s, -limit, limit))
        return clipped, [lambda values, positions: tf.clip_by_value(values, -limit, limit)] * len(shards)
    else:
        factors = flat_clip_factors(optimizer, comm, layout, shards)
    if factors is None:
        return shards, [None] * len(shards)
    scaled = []
    for s, f, device in zip(shards, factors, comm.devices):
        with tf.device(device):
            scaled.append(s * f)
    return scaled, [lambda values, positions, f=f: values * (f if f.shape.rank == 0 else tf.gather(f, positions))
                    for f in factors]
