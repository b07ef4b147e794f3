"""Which process am I: rank, world size and chief-ness from the strategy or the launcher's environment."""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["rank", "world_size", "is_chief"]

# Rank variables set by launchers other than TF_CONFIG, checked in this order.
_RANK_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")
_SIZE_VARS = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")


def rank(strategy=None, environ: Mapping[str, str] | None = None) -> int:
    """This process's rank among the training processes (0 = chief).

    Order of evidence: a multi-worker `strategy`'s own task (chief job first, then workers, as TF
    numbers them); a strategy with a `rank` attribute (e.g. a Horovod strategy); TF_CONFIG; then
    HOROVOD_RANK, OMPI_COMM_WORLD_RANK, PMIX_RANK, PMI_RANK, SLURM_PROCID. 0 when nothing says otherwise.

    Example:
        >>> tfdist.cluster.rank()   # under `tfdist launch -n 2`: 0 in one process, 1 in the other
    """
    env = os.environ if environ is None else environ
    if strategy is not None:
        own = getattr(strategy, "rank", None)
        if isinstance(own, int):
            return own
        if _is_multi_worker(strategy):
            from tfdist import compat

            task_type, task_id, _ = compat.strategy_task(strategy)
            if task_type is not None:
                spec = strategy.cluster_resolver.cluster_spec().as_dict()
                chiefs = len(spec.get("chief", []))
                return 0 if task_type == "chief" else chiefs + int(task_id)
    if env.get("TF_CONFIG", "").strip():
        from tfdist.cluster.tf_config import parse_tf_config

        return parse_tf_config(env["TF_CONFIG"]).rank
    for var in _RANK_VARS:
        if env.get(var, "").strip().isdigit():
            return int(env[var])
    return 0


def world_size(strategy=None, environ: Mapping[str, str] | None = None) -> int:
    """Number of training processes (1 when nothing says otherwise)."""
    env = os.environ if environ is None else environ
    if strategy is not None:
        own = getattr(strategy, "size", None)
        if isinstance(own, int):
            return own
        if _is_multi_worker(strategy):
            from tfdist import compat

            return compat.strategy_task(strategy)[2]
    if env.get("TF_CONFIG", "").strip():
        from tfdist.cluster.tf_config import parse_tf_config

        return parse_tf_config(env["TF_CONFIG"]).num_workers
    for var in _SIZE_VARS:
        if env.get(var, "").strip().isdigit():
            return int(env[var])
    return 1


def is_chief(strategy=None, environ: Mapping[str, str] | None = None) -> bool:
    """True in the one process that writes what users see: logs, plots, JSON, checkpoints, models.

    Works for any strategy: rank 0 by `tfdist.cluster.rank` (TF_CONFIG task, Horovod/MPI or SLURM
    rank 0). A single process is always the chief.

    Example:
        >>> if tfdist.cluster.is_chief(strategy):
        ...     model.save("model.keras")
    """
    return rank(strategy, environ) == 0


def _is_multi_worker(strategy) -> bool:
    import tensorflow as tf

    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
