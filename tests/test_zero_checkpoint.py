"""ZeRO checkpoints hold the full logical optimizer state and restore at any world size."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.errors import ConfigError

RNG = np.random.default_rng(1)
X = RNG.normal(size=(256, 8, 8, 1)).astype("float32")
Y = RNG.integers(0, 10, 256)


def make(replicas: int, stage: int, optimizer="adam", dense_units: int = 16):
    strategy = tfdist.MirroredStrategy(tfdist.devices.virtual_cpus(4)[:replicas], zero_stage=stage)
    with strategy.scope():
        model = tfdist.models.cnn((8, 8, 1), 10, filters=(4, 8), dense_units=dense_units, seed=0)
        model.compile(optimizer=keras.optimizers.Adam(1e-2) if optimizer == "adam" else optimizer(),
                      loss="sparse_categorical_crossentropy")
    return strategy, model


def fit(model, epochs: int = 1, **kw):
    model.fit(X, Y, batch_size=64, epochs=epochs, shuffle=False, verbose=0, **kw)


def state(model) -> list[np.ndarray]:
    return [np.asarray(v.numpy()) for v in model.optimizer.variables]


def assert_same(a: list, b: list):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert np.shape(x) == np.shape(y)
        np.testing.assert_array_equal(x, y)


def max_rel(a: list, b: list) -> float:
    return max(float(np.max(np.abs(x - y)) / max(float(np.max(np.abs(x))), 1e-12)) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Stage 2 on 4 replicas, 8 steps; saved as .keras and tf.train.Checkpoint; then 4 steps more."""
    d = tmp_path_factory.mktemp("zero_ckpt")
    _, model = make(4, 2)
    fit(model, 2)
    model.save(d / "model.keras")
    prefix = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(str(d / "ckpt"))
    saved = {"dir": d, "keras": str(d / "model.keras"), "prefix": prefix, "state": state(model),
             "weights": model.get_weights()}
    np.savez(d / "state.npz", *saved["state"])
    fit(model, 1)
    saved["weights_after"] = model.get_weights()
    return saved


@pytest.mark.parametrize("replicas, stage", [(4, 2), (2, 1), (1, 1), (2, 2), (4, 0)])
def test_keras_file_restores_at_any_world_size(saved, replicas, stage):
    strategy = tfdist.MirroredStrategy(tfdist.devices.virtual_cpus(4)[:replicas], zero_stage=stage)
    with strategy.scope():
        model = keras.models.load_model(saved["keras"])
    assert_same(saved["state"], state(model))
    assert_same(saved["weights"], model.get_weights())
    fit(model, 1)  # training continues as it would have on the original 4 replicas
    if (replicas, stage) == (4, 2):
        assert_same(saved["weights_after"], model.get_weights())
    else:
        assert max_rel(saved["weights_after"], model.get_weights()) < 1e-4


def test_tf_checkpoint_reshards_4_to_2_to_1_and_back(saved, tmp_path):
    prefix = saved["prefix"]
    for replicas, stage in [(2, 1), (1, 2), (4, 1)]:
        _, model = make(replicas, stage)
        model.optimizer.build(model.trainable_variables)
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).read(prefix).assert_consumed()
        assert_same(saved["state"], state(model))
        assert_same(saved["weights"], model.get_weights())
        prefix = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(str(tmp_path / f"n{replicas}"))
    # and a plain (no tfdist) Keras model reads the same checkpoint into ordinary variables
    plain = tfdist.models.cnn((8, 8, 1), 10, filters=(4, 8), dense_units=16, seed=0)
    plain.compile(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy")
    plain.optimizer.build(plain.trainable_variables)
    tf.train.Checkpoint(model=plain, optimizer=plain.optimizer).read(prefix).assert_consumed()
    assert_same(saved["state"], state(plain))


def test_plain_keras_loads_tfdist_file_without_tfdist(saved, python):
    out = python(f"""
        import sys, numpy as np, keras
        model = keras.models.load_model({saved['keras']!r})
        ref = np.load({str(saved['dir'] / 'state.npz')!r})
        got = [np.asarray(v.numpy()) for v in model.optimizer.variables]
        assert len(got) == len(ref.files), (len(got), len(ref.files))
        for i, g in enumerate(got):
            np.testing.assert_array_equal(g, ref[f"arr_{{i}}"])
        assert not any(m.startswith("tfdist") for m in sys.modules)
        print("plain-keras-ok", type(model.optimizer).__name__)
    """)
    assert "plain-keras-ok Adam" in out.stdout


def test_model_checkpoint_and_backup_and_restore(tmp_path):
    _, model = make(4, 2)
    callbacks = [keras.callbacks.ModelCheckpoint(str(tmp_path / "ep{epoch}.keras")),
                 keras.callbacks.BackupAndRestore(str(tmp_path / "backup"), delete_checkpoint=False)]
    fit(model, 2, callbacks=callbacks)
    expected_state, expected_weights = state(model), model.get_weights()

    strategy = tfdist.MirroredStrategy(tfdist.devices.virtual_cpus(4)[:1], zero_stage=1)
    with strategy.scope():
        restored = keras.models.load_model(str(tmp_path / "ep2.keras"))
    assert_same(expected_state, state(restored))

    _, resumed = make(2, 1)  # resumes from the backup: epochs already done are skipped
    fit(resumed, 2, callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))])
    assert_same(expected_state, state(resumed))
    assert_same(expected_weights, resumed.get_weights())


def test_checkpoint_of_another_optimizer_is_refused(tmp_path):
    _, model = make(2, 0, optimizer=lambda: keras.optimizers.SGD(0.1, momentum=0.9))
    fit(model, 1)
    model.save_weights(str(tmp_path / "sgd.weights.h5"))
    _, other = make(2, 1)
    fit(other, 1)
    with pytest.raises(ValueError, match="holds 10 optimizer variables but this optimizer has 18"):
        other.load_weights(str(tmp_path / "sgd.weights.h5"))


def test_checkpoint_of_another_model_is_refused(tmp_path):
    _, model = make(2, 1, dense_units=8)
    fit(model, 1)
    prefix = tf.train.Checkpoint(optimizer=model.optimizer).write(str(tmp_path / "small"))
    _, other = make(2, 1, dense_units=16)
    other.optimizer.build(other.trainable_variables)
    with pytest.raises(ValueError, match=r"shape.*\(128, 16\).*\(128, 8\)"):
        tf.train.Checkpoint(optimizer=other.optimizer).read(prefix)
    # a checkpoint holding only the optimizer slots, of another shape: refused by the logical slots
    slot = other.optimizer.variables[-1]
    with pytest.raises(ConfigError, match="different model"):
        slot.assign(np.zeros((3,), "float32"))
