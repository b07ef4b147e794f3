"""Training order as a pure function of (seed, epoch), so a resumed run sees the epochs it missed.

`tf.data`'s `shuffle(seed=s, reshuffle_each_iteration=True)` draws epoch k's order from a generator
that advances once per iteration *in this process*: a job restarted at epoch 3 gets the order of
epoch 0 again, and its weights drift from an uninterrupted run. `EpochOrder` keys the order on an
epoch counter instead: a `tf.Variable` read inside the pipeline (graph-native: no py_func, so the
pipeline can be serialized and auto-sharded across workers, e.g. by MultiWorkerMirroredStrategy and
HorovodStrategy), set by the order's Keras callback at the start of every epoch (Keras makes each
epoch's iterator after `on_epoch_begin`, also after a restore). Without the callback the pipeline counts its own
iterations, so every epoch still gets a new order, as with `reshuffle_each_iteration=True`.

Known limit: a tf.data service (`tf.data.experimental.service.distribute`) runs the pipeline with
the epoch it had when the dataset was registered (seen: every later iteration repeats that order),
so there, register one dataset per epoch (set `epoch` first).
"""

from __future__ import annotations

import math

import keras
import numpy as np
import tensorflow as tf

__all__ = ["EpochOrder"]

# Separates the keys of `apply`'s blocks: block b of epoch e is permuted with key (seed + b * stride, e).
_SEED_STRIDE = 1_000_003


class EpochOrder(keras.callbacks.Callback):
    """A different but fixed data order per epoch: epoch e's order depends only on (seed, e).

    Two ways in, one epoch counter:
    - `dataset(x, y, batch_size)`: in-memory arrays, batched, epoch e in the order `permutation(e, n)`
      (`tf.random.experimental.stateless_shuffle` keyed on (seed, e): the same on every worker, in every
      process, whatever TF's global seed);
    - `apply(dataset)`: any dataset (unbatched, elements of one shape), permuted the same way.
    Pass the object itself to `fit` as a callback. Every worker computes the same order, so per-worker
    shards (auto-sharding by data) stay disjoint.

    Example:
        >>> order = tfdist.data.EpochOrder(seed=0)
        >>> train = order.dataset(x, y, batch_size=64)                    # or: order.apply(ds).batch(64)
        >>> model.fit(train, epochs=5, callbacks=[order, tfdist.training.BackupAndRestore("backup")])
    """

    def __init__(self, seed: int = 0):
        super().__init__()
        self.seed = int(seed)
        self.epochs_begun: list[int] = []  # epochs Keras started with this order (for checks and logs)
        self._epoch: tf.Variable | None = None

    # --- the epoch counter ---------------------------------------------------------------------------
    def _variable(self) -> tf.Variable:
        if self._epoch is None:  # made on first use: creating it starts TensorFlow
            with tf.init_scope():
                self._epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="tfdist_epoch")
        return self._epoch

    @property
    def epoch(self) -> int:
        """The epoch whose order the next iteration of the pipeline yields."""
        return int(self._variable().numpy())

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._variable().assign(int(value))

    def _next_epoch(self) -> tf.Tensor:
        # Read the epoch and advance it: an iteration without the callback gets the following order.
        return self._variable().assign_add(1) - 1

    # --- orders ----------------------------------------------------------------------------------------
    def _permutation(self, epoch: tf.Tensor, n: int) -> tf.Tensor:
        key = tf.stack([tf.constant(self.seed, tf.int64), tf.cast(epoch, tf.int64)])
        return tf.random.experimental.stateless_shuffle(tf.range(n, dtype=tf.int64), seed=key)

    def permutation(self, epoch: int, n: int) -> np.ndarray:
        """The order of `n` examples in `epoch` (what `dataset` yields, as indices)."""
        return self._permutation(tf.constant(epoch, tf.int64), n).numpy()

    def dataset(self, x, y, batch_size: int) -> tf.data.Dataset:
        """Batched (x, y) from in-memory arrays, in the current epoch's order."""
        xs, ys = tf.constant(x), tf.constant(y)
        n = int(xs.shape[0])

        def one_epoch(_):
            # One gather per epoch (a copy of the arrays, as a full shuffle buffer holds), then slices:
            # cheaper than a gather per batch.
            p = self._permutation(self._next_epoch(), n)
            return tf.data.Dataset.from_tensor_slices((tf.gather(xs, p), tf.gather(ys, p))).batch(batch_size)

        ds = tf.data.Dataset.from_tensors(0).flat_map(one_epoch)
        return ds.apply(tf.data.experimental.assert_cardinality(math.ceil(n / batch_size)))

    def apply(self, dataset: tf.data.Dataset, buffer_size: int | None = None) -> tf.data.Dataset:
        """`dataset` (unbatched, elements of one shape) in the current epoch's order.

        With the default `buffer_size` (the whole dataset) epoch e is the dataset in the order
        `permutation(e, n)`; a smaller buffer permutes consecutive blocks of that many elements, each
        keyed on (seed, e, block), for datasets too big to hold at once.
        """
        size = int(dataset.cardinality())
        if buffer_size is None:
            if size < 0:
                raise ValueError("EpochOrder.apply: the dataset's size is unknown; pass buffer_size.")
            buffer_size = size
        seed = self.seed

        def one_epoch(_):
            # Not dataset.shuffle(seed=...): its order would also depend on TF's global seed.
            epoch = self._next_epoch()

            def permute(block: tf.Tensor, elements):
                n = tf.shape(tf.nest.flatten(elements)[0], out_type=tf.int64)[0]
                key = tf.stack([tf.constant(seed, tf.int64) + block * _SEED_STRIDE, epoch])
                idx = tf.random.experimental.stateless_shuffle(tf.range(n), seed=key)
                return tf.nest.map_structure(lambda t: tf.gather(t, idx), elements)

            return dataset.batch(max(int(buffer_size), 1)).enumerate().map(permute).unbatch()

        shuffled = tf.data.Dataset.from_tensors(0).flat_map(one_epoch)
        if size >= 0:
            shuffled = shuffled.apply(tf.data.experimental.assert_cardinality(size))
        return shuffled

    # --- Keras ---------------------------------------------------------------------------------------
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        self.epochs_begun.append(int(epoch))
