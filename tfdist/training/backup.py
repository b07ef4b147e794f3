"""Chief-aware Keras callbacks: backups and checkpoints written once, by the chief, restored by every worker."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile

import keras

from tfdist import compat
from tfdist.cluster.rank import is_chief
from tfdist.data.epochs import EpochOrder
from tfdist.sharding.checkpoint import cross_process_engine, gathered_state

__all__ = ["BackupAndRestore", "ModelCheckpoint", "EpochShuffle", "save_model"]

_BACKUP = re.compile(r"^epoch-(\d+)$")


class BackupAndRestore(keras.callbacks.Callback):
    """Backs up the whole training state after every epoch and restores it when `fit` starts again.

    Multi-worker version of `keras.callbacks.BackupAndRestore` (which has no chief logic in Keras 3):
    - only the chief writes; every worker restores from the same `backup_dir` (a directory all
      workers see: the same machine, or a shared file system);
    - each backup (model and optimizer weights, and the epoch) appears atomically as
      `backup_dir/epoch-N` (written under a temporary name, then renamed), so a worker killed while
      saving leaves the previous backup intact;
    - after a restore `fit` continues at the first unfinished epoch: no epoch lost or repeated.
      With shuffled data, also use `tfdist.data.EpochOrder` (`tfdist.data.load(...).order`) so
      epoch N sees the same order as in an uninterrupted run, and the result is bitwise the same.

    Args:
        backup_dir: directory for the backups (created by the chief).
        delete_on_success: remove `backup_dir` when `fit` finishes (the chief does).
        strategy: the strategy, to decide who is chief (default: the model's strategy, then the
            TF_CONFIG / launcher rank; works for MultiWorkerMirroredStrategy and HorovodStrategy).

    Example:
        >>> backup = tfdist.cluster.BackupAndRestore("/shared/run1/backup")
        >>> model.fit(data, epochs=10, callbacks=[backup])   # rerun the same command after a crash
    """

    def __init__(self, backup_dir: str, delete_on_success: bool = True, strategy=None):
        super().__init__()
        if not backup_dir:
            raise ValueError("backup_dir must name a directory, got an empty value.")
        self.backup_dir = os.fspath(backup_dir)
        self.delete_on_success = delete_on_success
        self._strategy = strategy
        self.restored_epoch: int | None = None

    def _chief(self) -> bool:
        strategy = self._strategy
        if strategy is None and self.model is not None:
            strategy = self.model.distribute_strategy
        return is_chief(strategy)

    def latest(self) -> tuple[int, str] | None:
        """(epochs done, path) of the newest complete backup, or None."""
        if not os.path.isdir(self.backup_dir):
            return None
        found = [(int(m.group(1)), os.path.join(self.backup_dir, name))
                 for name in os.listdir(self.backup_dir) if (m := _BACKUP.match(name))]
        return max(found) if found else None

    def on_train_begin(self, logs=None):
        self.restored_epoch = None
        latest = self.latest()
        if latest is None:
            return
        epochs_done, path = latest
        if self.model.optimizer is not None and not self.model.optimizer.built:
            self.model.optimizer.build(self.model.trainable_variables)
        self.model.load_weights(os.path.join(path, "state.weights.h5"))
        compat.set_initial_epoch(self.model, epochs_done)
        self.restored_epoch = epochs_done
        if self._chief():
            print(f"tfdist: restored {path}; resuming at epoch {epochs_done + 1}", flush=True)

    def on_epoch_end(self, epoch, logs=None):
        # Multi-process ZeRO: the optimizer state is sharded across processes, so every rank joins
        # one all-gather and the chief writes the full logical state (no-op otherwise).
        with gathered_state(self.model):
            self._write(epoch, logs)

    def _write(self, epoch, logs) -> None:
        if not self._chief():
            return  # other workers hold the same state: one copy is enough
        os.makedirs(self.backup_dir, exist_ok=True)
        tmp = os.path.join(self.backup_dir, f".tmp-epoch-{epoch + 1}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        self.model.save_weights(os.path.join(tmp, "state.weights.h5"))  # model + optimizer variables
        with open(os.path.join(tmp, "state.json"), "w") as f:
            json.dump({"epochs_done": epoch + 1, "logs": {k: float(v) for k, v in (logs or {}).items()}}, f)
        final = os.path.join(self.backup_dir, f"epoch-{epoch + 1}")
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        for name in os.listdir(self.backup_dir):  # keep only the newest backup
            m = _BACKUP.match(name)
            if m and int(m.group(1)) < epoch + 1:
                shutil.rmtree(os.path.join(self.backup_dir, name), ignore_errors=True)

    def on_train_end(self, logs=None):
        if self.delete_on_success and self._chief():
            shutil.rmtree(self.backup_dir, ignore_errors=True)


_HOOKS = ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_train_batch_begin",
          "on_train_batch_end", "on_test_begin", "on_test_end", "on_test_batch_begin", "on_test_batch_end",
          "on_predict_begin", "on_predict_end", "on_predict_batch_begin", "on_predict_batch_end")


class ModelCheckpoint(keras.callbacks.Callback):
    """`keras.callbacks.ModelCheckpoint` that saves on the chief only; other workers write nothing.

    Takes the same arguments as `keras.callbacks.ModelCheckpoint`, plus `strategy` (who is chief).
    All workers hold identical weights and identical (all-reduced) metrics, so the chief's copy is
    the model, and "save_best_only" decides the same way everywhere.

    Example:
        >>> ckpt = tfdist.cluster.ModelCheckpoint("out/best.keras", monitor="val_loss", save_best_only=True)
    """

    def __init__(self, filepath, *args, strategy=None, **kwargs):
        super().__init__()
        self.chief = is_chief(strategy)
        self.inner = keras.callbacks.ModelCheckpoint(filepath, *args, **kwargs) if self.chief else None
        # Multi-process ZeRO (shards in other processes): every rank runs the same checkpoint logic,
        # since reading the optimizer state is a collective; other ranks write into a private
        # temporary directory that is emptied after each hook.
        self._args, self._kwargs, self._filepath = args, kwargs, os.fspath(filepath)
        self._scratch: str | None = None

    def _engine(self):
        return cross_process_engine(self.model) if self.model is not None else None

    def _shadow(self):
        """Non-chief ranks under multi-process ZeRO: an inner callback writing to a scratch directory."""
        if self.inner is None:
            self._scratch = tempfile.mkdtemp(prefix="tfdist-ckpt-rank-")
            path = os.path.join(self._scratch, os.path.basename(self._filepath))
            self.inner = keras.callbacks.ModelCheckpoint(path, *self._args, **self._kwargs)
            self.inner.set_model(self.model)
            if self.params:
                self.inner.set_params(self.params)

    def set_model(self, model):
        super().set_model(model)
        if self.inner is not None:
            self.inner.set_model(model)

    def set_params(self, params):
        super().set_params(params)
        if self.inner is not None:
            self.inner.set_params(params)


def _forward(name):
    def hook(self, *args, **kwargs):
        engine = self._engine()
        if engine is not None:
            if not self.chief:
                self._shadow()
            try:
                with engine.state.collective_reads():
                    return getattr(self.inner, name)(*args, **kwargs)
            finally:
                if self._scratch is not None:
                    for entry in os.listdir(self._scratch):
                        target = os.path.join(self._scratch, entry)
                        shutil.rmtree(target) if os.path.isdir(target) else os.remove(target)
                    if name == "on_train_end":
                        shutil.rmtree(self._scratch, ignore_errors=True)
                        self._scratch, self.inner = None, None
        if self.inner is not None and (self.chief or self._scratch is None):
            return getattr(self.inner, name)(*args, **kwargs)

    hook.__name__ = name
    return hook


for _name in _HOOKS:
    setattr(ModelCheckpoint, _name, _forward(_name))


def save_model(model, filepath, strategy=None, **kwargs) -> bool:
    """`model.save(filepath)` for multi-process jobs: call it on every rank; the chief writes.

    With ZeRO across processes (HorovodStrategy / MultiWorkerMirroredStrategy with zero_stage > 0)
    the optimizer state is sharded over the ranks, so every rank joins one all-gather first and the
    file holds the full logical optimizer state (loadable in plain Keras on one device). Without
    it, only the chief does anything. Returns True on the rank that wrote the file.

    Example:
        >>> tfdist.cluster.save_model(model, "out/model.keras")   # every rank
    """
    chief = is_chief(strategy if strategy is not None else model.distribute_strategy)
    with gathered_state(model):
        if chief:
            if os.path.dirname(os.fspath(filepath)):
                os.makedirs(os.path.dirname(os.fspath(filepath)), exist_ok=True)
            model.save(filepath, **kwargs)
    return chief


# Issue 3's name for the per-epoch order; the one implementation lives in the data layer.
EpochShuffle = EpochOrder
