"""A custom loop's embedding lookups under Adam, for the multi-process jobs (tests/zero_multiworker_job.py,
tests/zero_horovod_worker.py): IndexedSlices of a different length on every replica, rows repeated within and
across replicas. ZeRO must hand each owner every replica's slices, as stock tf.distribute's all-reduce of slices
(an all-gather) hands them to the optimizer."""

import keras
import numpy as np
import tensorflow as tf


def _gradients(replica):
    rows = tf.concat([tf.constant([1, 4]), tf.repeat(replica % 3, replica + 1)], 0)
    values = tf.cast(replica + 1, tf.float32) * tf.ones([tf.shape(rows)[0], 3])
    return tf.IndexedSlices(values, rows, tf.constant([10, 3])), tf.ones(4) * tf.cast(replica + 1, tf.float32)


def one_device(replicas: int, steps: int = 3, densified: bool = False) -> np.ndarray:
    """What one device gives when handed what stock tf.distribute's all-reduce gives the optimizer: every replica's
    slices concatenated in replica order (`densified`: summed into a dense gradient instead), the dense gradients
    summed."""
    table, dense = keras.Variable(np.ones((10, 3), "float32")), keras.Variable(np.ones(4, "float32"))
    adam = keras.optimizers.Adam(0.1)
    adam.build([table, dense])
    every = [_gradients(tf.constant(r)) for r in range(replicas)]
    slices = tf.IndexedSlices(tf.concat([s.values for s, _ in every], 0), tf.concat([s.indices for s, _ in every], 0),
                              tf.constant([10, 3]))
    for _ in range(steps):
        adam.apply_gradients([(tf.convert_to_tensor(slices) if densified else slices, table),
                              (tf.add_n([d for _, d in every]), dense)])
    return np.concatenate([table.numpy().ravel(), dense.numpy()])


def train_lookups(strategy, steps: int = 3) -> np.ndarray:
    """The table's and a dense variable's values after `steps` Adam steps under `strategy` (flat)."""
    with strategy.scope():
        table, dense = keras.Variable(np.ones((10, 3), "float32"), name="table"), keras.Variable(np.ones(4, "float32"))
        adam = keras.optimizers.Adam(0.1, name="adam")
        adam.build([table, dense])

    @tf.function
    def step():
        def replica_step():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            slices, gradient = _gradients(tf.convert_to_tensor(replica, tf.int32))
            adam.apply_gradients([(slices, table), (gradient, dense)])

        strategy.run(replica_step)

    for _ in range(steps):
        step()
    return np.concatenate([table.numpy().ravel(), dense.numpy()])
