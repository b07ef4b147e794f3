"""ZeRO-1/2 on tfdist.MirroredStrategy (4 logical replicas): equivalence, placement, optimizers, errors."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.errors import ConfigError

RNG = np.random.default_rng(0)
X = RNG.normal(size=(256, 8, 8, 1)).astype("float32")
Y = RNG.integers(0, 10, 256)


def small_cnn():
    return tfdist.models.cnn((8, 8, 1), 10, filters=(4, 8), dense_units=16, seed=0)


def train(stage: int, optimizer=lambda: keras.optimizers.Adam(1e-2), replicas: int = 4, steps: int = 20,
          batch: int = 64, model_fn=small_cnn, offload: bool = False):
    strategy = tfdist.MirroredStrategy(tfdist.devices.virtual_cpus(4)[:replicas], zero_stage=stage, offload=offload)
    with strategy.scope():
        model = model_fn()
        model.compile(optimizer=optimizer(), loss="sparse_categorical_crossentropy")
    epochs = steps * batch // len(X)
    model.fit(X, Y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    return strategy, model


def max_rel(a: list, b: list) -> float:
    return max(float(np.max(np.abs(x - y)) / max(float(np.max(np.abs(x))), 1e-12)) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def adam_runs():
    return {stage: train(stage) for stage in (0, 1, 2)}


def test_zero1_equals_stage0_exactly_after_20_adam_steps(adam_runs):
    (_, m0), (_, m1) = adam_runs[0], adam_runs[1]
    assert int(m1.optimizer.iterations.numpy()) == 20
    for a, b in zip(m0.get_weights(), m1.get_weights()):
        np.testing.assert_array_equal(a, b)
    # the logical optimizer state equals the stock (replicated) state, slot by slot
    for v0, v1 in zip(m0.optimizer.variables, m1.optimizer.variables):
        assert tuple(v0.shape) == tuple(v1.shape)
        np.testing.assert_array_equal(np.asarray(v0.numpy()), np.asarray(v1.numpy()))


def test_zero2_within_1e4_relative_of_stage0(adam_runs):
    (_, m0), (_, m2) = adam_runs[0], adam_runs[2]
    assert max_rel(m0.get_weights(), m2.get_weights()) < 1e-4
    assert not np.allclose(m0.get_weights()[0], small_cnn().get_weights()[0])  # it did train


@pytest.mark.parametrize("offload", [False, True])
def test_zero1_on_two_replicas_reduce_scatters_and_still_equals_stage0(offload):
    # with two replicas a reduce-scatter adds the same two numbers as the all-reduce: stage 1 takes it
    _, m0 = train(0, replicas=2, steps=8)
    strategy, m1 = train(1, replicas=2, steps=8, offload=offload)
    assert tfdist.zero.engine_of(m1.optimizer).reduce_scatters
    for a, b in zip(m0.get_weights(), m1.get_weights()):
        np.testing.assert_array_equal(a, b)
    for v0, v1 in zip(m0.optimizer.variables, m1.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(v0.numpy()), np.asarray(v1.numpy()))
    shard = -(-m1.count_params() // 2)
    assert [row.gradients for row in strategy.memory_report(m1).rows] == [4 * shard, 4 * shard]


@pytest.mark.parametrize("stage", [1, 2])
def test_slots_live_only_on_their_owner(adam_runs, stage):
    strategy, model = adam_runs[stage]
    engine = tfdist.zero.engine_of(model.optimizer)
    devices = [tf.DeviceSpec.from_string(d).to_string() for d in strategy.extended.worker_devices]
    n_params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    shard = -(-n_params // 4)
    assert engine.layout.shard_size == shard
    for name in ("momentum", "velocity"):
        slots = engine.state.slots[name]
        assert len(slots) == 4
        for owner, var in enumerate(slots):
            assert tuple(var.shape) == (shard,)  # 1/N of the flat state, not a whole variable
            assert tf.DeviceSpec.from_string(var.value.device).to_string() == devices[owner]
            assert not isinstance(var.value, tf.distribute.DistributedValues)  # one copy, not mirrored
    # the user's optimizer holds no tf.Variable slots of its own: only logical views
    real = [v for v in model.optimizer.variables if hasattr(v, "value") and
            isinstance(v.value, tf.distribute.DistributedValues)]
    assert {v.name for v in real} <= {"iteration", "learning_rate"}
    report = strategy.memory_report(model)
    per_replica_state = [r.optimizer_state for r in report.rows]
    slot_bytes = 2 * 4 * shard
    for b in per_replica_state:  # slots + a few scalars (iterations, learning rate)
        assert slot_bytes <= b <= slot_bytes + 64
    assert report.rows[0].gradients == (4 * shard if stage == 2 else 4 * n_params)


def test_memory_report_stage0_reads_mirrored_slots(adam_runs):
    strategy, model = adam_runs[0]
    report = strategy.memory_report(model)
    n = report.num_params
    assert report.state_bytes_per_param == 8
    assert all(8 * n <= r.optimizer_state <= 8 * n + 64 for r in report.rows)
    assert "ZeRO stage 0" in str(report)


OPTIMIZERS = {
    "adamw_schedule_exclusions": lambda: _adamw(),
    "sgd_momentum_nesterov": lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.05, 5, 0.5), momentum=0.9, nesterov=True),
    "rmsprop_centered": lambda: keras.optimizers.RMSprop(1e-3, momentum=0.5, centered=True),
    "adagrad": lambda: keras.optimizers.Adagrad(0.05, initial_accumulator_value=0.2),
    "adamax": lambda: keras.optimizers.Adamax(1e-2),
    "lion": lambda: keras.optimizers.Lion(1e-3),
    "adam_amsgrad": lambda: keras.optimizers.Adam(1e-2, amsgrad=True),
}


def _adamw():
    opt = keras.optimizers.AdamW(keras.optimizers.schedules.CosineDecay(1e-2, 10), weight_decay=0.1)
    opt.exclude_from_weight_decay(var_names=["bias"])
    return opt


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizers_zero1_and_zero2_match_stage0(name):
    # ZeRO-1 sees bit-identical gradients; the element-wise update can still differ by an ulp when
    # Grappler rewrites x / sqrt(y) into x * rsqrt(y), whose vectorised and scalar-tail kernels
    # round differently, and a flat shard puts elements at other positions than the variable does.
    runs = {stage: train(stage, OPTIMIZERS[name], steps=8)[1] for stage in (0, 1, 2)}
    assert max_rel(runs[0].get_weights(), runs[1].get_weights()) < 1e-6
    assert max_rel(runs[0].get_weights(), runs[2].get_weights()) < 1e-4
    slots0 = [np.asarray(v.numpy()) for v in runs[0].optimizer.variables]
    slots2 = [np.asarray(v.numpy()) for v in runs[2].optimizer.variables]
    assert [s.shape for s in slots0] == [s.shape for s in slots2]


@pytest.mark.parametrize("clip", [{"global_clipnorm": 0.05}, {"clipnorm": 0.02}, {"clipvalue": 0.001}])
@pytest.mark.parametrize("stage", [0, 1, 2])  # stage 0: tfdist.zero.stage0_update (stock Keras clips per replica)
def test_clipping_uses_the_global_gradient(clip, stage):
    # Reference: one device, same global batch: Keras clips the full (global) gradient there.
    tf.keras.utils.set_random_seed(0)
    ref = small_cnn()
    ref.compile(optimizer=keras.optimizers.SGD(0.1, **clip), loss="sparse_categorical_crossentropy")
    ref.fit(X, Y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    _, zero = train(stage, lambda: keras.optimizers.SGD(0.1, **clip), steps=8)
    assert max_rel(ref.get_weights(), zero.get_weights()) < 1e-4


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])  # float16: Keras adds a LossScaleOptimizer
def test_mixed_precision_policy(policy):
    keras.mixed_precision.set_global_policy(policy)
    try:
        runs = {stage: train(stage, lambda: "adam", steps=4)[1] for stage in (0, 1, 2)}
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert runs[1].layers[0].compute_dtype == policy.split("_")[1]
    optimizer = runs[2].optimizer
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    assert tfdist.zero.engine_of(inner).stage == 2 and int(optimizer.iterations.numpy()) == 4
    assert max_rel(runs[0].get_weights(), runs[1].get_weights()) == 0.0
    assert max_rel(runs[0].get_weights(), runs[2].get_weights()) < 1e-4
    assert max_rel(runs[0].get_weights(), small_cnn().get_weights()) > 1e-3  # it trained


def test_offload_matches_and_places_state_on_host():
    strategy = tfdist.MirroredStrategy(zero_stage=2, offload=True)
    with strategy.scope():
        model = small_cnn()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(X, Y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    engine = tfdist.zero.engine_of(model.optimizer)
    host = tf.DeviceSpec.from_string(engine.config.host_device).to_string()
    assert all(tf.DeviceSpec.from_string(v.value.device).to_string() == host for v in engine.state.slots["momentum"])
    _, ref = train(2, lambda: keras.optimizers.Adam(), steps=4)
    assert max_rel(ref.get_weights(), model.get_weights()) < 1e-4


# --- bad input -------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [4, -1, "1", 1.0, True, None])
def test_unsupported_stage_lists_supported_set(bad):
    with pytest.raises(ConfigError, match=r"not supported.*\{0, 1, 2\}"):
        tfdist.MirroredStrategy(zero_stage=bad)


def test_offload_needs_a_zero_stage():
    with pytest.raises(ConfigError, match="offload"):
        tfdist.MirroredStrategy(zero_stage=0, offload=True)


@pytest.mark.parametrize("stage", [0, 1])
def test_optimizer_created_outside_scope(stage):
    optimizer = keras.optimizers.Adam()
    strategy = tfdist.MirroredStrategy(zero_stage=stage)
    with strategy.scope():
        model = small_cnn()
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    with pytest.raises(ConfigError, match="outside the strategy's scope"):
        model.fit(X[:64], Y[:64], batch_size=64, epochs=1, verbose=0)


def test_optimizer_built_outside_the_scope_is_sharded_too():
    """An optimizer created in the scope and built after it (e.g. before loading a checkpoint) is sharded,
    while the Keras optimizer classes are stock again once the scope is closed."""
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    stock = BaseOptimizer.__dict__["build"]
    strategy = tfdist.MirroredStrategy(zero_stage=1)
    with strategy.scope():
        model = small_cnn()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        assert BaseOptimizer.__dict__["build"] is not stock  # the hook is open inside the scope
    assert BaseOptimizer.__dict__["build"] is stock
    model.optimizer.build(model.trainable_variables)
    engine = tfdist.zero.engine_of(model.optimizer)
    assert engine is not None and engine.stage == 1 and engine.layout.num_shards == 4


@pytest.mark.parametrize("optimizer, match", [
    (lambda: keras.optimizers.Adafactor(), "factored"),
    (lambda: keras.optimizers.Lamb(), "trust ratio"),
])
def test_refuses_shape_dependent_optimizers(optimizer, match):
    strategy = tfdist.MirroredStrategy(zero_stage=2)
    with strategy.scope():
        model = small_cnn()
        model.compile(optimizer=optimizer(), loss="sparse_categorical_crossentropy")
        with pytest.raises(ConfigError, match=match):
            model.optimizer.build(model.trainable_variables)


def test_non_float_trainable_variable():
    class Counter(keras.layers.Layer):
        def build(self, shape):
            self.count = self.add_weight(shape=(), dtype="int32", initializer="zeros", trainable=True)

        def call(self, x):
            return x

    strategy = tfdist.MirroredStrategy(zero_stage=1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), Counter(), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        with pytest.raises(ConfigError, match="floating point"):
            model.optimizer.build(model.trainable_variables)


class _Scale(keras.layers.Layer):
    """A layer with one scalar (0-d) trainable weight."""

    def build(self, shape):
        self.scale = self.add_weight(shape=(), initializer="ones", name="scale")

    def call(self, x):
        return x * self.scale


@pytest.mark.parametrize("stage", [1, 2])
def test_scalar_trainable_variables_are_sharded_like_any_other(stage):
    def scaled_cnn():
        inputs = keras.Input((8, 8, 1))
        return keras.Model(inputs, small_cnn()(_Scale()(inputs)))

    (_, m0), (_, m) = train(0, model_fn=scaled_cnn, steps=8), train(stage, model_fn=scaled_cnn, steps=8)
    assert any(len(w.shape) == 0 for w in m.trainable_weights)
    assert max_rel(m0.get_weights(), m.get_weights()) < (1e-12 if stage == 1 else 1e-4)


@pytest.mark.parametrize("stage", [1, 2])
def test_apply_gradients_on_tf_variables_in_a_custom_loop(stage):
    """Keras 3 optimizers take plain tf.Variables created in the scope (TensorFlow's custom-loop pattern)."""
    x = tf.constant(np.random.default_rng(3).normal(size=(4, 3)), tf.float32)

    def run(zero_stage):
        strategy = tfdist.MirroredStrategy(zero_stage=zero_stage)
        with strategy.scope():
            w = tf.Variable(tf.reshape(tf.range(6, dtype=tf.float32), (3, 2)) / 10, name="w")
            b = tf.Variable(0.5, name="b")
            optimizer = keras.optimizers.Adam(1e-2)
            optimizer.build([w, b])

        @tf.function
        def step(x):
            def replica(x):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(tf.square(tf.matmul(x, w) + b - 1.0)) / 8
                optimizer.apply_gradients(zip(tape.gradient(loss, [w, b]), [w, b]))
            strategy.run(replica, args=(x,))

        for _ in range(5):
            step(x)
        return [w.numpy(), b.numpy()], tfdist.zero.engine_of(optimizer)

    (ref, _), (got, engine) = run(0), run(stage)
    assert engine is not None and engine.stage == stage
    assert max_rel(ref, got) < (1e-12 if stage == 1 else 1e-4)


def train_one_device(optimizer, steps: int = 20, batch: int = 64, model_fn=small_cnn):
    """Plain Keras, no strategy: what 4 data-parallel replicas with the same global batch compute."""
    model = model_fn()
    model.compile(optimizer=optimizer(), loss="sparse_categorical_crossentropy")
    model.fit(X, Y, batch_size=batch, epochs=steps * batch // len(X), shuffle=False, verbose=0)
    return model


def _slots(optimizer, name: str) -> list[np.ndarray]:
    return [np.asarray(v.numpy()) for v in optimizer.variables if v.path.endswith(name)]


@pytest.mark.parametrize("stage", [1, 2])
def test_gradient_accumulation_accumulates_the_reduced_shard(stage):
    # Stock MirroredStrategy cannot accumulate over several local devices (its all-reduce is a
    # merge_call, which cannot sit in tf.cond); the reference is therefore plain Keras on one device
    # with the same global batch: data parallelism computes the same mean gradient.
    opt = lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.05, gradient_accumulation_steps=2)  # noqa: E731
    ref = train_one_device(opt, steps=12, batch=64)
    strategy, model = train(stage, opt, steps=12, batch=64)
    assert int(model.optimizer.iterations.numpy()) == 6  # updates, as Keras counts them
    assert max_rel(ref.get_weights(), model.get_weights()) < 1e-4
    engine = tfdist.zero.engine_of(model.optimizer)
    accumulators = engine.state.shards("gradient_accumulator")
    # the accumulator is 1/N of the model per replica, each on its owner, and empty after an update
    assert [tuple(a.shape) for a in accumulators] == [(engine.layout.shard_size,)] * 4
    devices = [tf.DeviceSpec.from_string(d).to_string() for d in strategy.extended.worker_devices]
    assert [tf.DeviceSpec.from_string(a.value.device).to_string() for a in accumulators] == devices
    assert all(not np.any(a.numpy()) for a in accumulators)
    # checkpoints see Keras' own per-variable accumulators, as plain Keras saves them
    assert [s.shape for s in _slots(model.optimizer, "gradient_accumulator")] == \
        [tuple(w.shape) for w in model.trainable_weights]
    # the first (sum) half of an update lands in the accumulators: one more micro-step
    model.fit(X[:64], Y[:64], batch_size=64, epochs=1, shuffle=False, verbose=0)
    assert any(np.any(a.numpy()) for a in accumulators)


@pytest.mark.parametrize("stage", [0, 1, 2])  # stage 0: stock Keras' overwrite fails over merge_call replicas
def test_ema_keeps_each_owner_average_of_its_shard(stage):
    opt = lambda: keras.optimizers.Adam(1e-2, use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=7)  # noqa: E731
    ref = train_one_device(opt, steps=16)
    _, model = train(stage, opt, steps=16)
    # fit ends by writing the averages into the model (Keras' finalize_variable_values); the
    # overwrite every 7 steps changes the trajectory, so equal weights check both
    assert max_rel(ref.get_weights(), model.get_weights()) < 1e-4
    assert max_rel(_slots(ref.optimizer, "average"), _slots(model.optimizer, "average")) < 1e-4
    if stage == 0:
        return
    engine = tfdist.zero.engine_of(model.optimizer)
    assert [tuple(a.shape) for a in engine.state.shards("average")] == [(engine.layout.shard_size,)] * 4
