"""Preemption under SLURM: on SIGUSR1/SIGTERM, stop fit cleanly, keep the checkpoint, requeue the job.

`sbatch --signal=USR1@120` makes SLURM signal the job steps that many seconds before the time limit
(and `scancel --signal=USR1 JOB` does it by hand). `Preemption` is a Keras callback that wraps the
backup callback (`tfdist.training.BackupAndRestore` by default: the chief writes, every worker
restores; any callback with BackupAndRestore's protocol plugs in through `backup=`): at the next
epoch end (or step, with `at="step"`) it stops training, makes sure the last *complete* epoch is
saved and the checkpoint is not deleted, and the chief requeues the job (`tfdist.cluster.requeue_job`:
`scontrol requeue $SLURM_JOB_ID`). The requeued job (same id, SLURM_RESTART_COUNT + 1) restores
from that epoch. Only whole epochs count: with `at="step"` the partial epoch is discarded and run
again after the restart, so with an epoch-keyed data order (`tfdist.data.EpochOrder`, which
`tfdist.data.load` uses for training data) the final weights equal those of an uninterrupted run.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence

import keras
import tensorflow as tf

from tfdist._compat import keras_model
from tfdist.cluster.rank import is_chief as chief_of
from tfdist.cluster.rank import world_size
from tfdist.cluster.requeue import requeue_job
from tfdist.errors import ConfigError

__all__ = ["Preemption", "collective_agreement"]


class Preemption(keras.callbacks.Callback):
    """Keras callback: checkpoint and requeue when SLURM announces the end of the job.

    Pass it to `fit` instead of the backup callback it wraps (it forwards the backup's events).

    Args:
        backup_dir: where `tfdist.training.BackupAndRestore` keeps its checkpoint (ignored when `backup`
            given); the chief of the model's strategy writes it, every worker restores from it.
        backup: a callback with BackupAndRestore's protocol (restores in on_train_begin, saves in
            on_epoch_end, deletes in on_train_end), e.g. `keras.callbacks.BackupAndRestore`.
        at: "epoch" (finish the current epoch, then stop) or "step" (stop after the current step and
            redo the unfinished epoch after the restart).
        signals: signals that stop training. requeue_signals: those that also requeue the job.
            SIGTERM is what `scancel` sends too, so by default it checkpoints but does not requeue.
        requeue: requeue with `scontrol requeue` (True), not at all (False), or call this function.
        is_chief: whether this process requeues; default: rank 0 of the model's strategy
            (`tfdist.cluster.is_chief`: TF_CONFIG task, Horovod/MPI rank or SLURM_PROCID).
        agree: maps this worker's "signal seen" flag to the decision of all workers. Workers must
            stop at the same step or the others hang in the next all-reduce. Default: the local
            flag for one process; `collective_agreement(strategy)` (an all-reduce of the flags
            through the strategy, global for MultiWorkerMirroredStrategy and HorovodStrategy alike)
            when the model's strategy spans several processes (`tfdist.cluster.world_size`).

    Example:
        >>> from tfdist.training import Preemption
        >>> stop = Preemption(backup_dir="ckpt")
        >>> model.fit(data.train, epochs=10, callbacks=[stop, data.order])
        >>> if stop.preempted: sys.exit(0)     # requeued; the next run resumes from the checkpoint
    """

    def __init__(
        self,
        backup_dir: str | None = None,
        *,
        backup: keras.callbacks.Callback | None = None,
        at: str = "epoch",
        signals: Sequence[int] = (signal.SIGUSR1, signal.SIGTERM),
        requeue_signals: Sequence[int] = (signal.SIGUSR1,),
        requeue: bool | Callable[[], None] = True,
        is_chief: bool | None = None,
        agree: Callable[[bool], bool] | None = None,
        environ: Mapping[str, str] | None = None,
    ):
        super().__init__()
        if at not in ("epoch", "step"):
            raise ConfigError(f"at must be 'epoch' or 'step', got {at!r}.")
        if backup is None:
            if not backup_dir:
                raise ConfigError("Preemption needs backup_dir (a directory for the checkpoint) or backup=.")
            from tfdist.training.backup import BackupAndRestore

            backup = BackupAndRestore(backup_dir)
        self.backup = backup
        self.at = at
        self.signals = tuple(signals)
        self.requeue_signals = tuple(requeue_signals)
        self._requeue = requeue
        self._env = os.environ if environ is None else environ
        self._chief = is_chief
        self._agree = agree
        self.received: int | None = None  # the signal that arrived
        self.preempted = False  # fit stopped because of a signal
        self.requeued = False
        self.completed_epochs: list[int] = []
        self._mid_epoch = False
        self._previous: dict[int, object] = {}

    @property
    def is_chief(self) -> bool:
        """Whether this process requeues the job (decided when training starts, unless given)."""
        return bool(self._chief) if self._chief is not None else chief_of(None, self._env)

    # --- signals ---------------------------------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:
        # Only record it: Python runs this between steps, and the callbacks act at a safe point.
        if self.received is None or signum in self.requeue_signals:
            self.received = signum
        print(f"tfdist: received {signal.Signals(signum).name}; stopping after the current {self.at}",
              file=sys.stderr, flush=True)

    def _install(self) -> None:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _should_stop(self) -> bool:
        seen = self.received is not None
        return bool(self._agree(seen)) if self._agree is not None else seen

    # --- Keras events ------------------------------------------------------------------------------
    def set_model(self, model):
        super().set_model(model)
        self.backup.set_model(model)

    def set_params(self, params):
        super().set_params(params)
        self.backup.set_params(params)

    def on_train_begin(self, logs=None):
        self._install()
        strategy = self.model.distribute_strategy
        if self._chief is None:
            self._chief = chief_of(strategy, self._env)
        # Parameter-server training: only the chief runs the loop, so its own flag is the decision.
        coordinated = isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy)
        if self._agree is None and world_size(strategy, self._env) > 1 and not coordinated:
            self._agree = collective_agreement(strategy)
        self.backup.on_train_begin(logs)
        start = keras_model.initial_epoch(self.model)
        if start:
            print(f"tfdist: resuming from the checkpoint at epoch {start}", flush=True)

    def on_epoch_begin(self, epoch, logs=None):
        self._mid_epoch = False
        self.backup.on_epoch_begin(epoch, logs)

    def on_train_batch_begin(self, batch, logs=None):
        self.backup.on_train_batch_begin(batch, logs)

    def on_train_batch_end(self, batch, logs=None):
        self.backup.on_train_batch_end(batch, logs)
        steps = self.params.get("steps") if self.params else None
        if self.at == "step" and self._should_stop() and (steps is None or batch + 1 < steps):
            self._mid_epoch = True
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if self._mid_epoch:
            # Stopped inside the epoch: it did not happen. The backup keeps the previous epoch.
            self.preempted = True
            return
        self.backup.on_epoch_end(epoch, logs)
        self.completed_epochs.append(epoch)
        print(f"tfdist: epoch {epoch} complete", flush=True)
        if self._should_stop():
            self.preempted = True
            self.model.stop_training = True

    def on_train_end(self, logs=None):
        self._uninstall()
        if not self.preempted:
            self.backup.on_train_end(logs)  # finished: the backup may delete its checkpoint
            return
        last = self.completed_epochs[-1] if self.completed_epochs else None
        print(f"tfdist: preempted; checkpoint kept (last complete epoch: {last})", flush=True)
        if self.is_chief and self.received in self.requeue_signals and self._requeue:
            if callable(self._requeue):
                self._requeue()
            elif self._env.get("SLURM_JOB_ID"):
                requeue_job(self._env)
            else:
                print("tfdist: not in a SLURM job; start the run again to resume", flush=True)
                return
            self.requeued = True


def collective_agreement(strategy) -> Callable[[bool], bool]:
    """All workers stop together if any of them got the signal: an all-reduce (sum) of the flags.

    Every worker must call the returned function at the same points (Preemption does: each epoch
    end, or each step with at="step"), as with any collective.

    Example:
        >>> agree = collective_agreement(strategy)
        >>> agree(rank == 0)     # True on every worker
    """
    import tensorflow as tf

    def agree(seen: bool) -> bool:
        flags = strategy.run(lambda: tf.constant(1.0 if seen else 0.0))
        return bool(strategy.reduce(tf.distribute.ReduceOp.SUM, flags, axis=None) > 0)

    return agree

