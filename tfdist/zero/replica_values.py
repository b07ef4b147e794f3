"""Two small conversions the ZeRO engines share: a Keras variable to the tf.Variable behind it, and gradients to
per-replica values in a cross-replica context."""

from __future__ import annotations

import keras
import tensorflow as tf

from tfdist._compat import distribute as tf_distribute

__all__ = ["as_per_replica", "tf_variable"]


def tf_variable(variable):
    """The tf.Variable (mirrored under a strategy) behind a Keras variable, or a tf.Variable itself:
    Keras 3 optimizers take both, and `.value` is a tensor property on one and a method on the other."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def as_per_replica(strategy, *grads) -> list:
    """Cross-replica context: every gradient as per-replica values. One that is a single tensor (the same on every
    replica, e.g. made outside the replica function) is already this process's sum, as stock tf.distribute reduces
    it: the first local replica gets it and the others zeros, which the sum adds exactly. The replicas then reduce
    a list of one kind, which TF's batch all-reduce needs."""
    n = len(strategy.extended.worker_devices)
    return [g if isinstance(g, tf.distribute.DistributedValues) else tf_distribute.regroup_per_replica(
        [g, *(tf.zeros_like(g) for _ in range(n - 1))]) for g in grads]
