"""Keras callbacks and saving for training across processes: chief-aware backups, checkpoints, TensorBoard logs
and saves, preemption, throughput.

The layer between the strategies and what they build on: it uses `tfdist.cluster` (who is chief, the
SLURM requeue) and `tfdist.zero` (gathering ZeRO state before a save), never `tfdist.strategies`.

Example:
    >>> from tfdist.training import BackupAndRestore, save_model
    >>> model.fit(data.train, epochs=10, callbacks=[data.order, BackupAndRestore("/shared/run1/backup")])
    >>> save_model(model, "out/model.keras")   # on every process; the chief writes
"""

from __future__ import annotations

from tfdist.lazy import exports

# public name -> module that defines it; imported on first use (each module imports Keras).
_LAZY = {
    "BackupAndRestore": "tfdist.training.backup",
    "ModelCheckpoint": "tfdist.training.checkpoint",
    "save_model": "tfdist.training.saving",
    "Preemption": "tfdist.training.preemption",
    "collective_agreement": "tfdist.training.preemption",
    "Throughput": "tfdist.training.throughput",
    "TensorBoard": "tfdist.training.tensorboard",
}

__all__ = list(_LAZY)

__getattr__, __dir__ = exports(__name__, _LAZY)
