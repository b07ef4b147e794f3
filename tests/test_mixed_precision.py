"""Mixed precision under tfdist: with `mixed_float16`, Keras' LossScaleOptimizer skips a step whose gradients are
not finite and halves its loss scale. Under data parallelism, every ZeRO stage and a mesh that decision must be one
for the whole step, however the gradients are split: here only one replica's samples overflow (not the first
replica's, whose verdict Keras alone would use), and only in one variable, which at stages 1-3 lives in one owner's
shard. Every strategy must skip the same step and keep the same scale as one device."""

from __future__ import annotations

import json

import numpy as np
import pytest

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


# --- grad_dtype: the dtype the gradients are summed in across replicas ------------------------------------------

def dyadic_step(strategy, grad_dtype_policy: str = "float32", models: list | None = None) -> np.ndarray:
    """One SGD step of a bias-free Dense(2) on 8 samples whose values have few significant bits: each replica's
    gradient is exact in float32 but needs more bits than bfloat16 (8) or float16 (11) hold, so the dtype of the
    sum shows in the updated kernel, and rounding is the same on every CPU (no float32 rounding anywhere)."""
    import keras

    x, y, w0 = dyadic_data()
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(
            2, use_bias=False, kernel_initializer=keras.initializers.Constant(w0))])
        model.compile(keras.optimizers.SGD(1 / 16), "mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    if models is not None:
        models.append(model)
    return model.get_weights()[0]


def dyadic_data():
    rng = np.random.RandomState(3)
    x = rng.randint(-64, 64, size=(8, 3)) / 16
    w0 = rng.randint(-64, 64, size=(3, 2)) / 16
    y = rng.randint(-64, 64, size=(8, 2)) / 16
    return x.astype("float32"), y.astype("float32"), w0.astype("float32")


def expected_kernel(sum_dtype) -> np.ndarray:
    """Keras' step on 2 replicas of 4 samples, by hand: replica r's gradient of its mse / 2 (Keras divides each
    replica's loss by the number of replicas) is x_r^T (x_r w - y_r) / 8; each is cast to `sum_dtype`, summed and
    rounded in it, cast back."""
    import tensorflow as tf

    x, y, w0 = (a.astype("float64") for a in dyadic_data())
    grads = [x[r * 4:(r + 1) * 4].T @ (x[r * 4:(r + 1) * 4] @ w0 - y[r * 4:(r + 1) * 4]) / 8 for r in (0, 1)]
    summed = tf.cast(tf.add(*[tf.cast(g, sum_dtype) for g in grads]), tf.float64).numpy()
    return (w0 - summed / 16).astype("float32")


def test_grad_dtype_sums_the_gradients_in_that_dtype_at_every_stage():
    import tensorflow as tf

    two = ["/cpu:0", "/cpu:1"]
    exact = expected_kernel(tf.float64)
    for sum_dtype in (tf.bfloat16, tf.float16):
        assert not np.array_equal(expected_kernel(sum_dtype), exact)  # the data tells the sums apart
    runs = {(stage, None): tf.float64 for stage in (0, 2)}  # None: float32 gradients summed in float32, exactly
    runs.update({(stage, "bfloat16"): tf.bfloat16 for stage in (0, 1, 2, 3)})
    runs.update({(stage, "float16"): tf.float16 for stage in (0, 3)})
    for (stage, grad_dtype), sum_dtype in runs.items():
        strategy = tfdist.MirroredStrategy(two, zero_stage=stage, grad_dtype=grad_dtype)
        np.testing.assert_array_equal(dyadic_step(strategy), expected_kernel(sum_dtype),
                                      err_msg=f"zero_stage={stage}, grad_dtype={grad_dtype}")


def test_grad_dtype_on_a_mesh_sums_each_shards_gradient_in_that_dtype_at_every_stage(monkeypatch):
    """ModelParallelStrategy, 2 rows x 2 model devices: the kernel split by columns, each shard's gradient summed
    over the rows where it lives; the same hand-computed kernel as two data-parallel replicas."""
    import tensorflow as tf

    from tfdist.errors import ConfigError

    mesh = tfdist.DeviceMesh((2, 2), ("batch", "model"), ["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"])
    layout_map = tfdist.LayoutMap(mesh)
    layout_map[".*dense.*/kernel"] = (None, "model")
    runs = {(0, None): tf.float64, (0, "bfloat16"): tf.bfloat16, (0, "float16"): tf.float16,
            (1, "bfloat16"): tf.bfloat16, (2, "bfloat16"): tf.bfloat16, (3, "bfloat16"): tf.bfloat16}
    for (stage, grad_dtype), sum_dtype in runs.items():
        strategy = tfdist.ModelParallelStrategy(layout_map, zero_stage=stage, grad_dtype=grad_dtype)
        models: list = []
        np.testing.assert_array_equal(dyadic_step(strategy, models=models), expected_kernel(sum_dtype),
                                      err_msg=f"mesh, zero_stage={stage}, grad_dtype={grad_dtype}")
        (split,) = strategy.shard_plan(models[0]).layers  # the kernel's columns, one half per model device
        assert [tuple(v.shape) for v in split.shards["kernel"]] == [(3, 1), (3, 1)], split.shards
    with pytest.raises(ConfigError, match=r"^grad_dtype must be a floating dtype.*got 'int8'"):
        tfdist.ModelParallelStrategy(layout_map, grad_dtype="int8")
    # a mesh across processes: refused before anything starts (the job's TF_CONFIG is all it reads)
    job = {"cluster": {"worker": ["localhost:1", "localhost:2"]}, "task": {"type": "worker", "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(job))
    spread = tfdist.DeviceMesh((1, 4), ("batch", "model"), [f"/job:worker/replica:0/task:{t}/device:CPU:{d}"
                                                             for t in (0, 1) for d in (0, 1)])  # a row spans both
    with pytest.raises(ConfigError, match=r"^grad_dtype=bfloat16: .* puts the model axis across processes"):
        tfdist.ModelParallelStrategy(tfdist.LayoutMap(spread), grad_dtype="bfloat16")


def test_grad_dtype_under_mixed_bfloat16_equals_one_device_and_bad_values_are_config_errors():
    import keras
    import tensorflow as tf

    from tfdist.errors import ConfigError

    x, y, _ = model_and_data()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        results = {}
        for name, make in {"one device": lambda: tf.distribute.OneDeviceStrategy("/cpu:0"),
                           "stage 0": lambda: tfdist.MirroredStrategy(grad_dtype="bfloat16"),
                           "stage 3": lambda: tfdist.MirroredStrategy(zero_stage=3, grad_dtype="bfloat16")}.items():
            with make().scope():
                keras.utils.set_random_seed(5)
                model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                                          keras.layers.Dense(3, dtype="float32")])
                model.compile(keras.optimizers.Adam(0.01), "mse")
            model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
            assert all(v.dtype == "float32" for v in model.trainable_variables), name  # float32 master weights
            results[name] = model.get_weights()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    for name in ("stage 0", "stage 3"):
        for a, b in zip(results[name], results["one device"]):
            np.testing.assert_allclose(a, b, atol=2e-2, err_msg=name)  # bfloat16 sums: 8 bits of mantissa

    for bad in ("int8", 3, "float8", "half-ish"):
        with pytest.raises(ConfigError, match=r"^grad_dtype must be a floating dtype.*got"):
            tfdist.MirroredStrategy(grad_dtype=bad)
    strategy = tfdist.MirroredStrategy(grad_dtype="bfloat16")
    with pytest.raises(ConfigError, match="register_comm_hook: this strategy sums gradients in grad_dtype=bfloat16"):
        strategy.register_comm_hook("fp16")


@pytest.mark.slow
def test_grad_dtype_across_processes_over_horovod_and_tf_collectives(tmp_path):
    """2 processes, one device each: Horovod at stages 0, 2 and 3 (its all-reduce and all-to-all have no bfloat16
    kernel: the bits travel as another 2-byte type and are summed after), and MultiWorkerMirroredStrategy at
    stage 2 (TF's all-to-all reduce-scatter); 2 processes of two devices: ModelParallelStrategy on a 2 x 2 mesh
    with a row per process at stages 0, 1 and 3 (each shard's gradient cast on its device, summed across the
    processes by TF's collective on that device) and over Horovod at stages 0 and 2 (bfloat16 all-gathered as its
    bits, summed after). Each rank's kernel is the hand-computed one of the wire dtype."""
    import io
    import json
    import os
    import sys

    import tensorflow as tf

    from tfdist.cluster.launcher import launch

    job = os.path.join(os.path.dirname(__file__), "grad_dtype_job.py")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    runs = {"horovod": ["0:bfloat16", "2:bfloat16", "3:float16"], "tf": ["2:bfloat16"],
            "mesh": ["0:bfloat16", "0:float16", "1:bfloat16", "3:bfloat16"],  # a 2 x 2 mesh, a row per process
            "mesh-horovod": ["0:bfloat16", "0:float16", "2:bfloat16"]}
    for backend, tags in runs.items():
        out, log = tmp_path / backend, io.StringIO()
        out.mkdir()
        rc = launch([sys.executable, job, str(out), backend, *tags], 2, backend="horovod" if "horovod" in backend
                    else "tf", devices_per_worker=2 if "mesh" in backend else 1, env=env, out=log, timeout_s=240)
        assert rc == 0, log.getvalue()[-3000:]
        for rank in (0, 1):
            record = json.loads((out / f"rank{rank}.json").read_text())
            for tag in tags:
                wire = {"bfloat16": tf.bfloat16, "float16": tf.float16}[tag.split(":")[1]]
                np.testing.assert_array_equal(np.array(record[tag], "float32"), expected_kernel(wire),
                                              err_msg=f"{backend} rank {rank} {tag}")


def test_memory_report_counts_bytes_by_dtype_under_a_bfloat16_policy():
    """A 'bfloat16' policy makes bfloat16 variables and Adam slots of their dtype; memory_report counts each dtype's
    bytes (stage 0: the output layer kept float32; ZeRO shards one dtype, so at stage 2 all of it is bfloat16) and
    its formula takes the variables' bytes per parameter. The gradients are summed in float32
    (grad_dtype='float32', the reverse direction) and training stays finite."""
    import keras

    keras.mixed_precision.set_global_policy("bfloat16")
    try:
        for stage in (0, 2):
            bf16, f32 = (8 * 16 + 16, 16 * 4 + 4) if stage == 0 else (8 * 16 + 16 + 16 * 4 + 4, 0)
            strategy = tfdist.MirroredStrategy(["/cpu:0", "/cpu:1"], zero_stage=stage, grad_dtype="float32")
            with strategy.scope():
                model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                                          keras.layers.Dense(4, dtype="float32" if stage == 0 else "bfloat16")])
                model.compile(keras.optimizers.Adam(0.01), "mse")
            history = model.fit(np.ones((16, 8)), np.ones((16, 4)), batch_size=8, verbose=0)
            assert np.isfinite(history.history["loss"]).all()
            report = strategy.memory_report(model)
            row = report.rows[0]
            assert row.dtypes["params"] == {"bfloat16": 2 * bf16, **({"float32": 4 * f32} if f32 else {})}, stage
            assert report.formula["params"] == 2 * bf16 + 4 * f32, stage
            assert "by dtype" in str(report) and "bfloat16" in str(report)
            if stage == 0:  # Adam's two slots per variable, in its dtype (and float32/int64 scalars)
                assert row.dtypes["optimizer_state"]["bfloat16"] == 2 * 2 * bf16
                assert row.dtypes["gradients"] == {"bfloat16": 2 * bf16, "float32": 4 * f32}
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_grad_dtype_casts_only_the_gradients_and_refuses_float16_after_unscaling():
    """A reduction outside the optimizer's apply (a synchronized BatchNormalization's sums, a token count) keeps its
    dtype; under mixed_float16 the LossScaleOptimizer unscales before the data-parallel sum, so float16 there is a
    ConfigError naming the fix (ZeRO-3 sums the scaled gradients in the backward and takes it)."""
    import keras
    import pytest
    import tensorflow as tf

    from tfdist.errors import ConfigError

    strategy = tfdist.MirroredStrategy(["/cpu:0", "/cpu:1"], grad_dtype="bfloat16")

    @tf.function
    def counts():
        return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(
            "sum", tf.constant([1001.0, 0.1])))

    np.testing.assert_allclose(strategy.experimental_local_results(counts())[0], [2002.0, 0.2], rtol=1e-7)

    x, y, build = model_and_data(big_at=0)
    x[0, 4] = 0.0  # no overflow here: only the sum's dtype matters
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        for stage, refused in ((0, True), (2, True), (3, False)):
            with tfdist.MirroredStrategy(["/cpu:0", "/cpu:1"], zero_stage=stage, grad_dtype="float16").scope():
                model = build()
                model.compile(keras.optimizers.SGD(0.1), "mse")
            if refused:
                with pytest.raises(ConfigError, match=f"grad_dtype='float16' under a LossScaleOptimizer.*"
                                                      f"at zero_stage {stage}.*bfloat16"):
                    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
            else:
                model.fit(x, y, batch_size=8, epochs=1, verbose=0)
                assert all(np.isfinite(w).all() for w in model.get_weights())
    finally:
        keras.mixed_precision.set_global_policy("float32")
