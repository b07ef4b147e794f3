"""Training order as a pure function of (seed, epoch), so a resumed run sees the epochs it missed.

`tf.data`'s `shuffle(seed=s, reshuffle_each_iteration=True)` draws epoch k's order from a generator
that advances once per iteration *in this process*: a job restarted at epoch 3 gets the order of
epoch 0 again, and its weights drift from an uninterrupted run. `EpochOrder` instead draws epoch e's
permutation from `numpy.random.default_rng([seed, e])`, with `e` set by a Keras callback at the start
of every epoch (Keras creates the epoch's iterator after `on_epoch_begin`, also after a restore).
"""

from __future__ import annotations

import math

import keras
import numpy as np
import tensorflow as tf

__all__ = ["EpochOrder"]


class EpochOrder:
    """Batches of (x, y) whose order depends only on `seed` and the epoch number.

    Example:
        >>> order = EpochOrder(len(x), seed=0)
        >>> train = order.dataset(x, y, batch_size=64)
        >>> model.fit(train, epochs=5, callbacks=[order.callback()])   # resumable: same order per epoch
    """

    def __init__(self, num_examples: int, seed: int = 0):
        self.num_examples = int(num_examples)
        self.seed = int(seed)
        self.epoch = 0
        self.epochs_drawn: list[int] = []  # the epoch of every permutation handed out (for checks)

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of the examples in `epoch`."""
        return np.random.default_rng([self.seed, int(epoch)]).permutation(self.num_examples)

    def dataset(self, x: np.ndarray, y: np.ndarray, batch_size: int) -> tf.data.Dataset:
        """Batched (x, y) in this epoch's order; call `callback()` in fit so the epoch is known."""

        def indices():
            self.epochs_drawn.append(self.epoch)
            yield self.permutation(self.epoch)

        n = self.num_examples
        xs, ys = tf.constant(x), tf.constant(y)
        ds = tf.data.Dataset.from_generator(indices, output_signature=tf.TensorSpec([n], tf.int64)).unbatch()
        ds = ds.batch(batch_size).map(lambda i: (tf.gather(xs, i), tf.gather(ys, i)))
        return ds.apply(tf.data.experimental.assert_cardinality(math.ceil(n / batch_size)))

    def callback(self) -> keras.callbacks.Callback:
        """The callback that tells the pipeline which epoch Keras is starting."""
        return _SetEpoch(self)


class _SetEpoch(keras.callbacks.Callback):
    def __init__(self, order: EpochOrder):
        super().__init__()
        self.order = order

    def on_epoch_begin(self, epoch, logs=None):
        self.order.epoch = int(epoch)
