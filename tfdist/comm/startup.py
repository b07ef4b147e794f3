"""Which backend `tfdist.comm.init()` starts, read from how the processes were started.

- a Horovod/MPI launcher (horovodrun, mpirun, `srun --mpi=pmix`, `tfdist launch --backend horovod`:
  the launcher table, `launch_env.LAUNCHERS`) -> Horovod;
- TF_CONFIG (`tfdist launch`, or set by hand) or `cluster=` -> TF collectives over that cluster;
- nothing -> TF, a world of one process.

Example:
    >>> choose_backend("auto", None, {"OMPI_COMM_WORLD_RANK": "1"})
    'horovod'
    >>> choose_backend("auto", None, {})
    'tf'
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from tfdist.comm.launch_env import launcher_of, srun_step_tasks
from tfdist.comm.process_group import Backend
from tfdist.comm.state import LAUNCH
from tfdist.comm.tf_config import ClusterConfig, parse_tf_config
from tfdist.errors import ConfigError

__all__ = ["BACKENDS", "choose_backend", "cluster_config", "start_backend"]

BACKENDS = ("auto", "tf", "horovod")


def choose_backend(backend: str, cluster: object, environ: Mapping[str, str] | None = None) -> str:
    """'tf' or 'horovod' for init(backend=..., cluster=...) in this environment; ConfigError when the
    environment cannot serve the choice."""
    if backend not in BACKENDS:
        raise ConfigError(f"tfdist.comm.init: backend must be 'auto', 'tf' or 'horovod', got {backend!r}.")
    env = os.environ if environ is None else environ
    mpi = launcher_of(env, mpi_world=True)
    if backend == "horovod" or (backend == "auto" and mpi is not None and cluster is None):
        return "horovod"
    if cluster is None and not env.get("TF_CONFIG", "").strip():
        if mpi is not None and backend == "tf":
            raise ConfigError(f"tfdist.comm.init(backend='tf'): this process was started by {mpi.description} "
                              f"({mpi.rank_var} is set) but has no TF_CONFIG. Use backend='horovod' (or 'auto'), or "
                              f"start the processes with {LAUNCH}.")
        if srun_step_tasks(env) > 1:
            raise ConfigError("tfdist.comm.init: inside an srun step of several tasks without TF_CONFIG. Pass the "
                              "step's cluster: tfdist.comm.init(cluster=tfdist.cluster.SlurmCluster."
                              "from_environment()), or run `srun --mpi=pmix` with backend='horovod'.")
    return "tf"


def cluster_config(cluster: object, environ: Mapping[str, str] | None = None) -> ClusterConfig | None:
    """The TF backend's cluster: `cluster` (a TF_CONFIG dict or JSON text, or an object with
    `tf_config()` such as tfdist.cluster.SlurmCluster), else TF_CONFIG; None for a world of one."""
    if cluster is None:
        text = (os.environ if environ is None else environ).get("TF_CONFIG", "").strip()
        if not text:
            return None
        cluster, where = text, "the TF_CONFIG environment variable"
    else:
        where = "cluster="
    tf_config = getattr(cluster, "tf_config", None)
    try:
        return parse_tf_config(tf_config() if callable(tf_config) else cluster)
    except ConfigError as err:
        raise ConfigError(f"tfdist.comm.init: {where} is not a cluster the TF backend can use: {err}") from None


def start_backend(name: str, cluster: object, timeout_s: float) -> Backend:
    """Starts the 'tf' or 'horovod' backend (imported only when chosen)."""
    if name == "horovod":
        from tfdist.comm.horovod_backend import HorovodBackend

        return HorovodBackend(timeout_s)
    from tfdist.comm.tf_backend import TFBackend

    return TFBackend(cluster_config(cluster), timeout_s)
