"""Where processes come from: local launcher, TF_CONFIG, SLURM, horovodrun/mpirun."""

from __future__ import annotations

import importlib

from tfdist.cluster.rank import is_chief, rank, world_size
from tfdist.cluster.slurm import RankInfo, SlurmCluster, in_slurm_step

# Names loaded on first use (some import TensorFlow): `import tfdist.cluster` stays light.
_LAZY = {
    "launch": "tfdist.cluster.launcher",
    "list_devices": "tfdist.cluster.global_devices",
    "parse_tf_config": "tfdist.comm.tf_config",
    "requeue_job": "tfdist.cluster.requeue",
}

__all__ = ["RankInfo", "SlurmCluster", "in_slurm_step", "is_chief", "rank", "world_size", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tfdist.cluster' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
