"""Keras weight regularizers under ZeRO stage 3: each replica adds the penalty of the piece it holds, or, for one
that reads the whole weight, of the weight gathered from every replica's piece."""

from __future__ import annotations

import keras
import tensorflow as tf

from tfdist.zero.fsdp._keras import local_replica_index
from tfdist.zero.fsdp.param import FsdpParam

__all__ = ["ADDITIVE", "GatheredRegularizer", "PieceRegularizer", "gather_regularizers", "shard_regularizers"]

# Penalties that are sums over elements: the pieces' penalties add up to the whole weight's.
ADDITIVE = (keras.regularizers.L1, keras.regularizers.L2, keras.regularizers.L1L2)


class PieceRegularizer(keras.regularizers.Regularizer):
    """Stands in for an L1, L2 or L1L2 regularizer of a stage-3 weight, whose whole value exists nowhere.

    Inside a training step each replica returns the penalty of its own piece times the replica count: Keras
    divides every added loss by that count, so the penalty's gradient of each element is taken once, on the
    replica that holds it, as at stage 0 (where every replica adds penalty / count for the whole weight and
    the gradients are summed); and the loss Keras reports (each replica's, times the count, averaged) is the
    whole weight's penalty. Read outside a step (`model.losses`), it is the original on the whole weight.
    Its config is the original's.
    """

    def __init__(self, original: keras.regularizers.Regularizer, param: FsdpParam):
        self.original, self.param = original, param

    def __call__(self, x):
        ctx = tf.distribute.get_replica_context()
        if ctx is None or not tf.distribute.has_strategy():
            return self.original(x)
        piece = self.original(self.param.local_piece())
        return piece * tf.cast(ctx.num_replicas_in_sync, piece.dtype)

    def get_config(self) -> dict:
        return self.original.get_config()


def shard_regularizers(variables: list, params: list[FsdpParam]) -> None:
    """Gives every variable whose regularizer is one of `ADDITIVE` a `PieceRegularizer` over its `FsdpParam`."""
    for variable, param in zip(variables, params):
        if type(getattr(variable, "regularizer", None)) in ADDITIVE:
            variable.regularizer = PieceRegularizer(variable.regularizer, param)


class GatheredRegularizer(keras.regularizers.Regularizer):
    """Stands in for a regularizer of a stage-3 weight that reads the whole weight (Keras' OrthogonalRegularizer,
    a user's own): inside a training step each replica all-gathers the weight from its unit's pieces (as the
    unit's call does) and takes the original penalty on it, as every replica does at stage 0.

    The penalty's gradient reaches only the replica's own piece, the slice of the whole weight's gradient it
    holds, times the replica count: Keras divides every added loss by that count, and at stage 0 the replicas'
    gradients are then summed, where here each piece gets its part from its own replica alone. Read outside a
    step (`model.losses`), it is the original on the whole weight. Its config is the original's.
    """

    def __init__(self, original: keras.regularizers.Regularizer, unit, index: int):
        self.original, self.unit, self.index = original, unit, index

    def __call__(self, x):
        ctx = tf.distribute.get_replica_context()
        if ctx is None or not tf.distribute.has_strategy():
            return self.original(x)
        param = self.unit.params[self.index][1]
        pieces = [tf.convert_to_tensor(p.local_piece()) for _, p in self.unit.params]
        replica, k = param.shard_ids[local_replica_index(ctx)], param.piece_size
        count = ctx.num_replicas_in_sync

        @tf.custom_gradient
        def penalty(mine):
            whole = self.unit.gather(ctx, [mine if j == self.index else p for j, p in enumerate(pieces)])
            with tf.GradientTape() as tape:
                tape.watch(whole[self.index])
                value = self.original(whole[self.index])
            # Only this replica's slice of the penalty's gradient is kept for the backward (a copy: a slice could
            # keep the whole gradient's buffer alive), so the gathered weight is freed once the penalty is taken.
            flat = tf.reshape(tape.gradient(value, whole[self.index]), [-1])
            flat = tf.pad(flat, [[0, k * param.num_shards - param.size]])
            own = tf.raw_ops.DeepCopy(x=flat[replica * k:(replica + 1) * k])

            def grad(dy):
                return dy * tf.cast(count, dy.dtype) * own

            return value, grad

        return penalty(pieces[self.index])

    def get_config(self) -> dict:
        return self.original.get_config()


def gather_regularizers(units: list) -> None:
    """Gives every weight of `units` (FsdpUnits) whose regularizer is not one of `ADDITIVE` a
    `GatheredRegularizer` over its unit."""
    for unit in units:
        for j, (variable, _) in enumerate(unit.params):
            regularizer = getattr(variable, "regularizer", None)
            if regularizer is not None and not isinstance(regularizer, (PieceRegularizer, GatheredRegularizer)) \
                    and type(regularizer) not in ADDITIVE:
                variable.regularizer = GatheredRegularizer(regularizer, unit, j)
