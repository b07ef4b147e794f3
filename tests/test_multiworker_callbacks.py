"""Chief-aware callbacks in one process: fixed per-epoch data order, atomic backups, non-chief writes nothing."""

from __future__ import annotations

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.training import BackupAndRestore, ModelCheckpoint, TensorBoard

NOT_CHIEF = json.dumps({"cluster": {"worker": ["localhost:1", "localhost:2"]}, "task": {"type": "worker", "index": 1}})


def _order(order: tfdist.data.EpochOrder, ds: tf.data.Dataset, epoch: int) -> list[int]:
    order.on_epoch_begin(epoch)
    return [int(v) for v in ds]


def test_the_callbacks_live_in_training_and_the_cluster_keeps_its_own_names():
    import tfdist.training

    for name in ("BackupAndRestore", "ModelCheckpoint", "save_model", "Preemption"):
        assert not hasattr(tfdist.cluster, name) and getattr(tfdist.training, name), name  # no aliases in 0.x
    from tfdist.cluster.requeue import requeue_job

    assert tfdist.cluster.requeue_job is requeue_job
    assert not hasattr(tfdist.cluster, "EpochShuffle")  # the one per-epoch order is tfdist.data.EpochOrder


def test_model_checkpoint_and_tensorboard_forward_every_keras_hook():
    hooks = [f"on_{stage}_{event}" for stage in ("train", "test", "predict") for event in ("begin", "end")]
    hooks += [f"on_{stage}_batch_{event}" for stage in ("train", "test", "predict") for event in ("begin", "end")]
    hooks += ["on_epoch_begin", "on_epoch_end"]
    assert {name for name in vars(keras.callbacks.Callback) if name.startswith("on_")} - {
        "on_batch_begin", "on_batch_end"} == set(hooks)  # Keras' hooks, less the aliases of the train batch hooks
    for callback in (ModelCheckpoint, TensorBoard):
        assert [name for name in hooks if getattr(callback, name) is getattr(keras.callbacks.Callback, name)] == []


def test_epoch_order_depends_only_on_seed_and_epoch():
    a = tfdist.data.EpochOrder(seed=7)
    ds_a = a.apply(tf.data.Dataset.range(50))
    orders = [_order(a, ds_a, e) for e in range(3)]
    assert all(sorted(o) == list(range(50)) for o in orders)
    assert orders[0] != orders[1] != orders[2]
    # A fresh process resuming at epoch 2 (new object, no epochs before) sees epoch 2's order...
    b = tfdist.data.EpochOrder(seed=7)
    assert _order(b, b.apply(tf.data.Dataset.range(50)), 2) == orders[2]
    # ...which plain tf.data reshuffling does not give: a restarted process replays epoch 0's order.
    old = tf.data.Dataset.range(50).shuffle(50, seed=7)
    old_epochs = [[int(v) for v in old] for _ in range(3)]
    restarted = [int(v) for v in tf.data.Dataset.range(50).shuffle(50, seed=7)]
    assert restarted == old_epochs[0] != old_epochs[2]
    assert ds_a.cardinality() == 50


def _model(seed: int = 0) -> keras.Model:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, kernel_initializer=keras.initializers.
                                                                    GlorotUniform(seed)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def test_backup_restores_model_optimizer_and_epoch(tmp_path, monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    x, y = np.random.default_rng(0).normal(size=(64, 4)).astype("float32"), np.ones((64, 1), "float32")
    backup = BackupAndRestore(str(tmp_path / "b"), delete_on_success=False)
    os.makedirs(tmp_path / "b" / ".tmp-epoch-5-999999")  # left by an earlier chief killed while writing
    (tmp_path / "b" / ".tmp-epoch-5-999999" / "state.weights.h5").write_bytes(b"partial")
    model = _model()
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False, callbacks=[backup])
    assert os.listdir(tmp_path / "b") == ["epoch-2"]  # only the newest, complete backup; no temp dirs left
    state = json.loads((tmp_path / "b" / "epoch-2" / "state.json").read_text())
    assert state["epochs_done"] == 2

    resumed = _model(seed=1)  # different initial weights: everything must come from the backup
    resumed.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False, callbacks=[backup])
    assert backup.restored_epoch == 2
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)  # the uninterrupted third epoch
    for a, b in zip(model.get_weights(), resumed.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert int(resumed.optimizer.iterations.numpy()) == 12


@pytest.mark.parametrize("killed", ["before-marking", "while-removing"])
def test_a_chief_killed_while_removing_a_finished_backup_leaves_it_whole_or_never_restored(tmp_path, monkeypatch,
                                                                                            killed):
    """The backup is renamed, then marked incomplete, then removed. A chief killed before the mark leaves the
    finished backup whole: the rerun resumes from it (nothing to train) and removes it. Killed after (here: one
    more file removed, then the process 'killed'), it leaves no backup a rerun would restore half of, and the
    rerun starts afresh and clears what was left."""
    import shutil

    monkeypatch.delenv("TF_CONFIG", raising=False)
    x, y = np.zeros((32, 4), "float32"), np.zeros((32, 1), "float32")
    backup = BackupAndRestore(str(tmp_path / "b"))
    stock_rmtree, stock_remove = shutil.rmtree, os.remove

    def killed_midway(path, *args, **kwargs):
        if ".deleted-" not in str(path):  # the backups' own rotation, as usual
            return stock_rmtree(path, *args, **kwargs)
        stock_remove(os.path.join(path, "epoch-2", "state.weights.h5"))
        raise KeyboardInterrupt  # the chief is gone before the rest is removed

    def killed_before_marking(path, *args, **kwargs):
        if ".deleted-" in str(path):
            raise KeyboardInterrupt
        return stock_remove(path, *args, **kwargs)

    if killed == "while-removing":
        monkeypatch.setattr(shutil, "rmtree", killed_midway)
    else:
        monkeypatch.setattr(os, "remove", killed_before_marking)
    trained = _model()
    with pytest.raises(KeyboardInterrupt):
        trained.fit(x, y, epochs=2, verbose=0, callbacks=[backup])
    monkeypatch.setattr(shutil, "rmtree", stock_rmtree)
    monkeypatch.setattr(os, "remove", stock_remove)
    assert [p.name for p in tmp_path.iterdir()] == [f"b.deleted-{os.getpid()}"]
    whole = (2, str(tmp_path / f"b.deleted-{os.getpid()}" / "epoch-2"))
    assert backup.latest() == (whole if killed == "before-marking" else None)
    rerun, again, ran = _model(seed=1), BackupAndRestore(str(tmp_path / "b")), []
    rerun.fit(x, y, epochs=2, verbose=0,
              callbacks=[again, keras.callbacks.LambdaCallback(on_epoch_begin=lambda epoch, logs: ran.append(epoch))])
    if killed == "before-marking":
        assert again.restored_epoch == 2 and ran == []  # nothing left to train
        for a, b in zip(trained.get_weights(), rerun.get_weights(), strict=True):
            np.testing.assert_array_equal(a, b)
    else:
        assert again.restored_epoch is None and ran == [0, 1]  # starts afresh
    assert list(tmp_path.iterdir()) == []


def test_a_removal_cut_short_between_two_marks_leaves_the_newest_backup(tmp_path, monkeypatch):
    """A finished run that had resumed from an older run's finished backup removes both: marked oldest first, so a
    kill between the marks leaves the newest restorable, never the older one. A backup without its weights file
    (half-removed by an older tfdist) is not complete."""
    from tfdist.training import backup as backup_module

    def make(folder, epoch, payload=True):
        path = tmp_path / folder / f"epoch-{epoch}"
        path.mkdir(parents=True)
        (path / "state.json").write_text("{}")
        if payload:
            (path / "state.weights.h5").write_bytes(b"w")

    make("b", 8)
    make("b.deleted-1", 6)
    make("b.deleted-2", 9, payload=False)
    backup = BackupAndRestore(str(tmp_path / "b"))
    assert backup.latest() == (8, str(tmp_path / "b" / "epoch-8"))
    stock_remove, removed = os.remove, []

    def killed_after_one(path):
        if removed:
            raise KeyboardInterrupt
        removed.append(path)
        stock_remove(path)

    monkeypatch.setattr(os, "remove", killed_after_one)
    with pytest.raises(KeyboardInterrupt):
        backup_module._remove([str(tmp_path / "b"), str(tmp_path / "b.deleted-1")])
    assert removed == [str(tmp_path / "b.deleted-1" / "epoch-6" / "state.json")]
    assert backup.latest() == (8, str(tmp_path / "b" / "epoch-8"))


def test_an_empty_backup_dir_is_a_config_error():
    from tfdist.errors import ConfigError

    for empty in ("", None):
        with pytest.raises(ConfigError, match="backup_dir must name a directory, got an empty value"):
            BackupAndRestore(empty)


def test_non_chief_writes_no_backup_and_no_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", NOT_CHIEF)  # rank 1 of 2 (no strategy needed to decide)
    x, y = np.zeros((32, 4), "float32"), np.zeros((32, 1), "float32")
    backup = BackupAndRestore(str(tmp_path / "b"), delete_on_success=False)
    ckpt = ModelCheckpoint(str(tmp_path / "m.keras"))
    _model().fit(x, y, epochs=2, verbose=0, callbacks=[backup, ckpt])
    assert os.listdir(tmp_path) == []
    monkeypatch.delenv("TF_CONFIG")
    ckpt = ModelCheckpoint(str(tmp_path / "m.keras"))
    _model().fit(x, y, epochs=1, verbose=0, callbacks=[ckpt])
    assert os.listdir(tmp_path) == ["m.keras"]


def test_epoch_order_apply_matches_the_array_order_and_blocks_stay_complete():
    order = tfdist.data.EpochOrder(seed=5)
    ds = order.apply(tf.data.Dataset.from_tensor_slices({"i": tf.range(40, dtype=tf.int64)}))
    order.epoch = 3
    assert [int(e["i"]) for e in ds] == order.permutation(3, 40).tolist()  # same order as order.dataset()
    blocked = tfdist.data.EpochOrder(seed=5).apply(tf.data.Dataset.range(40), buffer_size=16)
    seen = [int(v) for v in blocked]
    assert [sorted(seen[i:i + 16]) for i in (0, 16, 32)] == [list(range(i, min(i + 16, 40))) for i in (0, 16, 32)]
    assert seen != list(range(40))


def test_tensorboard_writes_on_the_chief_or_per_worker(tmp_path, monkeypatch):
    x, y = np.zeros((32, 4), "float32"), np.zeros((32, 1), "float32")
    monkeypatch.setenv("TF_CONFIG", NOT_CHIEF)
    _model().fit(x, y, epochs=1, verbose=0, callbacks=[TensorBoard(str(tmp_path / "logs"), profile_batch=1)])
    assert not (tmp_path / "logs").exists()  # rank 1: the chief's logs are the job's
    _model().fit(x, y, epochs=1, verbose=0, callbacks=[TensorBoard(str(tmp_path / "logs"), per_worker=True,
                                                                   profile_batch=1)])
    assert sorted(p.name for p in (tmp_path / "logs" / "worker_1").iterdir()) == ["train"]  # no profile here
    monkeypatch.delenv("TF_CONFIG")
    _model().fit(x, y, epochs=1, verbose=0, callbacks=[TensorBoard(str(tmp_path / "chief"))])
    assert list((tmp_path / "chief" / "train").glob("events.out.tfevents.*"))
    with pytest.raises(tfdist.ConfigError, match="per_worker must be True or False"):
        TensorBoard(str(tmp_path), per_worker="yes")
