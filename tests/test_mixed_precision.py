"""Mixed precision under tfdist: with `mixed_float16`, Keras' LossScaleOptimizer skips a step whose gradients are
not finite and halves its loss scale. Under data parallelism, every ZeRO stage and a mesh that decision must be one
for the whole step, however the gradients are split: here only one replica's samples overflow (not the first
replica's, whose verdict Keras alone would use), and only in one variable, which at stages 1-3 lives in one owner's
shard. Every strategy must skip the same step and keep the same scale as one device."""

from __future__ import annotations

import numpy as np

import tfdist


def model_and_data(big_at: int = 3):
    import keras
    import tensorflow as tf

    class Scaled(keras.layers.Layer):
        """x[:, :4] @ k + s * x[:, 4:5]: where x[:, 4] is large, s's float16 gradient overflows and k's does not."""

        def build(self, shape):
            self.k = self.add_weight(shape=(4, 3), initializer=keras.initializers.GlorotUniform(1), name="k")
            self.s = self.add_weight(shape=(1, 3), initializer="ones", name="s")

        def call(self, x):
            return tf.matmul(x[:, :4], tf.cast(self.k, x.dtype)) + tf.cast(self.s, x.dtype) * x[:, 4:5]

    rng = np.random.RandomState(0)
    x, y = rng.rand(16, 5).astype("float32"), rng.rand(16, 3).astype("float32")
    x[:, 4] = 0.0
    x[big_at, 4] = 300.0  # one sample of the first batch, one replica's: the scaled gradient of s overflows
    return x, y, lambda: keras.Sequential([keras.Input((5,)), Scaled(), keras.layers.Activation("linear",
                                                                                               dtype="float32")])


def train(strategy, big_at: int = 3):
    import keras

    x, y, build = model_and_data(big_at)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with strategy.scope():
            model = build()
            model.compile(keras.optimizers.SGD(0.1), "mse")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    optimizer = model.optimizer
    return model.get_weights(), float(optimizer.dynamic_scale.numpy()), int(optimizer.iterations.numpy())


def test_a_step_whose_gradient_overflows_on_one_replica_is_skipped_by_all_at_every_stage():
    import tensorflow as tf

    weights, scale, iterations = train(tf.distribute.OneDeviceStrategy("/cpu:0"))
    assert (scale, iterations) == (2.0**14, 1)  # one device: step 1 skipped, the scale halved, step 2 applied
    mesh = tfdist.DeviceMesh((2, 2), ("batch", "model"), [f"/cpu:{i}" for i in range(4)])
    runs = {f"zero_stage={stage}": (lambda stage=stage: tfdist.MirroredStrategy(zero_stage=stage), 3)  # replica 1
            for stage in (0, 1, 2, 3)}
    runs["mesh 2 x 2"] = (lambda: tfdist.ModelParallelStrategy(tfdist.LayoutMap(mesh), batch_dim_name="batch"), 5)
    for name, (make, big_at) in runs.items():  # the overflowing sample is not in the first replica's (row's) part
        got, got_scale, got_iterations = train(make(), big_at)
        assert (got_scale, got_iterations) == (scale, iterations), name
        for a, b in zip(got, weights):
            np.testing.assert_allclose(a, b, atol=5e-5, err_msg=name)
