"""tfdist.MirroredStrategy against one device: same weights, same evaluate/predict, exact .keras round-trip."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from conftest import REPLICAS

GLOBAL_BATCH = 32
STEPS = 6


def _data():
    arrays = tfdist.data.load_arrays("digits")
    n = GLOBAL_BATCH * STEPS
    return arrays.x_train[:n], arrays.y_train[:n], arrays.x_test, arrays.y_test


def _dataset(x, y):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)


def _compiled(strategy=None, optimizer=lambda: keras.optimizers.SGD(0.1)):
    scope = strategy.scope() if strategy else tf.distribute.get_strategy().scope()
    with scope:  # the optimizer too is created inside the scope
        model = tfdist.models.cnn((8, 8, 1), 10, filters=(8, 16), dense_units=32, seed=1)
        model.compile(optimizer=optimizer(), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    return model


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def test_four_replicas_match_one_device_with_sgd():
    x, y, x_test, y_test = _data()
    strategy = tfdist.MirroredStrategy()
    assert strategy.num_replicas_in_sync == REPLICAS
    single, mirrored = _compiled(), _compiled(strategy)
    assert _max_diff(single.get_weights(), mirrored.get_weights()) == 0.0

    single.fit(_dataset(x, y), epochs=2, shuffle=False, verbose=0)
    mirrored.fit(_dataset(x, y), epochs=2, shuffle=False, verbose=0)
    assert _max_diff(single.get_weights(), mirrored.get_weights()) < 1e-5
    assert _max_diff(single.get_weights(), _compiled().get_weights()) > 1e-3  # training really moved them

    loss_1, acc_1 = single.evaluate(_dataset(x_test, y_test), verbose=0)
    loss_4, acc_4 = mirrored.evaluate(_dataset(x_test, y_test), verbose=0)
    assert loss_4 == pytest.approx(loss_1, abs=1e-5) and acc_4 == pytest.approx(acc_1, abs=1e-6)
    np.testing.assert_allclose(mirrored.predict(x_test, batch_size=GLOBAL_BATCH, verbose=0),
                               single.predict(x_test, batch_size=GLOBAL_BATCH, verbose=0), atol=1e-5)


@pytest.mark.parametrize("cross_device_ops", ["reduce_to_one", "hierarchical_copy"])
def test_cross_device_op_names_give_the_same_training(cross_device_ops):
    x, y, _, _ = _data()
    reference = _compiled(tfdist.MirroredStrategy())
    other = _compiled(tfdist.MirroredStrategy(cross_device_ops=cross_device_ops))
    reference.fit(_dataset(x, y), shuffle=False, verbose=0)
    other.fit(_dataset(x, y), shuffle=False, verbose=0)
    assert _max_diff(reference.get_weights(), other.get_weights()) < 1e-5


def test_strategies_over_different_device_sets_coexist_in_one_process():
    # Stock MirroredStrategy objects share collective keys: a 2-device one after a 4-device one fails.
    x, y, _, _ = _data()
    results = []
    for devices in (None, ["/cpu:0", "/cpu:1"], ["/cpu:2", "/cpu:3"], ["/cpu:1"]):
        model = _compiled(tfdist.MirroredStrategy(devices))
        model.fit(_dataset(x, y), shuffle=False, verbose=0)
        results.append(model.get_weights())
    for weights in results[1:]:
        assert _max_diff(results[0], weights) < 1e-5


def test_keras_round_trip_inside_scope_is_exact(tmp_path):
    x, y, x_test, _ = _data()
    strategy = tfdist.MirroredStrategy()
    model = _compiled(strategy, lambda: keras.optimizers.Adam(1e-3))
    model.fit(_dataset(x, y), shuffle=False, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    with strategy.scope():
        restored = keras.models.load_model(path)
    assert _max_diff(model.get_weights(), restored.get_weights()) == 0.0
    assert _max_diff([v.numpy() for v in model.optimizer.variables],
                     [v.numpy() for v in restored.optimizer.variables]) == 0.0
    np.testing.assert_array_equal(model.predict(x_test, verbose=0), restored.predict(x_test, verbose=0))
    # Training continues identically from the restored state (weights and Adam slots).
    model.fit(_dataset(x, y), shuffle=False, verbose=0)
    restored.fit(_dataset(x, y), shuffle=False, verbose=0)
    assert _max_diff(model.get_weights(), restored.get_weights()) == 0.0
    # And the file is plain Keras: it loads without any strategy.
    plain = keras.models.load_model(path)
    assert plain.count_params() == model.count_params()


def test_callbacks_run_under_the_strategy(tmp_path):
    x, y, x_test, y_test = _data()
    model = _compiled(tfdist.MirroredStrategy())
    checkpoint = str(tmp_path / "best.keras")
    history = model.fit(
        _dataset(x, y), validation_data=_dataset(x_test, y_test), epochs=3, shuffle=False, verbose=0,
        callbacks=[keras.callbacks.ModelCheckpoint(checkpoint, monitor="val_loss", save_best_only=True),
                   keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
                   keras.callbacks.EarlyStopping(monitor="val_loss", patience=5)])
    assert len(history.history["val_loss"]) == 3
    assert (tmp_path / "best.keras").exists()
    assert len((tmp_path / "log.csv").read_text().strip().splitlines()) == 4  # header + 3 epochs
