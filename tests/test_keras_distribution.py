"""`tfdist.enable_keras_distribution()`: Keras' own `keras.distribution` code, unchanged, driving tfdist on
TensorFlow's 4 logical CPUs — DataParallel and ModelParallel (set globally or by `scope()`) equal to one device,
Keras' API restored by `disable_keras_distribution`, and the bad inputs refused before a step runs."""

from __future__ import annotations

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.errors import ConfigError
from tfdist.keras_distribution import front

RNG = np.random.RandomState(0)
X, Y = RNG.rand(64, 12).astype("float32"), RNG.randint(0, 5, size=64)


@pytest.fixture
def enabled():
    tfdist.enable_keras_distribution()
    yield
    keras.distribution.set_distribution(None)
    tfdist.keras_distribution.disable_keras_distribution()


def mlp() -> keras.Model:
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="relu", name="up"),
                             keras.layers.Dense(5, name="down")], name="mlp")


def fit(epochs: int = 2) -> keras.Model:
    model = mlp()
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(X, Y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    return model


@pytest.fixture(scope="module")
def one_device() -> list[np.ndarray]:
    return fit().get_weights()


def assert_close(weights, reference, rtol=1e-5, atol=1e-6):
    assert len(weights) == len(reference)
    for got, want in zip(weights, reference):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def test_plain_keras_on_tensorflow_ignores_a_distribution_until_enabled():
    """Without the call, Keras on TensorFlow accepts a DataParallel and trains on one device (as shipped)."""
    distribution = keras.distribution.DataParallel(devices=keras.distribution.list_devices())
    with distribution.scope():
        model = fit(epochs=1)
    assert model.distribute_strategy.num_replicas_in_sync == 1
    assert not hasattr(keras.src.backend.tensorflow.distribution_lib, "num_processes")


def test_data_parallel_by_scope_equals_one_device_and_leaves_nothing_current(enabled, one_device):
    devices = keras.distribution.list_devices()
    assert devices == [f"cpu:{i}" for i in range(4)]
    distribution = keras.distribution.DataParallel(devices=devices)
    with distribution.scope():
        model = fit()
        strategy = model.distribute_strategy
        assert isinstance(strategy, tfdist.MirroredStrategy) and strategy.num_replicas_in_sync == 4
        assert keras.distribution.distribution() is distribution
        loss = model.evaluate(X, Y, batch_size=16, verbose=0)
        assert model.predict(X[:8], verbose=0).shape == (8, 5)
    assert_close(model.get_weights(), one_device)
    assert np.isfinite(loss)
    assert keras.distribution.distribution() is None and not tf.distribute.has_strategy()
    assert front.strategy_for(distribution) is strategy  # one strategy per distribution object


def test_model_parallel_by_set_distribution_splits_by_the_keras_layout_map(enabled, one_device, tmp_path):
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], keras.distribution.list_devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["mlp/up/kernel"] = (None, "model")
    layout_map["mlp/up/bias"] = ("model",)
    layout_map["mlp/down/kernel"] = ("model", None)
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map,
                                                                         batch_dim_name="batch"))
    model = fit()
    strategy = model.distribute_strategy
    assert isinstance(strategy, tfdist.ModelParallelStrategy) and strategy.num_replicas_in_sync == 2
    plan = strategy.shard_plan(model)
    assert {split.name: split.kind for split in plan.layers} == {"up": "column", "down": "row"}
    assert [tuple(v.shape) for v in plan.layers[0].shards["kernel"]] == [(12, 8), (12, 8)]
    assert_close(model.get_weights(), one_device)
    model.save(tmp_path / "mlp.keras")
    keras.distribution.set_distribution(None)
    assert not tf.distribute.has_strategy()
    assert_close(keras.saving.load_model(tmp_path / "mlp.keras").get_weights(), one_device)


def test_a_custom_training_loop_under_the_distribution_equals_one_device(enabled):
    """TensorFlow's custom-loop pattern, with the strategy the Keras distribution made current."""
    def train(strategy) -> list[np.ndarray]:
        model = mlp()
        optimizer = keras.optimizers.SGD(0.1)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
        data = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((X, Y)).batch(16))

        @tf.function
        def step(batch):
            def replica(x, y):
                with tf.GradientTape() as tape:
                    loss = loss_fn(y, model(x, training=True)) / 16
                optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                              model.trainable_variables))
            strategy.run(replica, args=batch)

        for batch in data:
            step(batch)
        return model.get_weights()

    reference = train(tf.distribute.get_strategy())
    with keras.distribution.DataParallel(devices=keras.distribution.list_devices()).scope():
        strategy = tf.distribute.get_strategy()
        assert strategy.num_replicas_in_sync == 4
        assert_close(train(strategy), reference)


def test_bad_input_is_refused_before_a_step_runs(enabled, monkeypatch):
    # A device this process does not have.
    with pytest.raises(ConfigError, match=r"does not have.*no device '/cpu:4'.*list_devices"):
        with keras.distribution.DataParallel(devices=[f"cpu:{i}" for i in range(8)]).scope():
            pass
    assert keras.distribution.distribution() is None and not tf.distribute.has_strategy()
    # Another process's device before initialize.
    far = ["/job:worker/replica:0/task:0/device:CPU:0", "/job:worker/replica:0/task:1/device:CPU:0"]
    with pytest.raises(ConfigError, match=r"has not joined a job: call keras.distribution.initialize"):
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=far))
    # A model built before the distribution was set.
    model = mlp()
    model.compile(optimizer="adam", loss="mse")
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=keras.distribution.list_devices()))
    with pytest.raises(ConfigError, match=r"'mlp' was built before keras.distribution.set_distribution"):
        model.fit(X, np.zeros((64, 5)), batch_size=16, verbose=0)
    keras.distribution.set_distribution(None)
    # Inside a strategy's own scope.
    with tfdist.MirroredStrategy(devices=["/cpu:0", "/cpu:1"]).scope():
        with pytest.raises(ConfigError, match=r"inside `with strategy.scope\(\):`"):
            keras.distribution.set_distribution(keras.distribution.DataParallel(devices=["cpu:0", "cpu:1"]))
    # initialize with addresses that disagree with the counts, or with nothing to go on.
    with pytest.raises(ConfigError, match=r"lists 2 processes but num_processes=3"):
        keras.distribution.initialize("h:1,h:2", 3, 0)
    with pytest.raises(ConfigError, match=r"process_id must be in \[0, 2\)"):
        keras.distribution.initialize("h:1,h:2", 2, 2)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ConfigError, match=r"no job given.*tfdist launch"):
        keras.distribution.initialize()


def test_initialize_names_every_process_and_its_devices(enabled, monkeypatch):
    """After initialize (here as process 1 of 2, not joined: no strategy is made), Keras sees a job of two
    processes with 4 devices each, as `keras.distribution` does on JAX."""
    monkeypatch.setattr(front, "_job", dict(front._job))
    monkeypatch.delenv("TF_CONFIG", raising=False)
    keras.distribution.initialize("localhost:1,localhost:2", 2, 1)
    assert json.loads(os.environ["TF_CONFIG"])["task"] == {"type": "worker", "index": 1}
    devices = keras.distribution.list_devices()
    assert devices[0] == "/job:worker/replica:0/task:0/device:CPU:0" and len(devices) == 8
    assert keras.distribution.get_device_count() == 8
    distribution = keras.distribution.DataParallel(devices=devices)
    assert (distribution.num_processes, distribution._process_id) == (2, 1)
    data = distribution.distribute_dataset(tf.data.Dataset.range(16).batch(8))
    assert [int(v) for v in data.unbatch()] == [4, 5, 6, 7, 12, 13, 14, 15]  # Keras' own process sharding
    os.environ.pop("TF_CONFIG")  # initialize set it; monkeypatch then restores the state before the test


def test_disable_restores_keras_as_shipped(enabled):
    import keras.src.backend.tensorflow.distribution_lib as backend_lib
    from keras.src.distribution import distribution_lib

    assert keras.distribution.set_distribution is distribution_lib.set_distribution
    assert keras.distribution.set_distribution.__wrapped__ is not None
    tfdist.keras_distribution.disable_keras_distribution()
    assert not hasattr(keras.distribution.set_distribution, "__wrapped__")
    assert not hasattr(backend_lib, "num_processes") and backend_lib.list_devices.__module__ == backend_lib.__name__
    tfdist.enable_keras_distribution()  # the fixture disables again


def test_keras_own_distribution_tests_pass_on_tensorflow_with_their_jax_skips_removed(tmp_path, python):
    """keras/src/distribution/distribution_lib_test.py, as shipped in the wheel, with every
    `skipif(backend.backend() != "jax")` made False, after enable_keras_distribution() on 8 logical CPUs. Every
    test runs (its class mocks of the backend's initialize/num_processes now find them). Its TensorFlow class
    is commented out in the wheel (it tests DTensor meshes), so it is not among them."""
    from keras.src.distribution import distribution_lib

    source = distribution_lib.__file__.replace(".py", "_test.py")
    text = open(source).read()
    assert text.count('backend.backend() != "jax"') == 4
    (tmp_path / "test_keras_distribution_lib.py").write_text(text.replace('backend.backend() != "jax"', "False"))
    (tmp_path / "conftest.py").write_text("import tfdist\ntfdist.devices.virtual_cpus(8)\n"
                                          "tfdist.enable_keras_distribution()\n")
    proc = python("import sys, pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-W', "
                  "'ignore::pytest.PytestUnknownMarkWarning', sys.argv[1]]))", str(tmp_path), check=False)
    assert proc.returncode == 0 and "39 passed in" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-3000:]


@pytest.mark.slow
def test_model_parallel_across_two_processes_equals_one_device(one_device, tmp_path, plain_keras):
    """tests/keras_distribution_job.py under `tfdist launch -n 2 --devices-per-worker 2`: initialize() with no
    arguments, list_devices() naming both processes' devices, a ModelParallel over them, fit from a global
    tf.data.Dataset; both processes end with the one-device weights, evaluate is global (also from per-process
    halves under auto_shard_dataset=False), and the chief's .keras file (a plain model.save) loads in plain Keras."""
    import io
    import sys
    from pathlib import Path

    from tfdist.cluster.launcher import launch

    log = io.StringIO()
    rc = launch([sys.executable, str(Path(__file__).with_name("keras_distribution_job.py")), str(tmp_path)], 2,
                devices_per_worker=2, out=log, timeout_s=300, env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert rc == 0, log.getvalue()[-4000:]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for record in records:
        assert record["devices"] == [f"/job:worker/replica:0/task:{t}/device:CPU:{i}" for t in (0, 1) for i in (0, 1)]
        assert (record["processes"], record["replicas"], record["kind"]) == (2, 2, "ModelParallelStrategy")
        assert_close([np.array(w) for w in record["weights"]], one_device)
    assert records[0]["loss"] == pytest.approx(records[1]["loss"], rel=1e-6)
    # auto_shard_dataset=False: each process gave its own half; the loss is still the global one
    assert [r["own_loss"] for r in records] == pytest.approx([records[0]["loss"]] * 2, rel=1e-5)
    assert_close([np.array(w) for w in plain_keras(tmp_path / "mlp.keras")["weight_list"]], one_device)


# --- the models the Keras ecosystem ships: KerasHub decoders, built from their constructors (no download) --------
HUB_CONFIGS = {"Llama": {}, "Gemma": {"head_dim": 4}}  # Qwen's layers are Llama's; Mistral ships no map


def hub_lm(name: str):
    """A tiny KerasHub decoder backbone and a causal LM over it whose logits reuse the token embedding (tied,
    `ReversibleEmbedding(reverse=True)`)."""
    import keras_hub

    keras.utils.set_random_seed(1)
    backbone = getattr(keras_hub.models, f"{name}Backbone")(
        vocabulary_size=64, num_layers=2, num_query_heads=4, num_key_value_heads=2, hidden_dim=16,
        intermediate_dim=32, **HUB_CONFIGS[name])
    ids = keras.Input((8,), dtype="int32", name="token_ids")
    mask = keras.Input((8,), dtype="int32", name="padding_mask")
    logits = backbone.token_embedding(backbone({"token_ids": ids, "padding_mask": mask}), reverse=True)
    return keras.Model([ids, mask], logits), backbone


def hub_fit(name: str) -> keras.Model:
    rng = np.random.RandomState(0)
    ids = rng.randint(1, 64, size=(32, 8)).astype("int32")
    model, _ = hub_lm(name)
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit([ids, np.ones_like(ids)], rng.randint(0, 64, size=(32, 8)), batch_size=8, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize("name", sorted(HUB_CONFIGS))
def test_a_kerashub_decoder_trains_under_its_own_layout_map_as_on_one_device(name, enabled):
    """The backbone's own `get_layout_map(mesh)` (attention with fewer key/value heads than query heads, gated
    feed-forward, RMS norms, rotary positions, the tied embedding) on a 2 x 2 mesh. As shipped it also splits
    weights over the batch axis, which ModelParallelStrategy refuses before a step; without those entries the split
    model equals one device after 4 Adam steps."""
    reference = hub_fit(name).get_weights()
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], keras.distribution.list_devices())
    shipped = hub_lm(name)[1].get_layout_map(mesh)
    assert any("batch" in shipped[key].axes for key in shipped)
    with keras.distribution.ModelParallel(layout_map=shipped, batch_dim_name="batch").scope():
        with pytest.raises(ConfigError, match=r"over the batch axis 'batch'"):
            hub_fit(name)
    model_axis_only = keras.distribution.LayoutMap(mesh)
    for key in shipped:
        model_axis_only[key] = tuple(None if axis == "batch" else axis for axis in shipped[key].axes)
    with keras.distribution.ModelParallel(layout_map=model_axis_only, batch_dim_name="batch").scope():
        model = hub_fit(name)
        plan = model.distribute_strategy.shard_plan(model)
    assert "reversible" in {split.kind for split in plan.layers} and len(plan.layers) >= 13
    assert_close(model.get_weights(), reference, rtol=1e-4, atol=1e-5)
