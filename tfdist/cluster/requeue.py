"""Requeue this SLURM job: the same job id starts again (SLURM_RESTART_COUNT + 1) and resumes from its checkpoint."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping

from tfdist.errors import ConfigError

__all__ = ["requeue_job"]


def requeue_job(environ: Mapping[str, str] | None = None) -> None:
    """Runs `scontrol requeue $SLURM_JOB_ID` (the job must allow it: sbatch --requeue).

    Example:
        >>> tfdist.cluster.requeue_job()   # inside a SLURM job submitted with --requeue
    """
    env = os.environ if environ is None else environ
    job = env.get("SLURM_JOB_ID")
    if not job:
        raise ConfigError("requeue needs SLURM_JOB_ID: this process is not part of a SLURM job. "
                          "Call requeue_job only inside an sbatch job, or pass Preemption(requeue=False).")
    proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    if proc.returncode:
        raise ConfigError(f"scontrol requeue {job} failed: {proc.stderr.strip()} "
                          "(was the job submitted with --requeue, and does JobRequeue allow it?)")
    print(f"tfdist: requeued SLURM job {job}", flush=True)
