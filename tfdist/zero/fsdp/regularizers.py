"""Keras weight regularizers under ZeRO stage 3: each replica adds the penalty of the piece it holds."""

from __future__ import annotations

import keras
import tensorflow as tf

from tfdist.zero.fsdp.param import FsdpParam

__all__ = ["ADDITIVE", "PieceRegularizer", "shard_regularizers"]

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
    """Gives every regularized variable (its regularizer one of `ADDITIVE`, checked by the caller) a
    `PieceRegularizer` over its `FsdpParam`."""
    for variable, param in zip(variables, params):
        if getattr(variable, "regularizer", None) is not None and not isinstance(variable.regularizer,
                                                                                  PieceRegularizer):
            variable.regularizer = PieceRegularizer(variable.regularizer, param)
