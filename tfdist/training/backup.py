"""BackupAndRestore: the whole training state after every epoch, written by the chief, restored by every worker."""

from __future__ import annotations

import json
import os
import re
import shutil

import keras
import tensorflow as tf

from tfdist._compat import keras_model
from tfdist.cluster.rank import is_chief, world_size
from tfdist.errors import ConfigError
from tfdist.zero.attach import gathered_state

__all__ = ["BackupAndRestore"]

_BACKUP = re.compile(r"^epoch-(\d+)$")
_PARTIAL = re.compile(r"^\.tmp-epoch-\d+-\d+$")  # a backup being written (or left by a chief killed mid-write)


class BackupAndRestore(keras.callbacks.Callback):
    """Backs up the whole training state after every epoch and restores it when `fit` starts again.

    Multi-worker version of `keras.callbacks.BackupAndRestore` (which has no chief logic in Keras 3):
    - only the chief writes; every worker restores from the same `backup_dir` (a directory all
      workers see: the same machine, or a shared file system);
    - each backup (model and optimizer weights, and the epoch) appears atomically as
      `backup_dir/epoch-N` (written under a temporary name, then renamed), so a worker killed while
      saving leaves the previous backup intact (its partial copy is removed when training starts again);
    - with `delete_on_success`, the backup goes only once every rank has finished `fit`: a rank lost
      after the chief is done makes the restarted job resume from it instead of starting over; it is
      renamed and marked incomplete before anything else is removed, so a chief killed while removing it
      leaves either the whole finished backup (the rerun resumes from it and trains nothing) or one no
      rerun restores (cleared at the next start);
    - after a restore `fit` continues at the first unfinished epoch: no epoch lost or repeated;
    - under `ParameterServerStrategy` a backup is a `tf.train.Checkpoint`, each server writing its own
      shards, so `backup_dir` must be writable by every server too (elsewhere, the chief's `.weights.h5`).
      With shuffled data, also use `tfdist.data.EpochOrder` (`tfdist.data.load(...).order`) so
      epoch N sees the same order as in an uninterrupted run, and the result is bitwise the same.

    Args:
        backup_dir: directory for the backups (created by the chief).
        delete_on_success: remove `backup_dir` when `fit` finishes (the chief does).
        strategy: the strategy, to decide who is chief (default: the model's strategy, then the
            TF_CONFIG / launcher rank; works for MultiWorkerMirroredStrategy and HorovodStrategy).

    Example:
        >>> from tfdist.training import BackupAndRestore
        >>> backup = BackupAndRestore("/shared/run1/backup")
        >>> model.fit(data, epochs=10, callbacks=[backup])   # rerun the same command after a crash
    """

    def __init__(self, backup_dir: str, delete_on_success: bool = True, strategy=None):
        super().__init__()
        if not backup_dir:
            raise ConfigError("BackupAndRestore: backup_dir must name a directory, got an empty value. Pass a "
                             "directory every worker sees, e.g. BackupAndRestore('/shared/run1/backup').")
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
        """(epochs done, path) of the newest complete backup, or None.

        A finished run's backup that its chief was killed while removing (`backup_dir.deleted-PID`, not yet
        marked incomplete) counts too: every rank had finished, and the rerun resumes from it."""
        found = [(int(m.group(1)), folder == self.backup_dir, os.path.join(folder, name))
                 for folder in (self.backup_dir, *self._being_removed())
                 for name in _listdir(folder) if (m := _BACKUP.match(name))]
        complete = [backup for backup in found if _complete(backup[2])]
        if not complete:
            return None
        epochs, _, path = max(complete)  # the newest; on a tie, the one in backup_dir
        return epochs, path

    def on_train_begin(self, logs=None):
        self.restored_epoch = None
        if self._chief():
            self._remove_partial()  # what a chief killed while writing left behind
        latest = self.latest()
        if latest is None:
            return
        epochs_done, path = latest
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            # Its slots must exist before load_weights, as variables of the model's strategy.
            with self.model.distribute_strategy.scope():
                optimizer.build(self.model.trainable_variables)
        if os.path.exists(os.path.join(path, _CHECKPOINT + ".index")):  # written by parameter servers
            _checkpoint(self.model).read(os.path.join(path, _CHECKPOINT)).assert_consumed()
        else:
            self.model.load_weights(os.path.join(path, "state.weights.h5"))
        keras_model.set_initial_epoch(self.model, epochs_done)
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
        if _on_parameter_servers(self.model):  # each server writes its own shards: no table gathered here
            _checkpoint(self.model).write(os.path.join(tmp, _CHECKPOINT))
        else:
            self.model.save_weights(os.path.join(tmp, "state.weights.h5"))  # model + optimizer variables
        with open(os.path.join(tmp, _COMPLETE), "w") as f:
            json.dump({"epochs_done": epoch + 1, "logs": {k: float(v) for k, v in (logs or {}).items()}}, f)
        final = os.path.join(self.backup_dir, f"epoch-{epoch + 1}")
        _remove_backup(final)
        os.rename(tmp, final)
        for name in os.listdir(self.backup_dir):  # keep only the newest backup
            m = _BACKUP.match(name)
            # Only the chief writes, one backup at a time: another temporary directory is what a chief
            # killed while writing left behind (its process is gone; ours has just been renamed).
            if m and int(m.group(1)) < epoch + 1:
                _remove_backup(os.path.join(self.backup_dir, name))
            elif _PARTIAL.match(name):
                shutil.rmtree(os.path.join(self.backup_dir, name), ignore_errors=True)
        # A finished run's backup this run resumed from is older than this one; every rank has long restored.
        _remove(self._being_removed())

    def on_train_end(self, logs=None):
        if not self.delete_on_success:
            return
        # Only once every rank has finished: a rank that fails after the chief is done restarts the job, which
        # must find the last backup, not start over. A lost rank fails this collective, and nothing is deleted.
        strategy = self._strategy or self.model.distribute_strategy
        all_ranks_finished(strategy)
        if self._chief():
            folders = self._being_removed()  # e.g. the finished backup this run resumed from: it goes too
            if os.path.isdir(self.backup_dir):
                doomed = f"{os.path.normpath(self.backup_dir)}.deleted-{os.getpid()}"
                try:  # renamed first (atomic), so no rerun finds a backup_dir being emptied
                    os.rename(self.backup_dir, doomed)
                except OSError:  # e.g. a mount point, or no write access to its parent: removed where it is
                    doomed = self.backup_dir
                folders.append(doomed)
            _remove(folders)
        # Once more after the removal: a rank that called fit again at once would otherwise find a backup the
        # chief is removing, and start at another epoch than the chief.
        all_ranks_finished(strategy)

    def _being_removed(self) -> list[str]:
        """`backup_dir.deleted-PID` siblings: finished runs' backups whose chief was killed while removing them."""
        parent, base = os.path.split(os.path.normpath(self.backup_dir))
        return [os.path.join(parent, name) for name in _listdir(parent or ".")
                if re.fullmatch(re.escape(base) + r"\.deleted-\d+", name)]

    def _remove_partial(self) -> None:
        """What a chief killed while writing a backup, or while removing one, left behind (every rank reads
        backups only once they are complete, so the chief may remove the rest before they look)."""
        for name in _listdir(self.backup_dir):
            if _PARTIAL.match(name):
                shutil.rmtree(os.path.join(self.backup_dir, name), ignore_errors=True)
        for folder in self._being_removed():
            if not any(_complete(os.path.join(folder, name)) for name in _listdir(folder) if _BACKUP.match(name)):
                shutil.rmtree(folder, ignore_errors=True)


_COMPLETE = "state.json"  # written last into a backup, removed first from one being deleted
_PAYLOADS = ("state.weights.h5", "state.index")  # what a backup holds: Keras weights, or a tf.train.Checkpoint


def _complete(backup: str) -> bool:
    return os.path.exists(os.path.join(backup, _COMPLETE)) and any(
        os.path.exists(os.path.join(backup, payload)) for payload in _PAYLOADS)


def _listdir(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:  # none yet, a leftover the chief has just removed, or a folder this process cannot read
        return []


def _remove_backup(backup: str) -> None:
    """One backup, marked incomplete before anything else goes: a kill midway leaves nothing restorable."""
    marker = os.path.join(backup, _COMPLETE)
    if os.path.exists(marker):
        os.remove(marker)
    shutil.rmtree(backup, ignore_errors=True)


def _remove(folders: list[str]) -> None:
    """Removes backup folders so that a kill at any moment leaves the newest backup whole or nothing restorable:
    every backup is marked incomplete oldest first (the newest last), then the folders go."""
    backups = [(int(m.group(1)), os.path.join(folder, name))
               for folder in folders for name in _listdir(folder) if (m := _BACKUP.match(name))]
    for _, backup in sorted(backups):
        marker = os.path.join(backup, _COMPLETE)
        if os.path.exists(marker):
            os.remove(marker)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


_CHECKPOINT = "state"  # the tf.train.Checkpoint prefix of a backup made under parameter servers


def _on_parameter_servers(model) -> bool:
    return isinstance(model.distribute_strategy, tf.distribute.experimental.ParameterServerStrategy)


def _checkpoint(model) -> tf.train.Checkpoint:
    """Model and optimizer variables as a tf.train.Checkpoint: under parameter servers a sharded variable is one
    entry per shard, written and read by its server (tfdist.parameter_server), where `.weights.h5` would read
    every variable whole into the chief."""
    return tf.train.Checkpoint(model=model, optimizer=model.optimizer)


def all_ranks_finished(strategy: tf.distribute.Strategy) -> None:
    """Collective over the processes that train under `strategy` (a SUM of one per replica): it returns once
    every one of them has called it, and fails if one is gone. Nothing to wait for in a single process, or
    under a parameter-server strategy (only its chief runs `fit`)."""
    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy) or world_size(strategy) <= 1:
        return
    ones = strategy.experimental_distribute_values_from_function(lambda _: tf.constant(1.0))
    strategy.reduce(tf.distribute.ReduceOp.SUM, ones, axis=None)
