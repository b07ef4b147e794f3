"""Where processes come from: local launcher, TF_CONFIG, SLURM, horovodrun/mpirun."""

from __future__ import annotations

from tfdist.cluster.rank import is_chief, rank, world_size
from tfdist.cluster.slurm import RankInfo, SlurmCluster, in_slurm_step
from tfdist.lazy import exports

# Names loaded on first use (some import TensorFlow): `import tfdist.cluster` stays light.
_LAZY = {
    "launch": "tfdist.cluster.launcher",
    "list_devices": "tfdist.cluster.global_devices",
    "parse_tf_config": "tfdist.comm.tf_config",
    "requeue_job": "tfdist.cluster.requeue",
}

__all__ = ["RankInfo", "SlurmCluster", "in_slurm_step", "is_chief", "rank", "world_size", *_LAZY]

__getattr__, __dir__ = exports(__name__, _LAZY)
