"""LayerPlacementStrategy trains like one device: stages, micro-batches, data x model, save/load."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import tfdist
from test_placement import branchy, compiled, cpus, data, small_cnn

BUILDERS = {"cnn": small_cnn, "branchy": branchy}


def _train(build, kind, strategy=None, epochs=2, batch=32, lr=0.1):
    keras.utils.set_random_seed(0)
    model = compiled(build, strategy, optimizer=lambda: keras.optimizers.SGD(lr))
    x, y = data(kind)
    model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    return model


def _max_diff(a: keras.Model, b: keras.Model) -> float:
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a.get_weights(), b.get_weights()))


@pytest.mark.parametrize("kind, stages, micro_batches, data_parallel", [
    ("cnn", 2, 1, 1),
    ("cnn", 2, 4, 1),
    ("cnn", 4, 1, 1),
    ("cnn", 4, 2, 1),
    ("branchy", 4, 4, 1),
    ("cnn", 2, 1, 2),
    ("branchy", 2, 2, 2),
])
def test_training_matches_one_device(kind, stages, micro_batches, data_parallel):
    build = BUILDERS[kind]
    reference = _train(build, kind)
    strategy = tfdist.LayerPlacementStrategy(cpus(stages * data_parallel), micro_batches=micro_batches,
                                             data_parallel=data_parallel)
    placed = _train(build, kind, strategy)
    assert strategy.placement_plan().num_stages == stages
    assert _max_diff(reference, placed) <= 1e-5
    x, y = data(kind)
    np.testing.assert_allclose(placed.predict(x, verbose=0), reference.predict(x, verbose=0), atol=1e-5)
    np.testing.assert_allclose(placed.evaluate(x, y, verbose=0), reference.evaluate(x, y, verbose=0), atol=1e-5)


def test_partial_last_batch_is_padded_not_mixed_in():
    # 70 samples, batch 32: the last batch has 6 samples, padded to 8 for 4 micro-batches; the
    # padded rows are dropped before the loss, so training still matches one device exactly.
    def train(strategy):
        keras.utils.set_random_seed(0)
        model = compiled(small_cnn, strategy)
        x, y = data("cnn", 70)
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        return model

    reference = train(None)
    placed = train(tfdist.LayerPlacementStrategy(cpus(2), micro_batches=4))
    assert _max_diff(reference, placed) <= 1e-5


def test_accumulated_micro_batch_gradient_equals_full_batch_gradient():
    # One SGD step with learning rate 1: the weight change is exactly the (accumulated) gradient.
    x, y = data("cnn", 32)
    changes = {}
    for micro_batches in (1, 8):
        strategy = tfdist.LayerPlacementStrategy(cpus(2), micro_batches=micro_batches)
        model = compiled(small_cnn, strategy, optimizer=lambda: keras.optimizers.SGD(1.0))
        before = model.get_weights()
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        changes[micro_batches] = [b - a for a, b in zip(model.get_weights(), before)]
    for g1, g8 in zip(changes[1], changes[8]):
        assert np.max(np.abs(g1)) > 0
        np.testing.assert_allclose(g8, g1, atol=1e-6)


def test_keras_file_round_trip_and_loads_on_one_device(tmp_path, python):
    strategy = tfdist.LayerPlacementStrategy(cpus(2), micro_batches=2)
    model = _train(small_cnn, "cnn", strategy, epochs=1)
    path = str(tmp_path / "placed.keras")
    model.save(path)
    x, _ = data("cnn")
    expected = model.predict(x, verbose=0)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "expected.npy", expected)
    with strategy.scope():  # back into a strategy: same predictions
        again = keras.saving.load_model(path)
    np.testing.assert_allclose(again.predict(x, verbose=0), expected, atol=1e-6)
    # A fresh process with TensorFlow's single default CPU: plain load, same predictions.
    out = python(f"""
        import numpy as np, keras, tensorflow as tf
        assert len(tf.config.list_logical_devices("CPU")) == 1
        model = keras.saving.load_model({path!r})
        got = model.predict(np.load({str(tmp_path / 'x.npy')!r}), verbose=0)
        print("maxdiff", float(np.max(np.abs(got - np.load({str(tmp_path / 'expected.npy')!r})))))
    """)
    assert float(out.stdout.split("maxdiff")[-1]) <= 1e-6


def test_batch_norm_single_micro_batch_matches_and_documented_difference():
    def bn_model():
        init = keras.initializers.GlorotUniform(seed=3)
        return keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, kernel_initializer=init, name="a"),
                                 keras.layers.BatchNormalization(name="bn"),
                                 keras.layers.Dense(3, activation="softmax", kernel_initializer=init, name="b")])

    reference = _train(bn_model, "branchy")
    same = _train(bn_model, "branchy", tfdist.LayerPlacementStrategy(cpus(2)))
    assert _max_diff(reference, same) <= 1e-5
    # GPipe semantics: with micro-batches BatchNormalization normalises each micro-batch with its
    # own statistics (documented in tfdist.placement.pipeline), so training differs measurably.
    micro = _train(bn_model, "branchy", tfdist.LayerPlacementStrategy(cpus(2), micro_batches=4))
    assert _max_diff(reference, micro) > 1e-4
