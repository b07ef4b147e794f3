"""Where processes come from: local launcher, TF_CONFIG, SLURM, horovodrun/mpirun."""

from __future__ import annotations

import importlib

from tfdist.cluster.rank import is_chief, rank, world_size
from tfdist.cluster.slurm import RankInfo, SlurmCluster, in_slurm_step

# Names loaded on first use (some import TensorFlow): `import tfdist.cluster` stays light.
_LAZY = {
    "WorkerLostError": "tfdist.cluster.faults",
    "launch": "tfdist.cluster.launcher",
    "list_devices": "tfdist.cluster.global_devices",
    "parse_tf_config": "tfdist.cluster.tf_config",
    "requeue_job": "tfdist.cluster.requeue",
}

# Old public names of the Keras callbacks and saving, which now live one layer up, in the training package.
# Kept so that `tfdist.cluster.BackupAndRestore` etc. go on working (they are the same objects).
# This table is the only place where tfdist.cluster refers to a layer above it: add nothing else.
_MOVED_TO_TRAINING = {
    "BackupAndRestore": "tfdist.training.backup",
    "ModelCheckpoint": "tfdist.training.checkpoint",
    "save_model": "tfdist.training.saving",
    "Preemption": "tfdist.training.preemption",
}

__all__ = ["RankInfo", "SlurmCluster", "in_slurm_step", "is_chief", "rank", "world_size", *_LAZY,
           *_MOVED_TO_TRAINING]


def __getattr__(name: str):
    module = _LAZY.get(name) or _MOVED_TO_TRAINING.get(name)
    if module is None:
        raise AttributeError(f"module 'tfdist.cluster' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
