"""Communication hooks (tfdist.data_parallel.comm_hooks, tfdist.data_parallel.powersgd) on tfdist.MirroredStrategy's 4 replicas."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.data_parallel.powersgd import PowerSGD
from tfdist.errors import ConfigError

REPLICAS = 4


def _all_reduce(strategy, per_replica: list[np.ndarray]) -> np.ndarray:
    """What a training step's SUM all-reduce of one value per replica gives, on replica 0 (every replica agrees)."""
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(per_replica[ctx.replica_id_in_sync_group]))

    @tf.function
    def step(v):
        return strategy.run(lambda t: tf.distribute.get_replica_context().all_reduce("sum", [t])[0], args=(v,))

    out = strategy.experimental_local_results(step(values))
    for o in out[1:]:
        np.testing.assert_array_equal(o.numpy(), out[0].numpy())
    return out[0].numpy()


@pytest.mark.parametrize("name, wire", [("fp16", np.float16), ("bf16", tf.bfloat16.as_numpy_dtype)])
def test_fp16_and_bf16_hooks_equal_casting_by_hand(name, wire):
    # Values in +-[1, 2) on a 1/16 grid, plus < 4e-4 away from zero: casting to float16 or bfloat16 drops the small part
    # exactly, and the grid values' sums are exact in both; the float32 sum keeps the small parts.
    rng = np.random.default_rng(1)
    grid = rng.integers(16, 32, size=(REPLICAS, 100)) / 16 * rng.choice([-1, 1], size=(REPLICAS, 100))
    values = (grid + np.sign(grid) * rng.uniform(0, 4e-4, size=grid.shape)).astype("float32")
    by_hand = sum(v.astype(wire) for v in values).astype("float32")  # cast, sum in the wire type, cast back
    strategy = tfdist.MirroredStrategy()
    strategy.register_comm_hook(name)
    hooked = _all_reduce(strategy, list(values))
    np.testing.assert_array_equal(hooked, by_hand)
    assert np.abs(hooked - values.sum(0)).max() > 1e-4  # the compression did happen
    assert strategy.gradient_path.wire_bytes * 2 == strategy.gradient_path.gradient_bytes


def test_powersgd_step_equals_the_algorithm_in_numpy():
    rng = np.random.default_rng(2)
    grads = [rng.normal(size=(40, 24)).astype("float32") for _ in range(REPLICAS)]
    strategy = tfdist.MirroredStrategy()
    hook = PowerSGD(rank=3, seed=7)
    strategy.register_comm_hook(hook)
    got = _all_reduce(strategy, grads)
    # Vogels et al., one power-iteration step from the seeded Q: P = sum M_i orth(Q), P^ = orth(P),
    # Q = sum M_i^T P^; the result P^ Q^T does not depend on QR's sign conventions.
    q0 = np.linalg.qr(np.random.default_rng(7 + 0).standard_normal((24, 3)))[0]
    p_hat = np.linalg.qr(sum(g.astype("float64") @ q0 for g in grads))[0]
    q = sum(g.astype("float64").T @ p_hat for g in grads)
    np.testing.assert_allclose(got, p_hat @ q.T, atol=2e-4)
    # Error feedback: per replica, its own M_i - P^ P^T M_i, in a variable on that replica's device.
    devices = strategy.extended.worker_devices
    assert sorted(k[0] for k in hook.errors) == sorted(devices)
    for i, device in enumerate(devices):
        error = hook.errors[(device, 0)]
        assert tf.DeviceSpec.from_string(error.device) == tf.DeviceSpec.from_string(device)
        np.testing.assert_allclose(error.numpy(), grads[i] - p_hat @ (p_hat.T @ grads[i]), atol=2e-4)
    # Q is kept for the next step (warm start); QR's column signs are a convention (P^ Q^T is not affected)
    kept = hook.qs[(devices[0], 0)].numpy()
    for j in range(3):
        assert min(np.abs(kept[:, j] - q[:, j]).max(), np.abs(kept[:, j] + q[:, j]).max()) < 2e-4


def _cnn_bytes(rank: int) -> tuple[int, int]:
    """Bytes of the example CNN's gradients, and what PowerSGD sends for them, from the layer shapes."""
    model = tfdist.models.cnn()
    hook = PowerSGD(rank=rank)
    full = sent = 0
    for w in model.trainable_weights:
        full += 4 * int(np.prod(w.shape))
        view = hook.compressed(tf.TensorShape(w.shape))
        sent += 4 * (int(np.prod(w.shape)) if view is None else (view[0] + view[1]) * rank)
    return full, sent


def test_powersgd_rank4_cuts_the_cnns_gradient_bytes_20x_and_keeps_error_state_per_replica():
    strategy = tfdist.MirroredStrategy()
    hook = PowerSGD(rank=4)
    strategy.register_comm_hook(hook)
    with strategy.scope():
        model = tfdist.models.cnn()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    model.fit(rng.normal(size=(128, 28, 28, 1)).astype("float32"), rng.integers(0, 10, 128), batch_size=64,
              epochs=1, verbose=0)
    path = strategy.gradient_path
    full, sent = _cnn_bytes(4)
    assert (path.gradient_bytes, path.wire_bytes) == (full, sent)  # counted bytes = the shapes' arithmetic
    assert path.gradient_bytes / path.wire_bytes >= 20, (path.gradient_bytes, path.wire_bytes)
    # conv2, dense1 and logits kernels are compressed (conv1's 9x32 is not worth it), on each of 4 replicas
    assert len(hook.errors) == 3 * REPLICAS
    errors = {}
    for (device, gid), var in hook.errors.items():
        errors.setdefault(gid, []).append(var.numpy())
    for gid, per_replica in errors.items():
        assert all(np.abs(e).max() > 0 for e in per_replica)
        assert not np.array_equal(per_replica[0], per_replica[1])  # each replica's own error


@pytest.mark.slow  # ~20 s: two trainings of 6 epochs
def test_powersgd_training_converges_like_plain_training():
    # Seen 2026-11-24: plain 0.978, PowerSGD rank 2 0.964 on the 359 held-out digits.
    data = tfdist.data.digits(global_batch_size=64)
    accuracy = {}
    for name in ("plain", "powersgd"):
        strategy = tfdist.MirroredStrategy()
        if name == "powersgd":
            strategy.register_comm_hook(PowerSGD(rank=2))
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = tfdist.models.cnn(input_shape=(8, 8, 1), filters=(16, 32), dense_units=64)
            model.compile(optimizer=keras.optimizers.Adam(0.003), loss="sparse_categorical_crossentropy",
                          metrics=["accuracy"])
        model.fit(data.train, epochs=6, verbose=0)
        accuracy[name] = model.evaluate(data.test, verbose=0)[1]
    print("digits test accuracy after 6 epochs:", accuracy)
    assert accuracy["plain"] > 0.9, accuracy
    assert accuracy["powersgd"] > 0.9 and abs(accuracy["powersgd"] - accuracy["plain"]) < 0.04, accuracy


def _fit_tiny(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])  # gradients: 8 + 1 numbers
        model.compile(optimizer="sgd", loss="mse")
    model.fit(np.ones((16, 8)), np.ones((16, 1)), verbose=0)


def test_hook_returning_the_wrong_shape_is_a_config_error_naming_it():
    def drop_last(bucket):
        return [b[:-1] for b in bucket.all_reduce(bucket.buffers)]

    strategy = tfdist.MirroredStrategy()
    strategy.register_comm_hook(drop_last)
    with pytest.raises(ConfigError, match=r"hook 'drop_last' returned a tensor of shape \[8\] for bucket 0 .*"
                                          r"expected shape \[9\]"):
        _fit_tiny(strategy)

    def one_tensor(bucket):
        return bucket.buffers[0]

    strategy = tfdist.MirroredStrategy()
    strategy.register_comm_hook(one_tensor)
    with pytest.raises(ConfigError, match="hook 'one_tensor' returned .* expected a list of 4 tensors"):
        _fit_tiny(strategy)


def test_a_user_hook_sees_the_buckets_and_sums_like_the_plain_path():
    seen = []

    def halve_then_double(bucket):
        seen.append((bucket.index, len(bucket.buffers), bucket.gradient_ids))
        return [s * 2 for s in bucket.all_reduce([b / 2 for b in bucket.buffers])]

    strategy = tfdist.MirroredStrategy(bucket_cap_mb=4e-6)  # ~4 bytes: one bucket per value
    strategy.register_comm_hook(halve_then_double)
    values = [np.full(3, r + 1, "float32") for r in range(REPLICAS)]
    ones = strategy.experimental_distribute_values_from_function(
        lambda ctx: (tf.constant(values[ctx.replica_id_in_sync_group]), tf.ones([2]) * 3))

    @tf.function
    def step(v):
        return strategy.run(lambda a, b: tf.distribute.get_replica_context().all_reduce("sum", [a, b]), args=v)

    a, b = (strategy.experimental_local_results(t)[0].numpy() for t in step(ones))
    np.testing.assert_array_equal(a, [10, 10, 10])
    np.testing.assert_array_equal(b, [12, 12])
    assert seen == [(0, REPLICAS, [1]), (1, REPLICAS, [0])]  # reverse order: the last value first


def test_hook_options_are_checked():
    with pytest.raises(ConfigError, match="hook must be a callable"):
        tfdist.MirroredStrategy().register_comm_hook("fp8")
    with pytest.raises(ConfigError, match="communication hooks apply at zero_stage=0 only"):
        tfdist.MirroredStrategy(zero_stage=2).register_comm_hook("fp16")
    with pytest.raises(ConfigError, match="rank.* must be an integer >= 1"):
        PowerSGD(rank=0)
    strategy = tfdist.MirroredStrategy()
    strategy.register_comm_hook("powersgd:2")
    with pytest.raises(ConfigError, match="a hook is already registered"):
        strategy.register_comm_hook("fp16")
