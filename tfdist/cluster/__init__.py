"""Where processes come from: local launcher, TF_CONFIG, SLURM, horovodrun/mpirun."""

from __future__ import annotations

import importlib

from tfdist.cluster.rank import is_chief, rank, world_size
from tfdist.cluster.slurm import RankInfo, SlurmCluster, in_slurm_step

# Names that import Keras/TensorFlow, loaded on first use: `import tfdist.cluster` stays light.
_LAZY = {
    "BackupAndRestore": "tfdist.cluster.chief",
    "ModelCheckpoint": "tfdist.cluster.chief",
    "EpochShuffle": "tfdist.cluster.chief",
    "save_model": "tfdist.cluster.chief",
    "WorkerLostError": "tfdist.cluster.faults",
    "launch": "tfdist.cluster.launcher",
    "parse_tf_config": "tfdist.cluster.tf_config",
    "Preemption": "tfdist.cluster.preemption",
    "requeue_job": "tfdist.cluster.preemption",
    "save_model": "tfdist.cluster.chief",
}

__all__ = ["RankInfo", "SlurmCluster", "in_slurm_step", "is_chief", "rank", "world_size", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'tfdist.cluster' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
