"""Which process am I: rank, world size and chief-ness from the strategy or the launcher's environment.

The one implementation: every "am I the chief?" in tfdist (callbacks, saving, preemption, the CLI)
calls `is_chief` here. Launcher variables come from the one table, `tfdist.comm.launch_env.LAUNCHERS`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from tfdist.comm.launch_env import LAUNCHERS

__all__ = ["rank", "world_size", "is_chief"]


def rank(strategy=None, environ: Mapping[str, str] | None = None) -> int:
    """This process's rank among the training processes (0 = chief).

    Order of evidence: a strategy with an int `rank` attribute (e.g. a Horovod strategy); a
    MultiWorkerMirroredStrategy's own task (chief job first, then workers, as TF numbers them);
    TF_CONFIG (same order; a parameter-server cluster's 'ps' tasks come last: chief 0, worker i is
    1 + i, ps j is 1 + workers + j, as `tfdist launch --ps` numbers TFDIST_RANK); then the launchers'
    rank variables, in the order of `tfdist.comm.launch_env.LAUNCHERS` (HOROVOD_RANK, OMPI_COMM_WORLD_RANK,
    PMIX_RANK, PMI_RANK, ..., SLURM_PROCID, TFDIST_RANK). 0 when nothing says otherwise.

    Example:
        >>> tfdist.cluster.rank()   # under `tfdist launch -n 2`: 0 in one process, 1 in the other
    """
    env = os.environ if environ is None else environ
    if strategy is not None:
        own = getattr(strategy, "rank", None)
        if isinstance(own, int):
            return own
        if _is_multi_worker(strategy):
            from tfdist._compat.distribute import strategy_task

            task_type, task_id, _ = strategy_task(strategy)
            if task_type is not None:
                spec = strategy.cluster_resolver.cluster_spec().as_dict()
                chiefs = len(spec.get("chief", []))
                return 0 if task_type == "chief" else chiefs + int(task_id)
    if env.get("TF_CONFIG", "").strip():
        from tfdist.comm.tf_config import PARAMETER_SERVER_JOBS, parse_tf_config

        return parse_tf_config(env["TF_CONFIG"], jobs=PARAMETER_SERVER_JOBS).rank
    found = _first_number(env, (launcher.rank_var for launcher in LAUNCHERS))
    return 0 if found is None else found


def world_size(strategy=None, environ: Mapping[str, str] | None = None) -> int:
    """Number of training processes (1 when nothing says otherwise).

    Same order of evidence as `rank`: a strategy's int `size`, a MultiWorkerMirroredStrategy's worker
    count, TF_CONFIG (its chief and workers; parameter servers do not train, so they are not counted),
    then the launchers' size variables (`tfdist.comm.launch_env.LAUNCHERS`).
    """
    env = os.environ if environ is None else environ
    if strategy is not None:
        own = getattr(strategy, "size", None)
        if isinstance(own, int):
            return own
        if _is_multi_worker(strategy):
            from tfdist._compat.distribute import strategy_task

            return strategy_task(strategy)[2]
    if env.get("TF_CONFIG", "").strip():
        from tfdist.comm.tf_config import PARAMETER_SERVER_JOBS, parse_tf_config

        return parse_tf_config(env["TF_CONFIG"], jobs=PARAMETER_SERVER_JOBS).num_workers
    found = _first_number(env, (launcher.size_var for launcher in LAUNCHERS if launcher.size_var))
    return 1 if found is None else found


def is_chief(strategy=None, environ: Mapping[str, str] | None = None) -> bool:
    """True in the one process that writes what users see: logs, plots, JSON, checkpoints, models.

    Works for any strategy: rank 0 by `tfdist.cluster.rank` (TF_CONFIG task, Horovod/MPI or SLURM
    rank 0). A single process is always the chief.

    Example:
        >>> if tfdist.cluster.is_chief(strategy):
        ...     model.save("model.keras")
    """
    return rank(strategy, environ) == 0


def _first_number(env: Mapping[str, str], names) -> int | None:
    """The value of the first of `names` that holds a whole number, or None."""
    for name in names:
        value = env.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


def _is_multi_worker(strategy) -> bool:
    import tensorflow as tf

    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
