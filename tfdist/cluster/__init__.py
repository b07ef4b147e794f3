"""Where processes come from: local launcher, TF_CONFIG, SLURM, horovodrun/mpirun."""

from tfdist.cluster.slurm import RankInfo, SlurmCluster, in_slurm_step

__all__ = ["Preemption", "RankInfo", "SlurmCluster", "in_slurm_step", "requeue_job"]


def __getattr__(name: str):
    # The preemption callback imports Keras; SLURM detection alone stays light.
    if name in ("Preemption", "requeue_job"):
        from tfdist.cluster import preemption

        return getattr(preemption, name)
    raise AttributeError(f"module 'tfdist.cluster' has no attribute {name!r}")
