"""AutoGraph and tfdist: a `tf.function` leaves tfdist's own code as it is (as it leaves Keras'), while a user's
step and replica function are still rewritten, so Python control flow on tensor values keeps working inside
`strategy.run` on tfdist's strategies."""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.python.autograph.impl import conversion

import tfdist
from tfdist.zero.engine import ZeroEngine

DEVICES = ["/cpu:0", "/cpu:1"]


def test_tfdist_code_is_exempt_and_user_code_is_not():
    def users_replica_fn(x):
        return x

    for fn in (tfdist.MirroredStrategy.run, tfdist.ModelParallelStrategy.run, ZeroEngine.reduce_gradients):
        assert conversion.is_allowlisted(fn), fn
    assert not conversion.is_allowlisted(users_replica_fn)


def test_a_replica_function_branching_and_looping_on_tensors_runs_as_under_stock_mirrored():
    def replica_fn(x):
        total = tf.zeros([])
        for i in tf.range(3):  # a tensor loop: AutoGraph makes it a tf.while_loop
            total += tf.cast(i, tf.float32) * tf.reduce_sum(x)
        if tf.reduce_sum(x) > 0:  # a tensor condition: AutoGraph makes it a tf.cond
            total = total * 2.0
        return total

    def run(strategy):
        @tf.function
        def step(x):
            return strategy.run(replica_fn, args=(x,))

        dataset = strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices(np.array([[1.0], [2.0], [-3.0], [-4.0]], "float32")).batch(4))
        return [strategy.experimental_local_results(step(x)) for x in dataset]

    stock = run(tf.distribute.MirroredStrategy(DEVICES))
    for strategy in (tfdist.MirroredStrategy(devices=DEVICES), tfdist.MirroredStrategy(devices=DEVICES, zero_stage=2)):
        got = run(strategy)
        np.testing.assert_array_equal(np.asarray(got, "float32"), np.asarray(stock, "float32"))
    # LayerPlacementStrategy (one replica over both devices) wraps the replica function in one of tfdist's own:
    # the user's is still converted, as on one device.
    one = run(tf.distribute.get_strategy())
    np.testing.assert_array_equal(np.asarray(run(tfdist.LayerPlacementStrategy(DEVICES)), "float32"),
                                  np.asarray(one, "float32"))
