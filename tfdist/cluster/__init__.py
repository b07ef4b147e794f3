"""Where processes come from: local launcher, TF_CONFIG, SLURM, horovodrun/mpirun."""

from tfdist.cluster.rank import is_chief, rank, world_size

__all__ = ["is_chief", "rank", "world_size"]
