"""Loss scaling across replicas: one decision per step on whether the gradients are finite.

Keras' `LossScaleOptimizer` (what `mixed_float16` adds) skips a step whose gradients hold an inf or a NaN and
halves its loss scale. Under a TF strategy it decides from the gradients *before* they are summed across replicas:
from replica 0's own gradients in a merge_call (MirroredStrategy), or from each replica's own where replicas do not
merge (MultiWorkerMirroredStrategy). Then a step whose overflow came from another replica's samples is applied,
and the sum's inf goes into every weight; or replicas decide differently. Stock `tf.distribute.MirroredStrategy`
with 4 devices does the first. Here each replica's verdict is summed across all of them, so every replica, shard
and process skips the same steps and keeps the same scale, as one device with the global batch does.
"""

from __future__ import annotations

import tensorflow as tf

from tfdist._compat import keras_optimizer

__all__ = ["agree_on_finite_gradients"]


def agree_on_finite_gradients(optimizer) -> None:
    """Makes a LossScaleOptimizer built under a strategy of several replicas decide once per step, for all of them,
    whether the gradients are finite (one all-reduce of a flag)."""

    def check_finite(self, grads):
        finite = keras_optimizer.stock_check_finite(self, grads)
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return finite
        not_finite = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(finite), tf.float32))
        return tf.equal(not_finite, 0.0)

    keras_optimizer.override_check_finite(optimizer, check_finite)
