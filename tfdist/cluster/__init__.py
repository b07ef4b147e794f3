"""Where processes come from: local launcher, TF_CONFIG, SLURM, horovodrun/mpirun."""
