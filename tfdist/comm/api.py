"""`tfdist.comm`: collectives between the processes of a job (PyTorch c10d-style), on TF collectives or
Horovod. This module joins the job and names its processes; the collectives are in `collectives.py`
and `p2p.py`, all exported by `tfdist.comm`.

Every process of the job runs the same program and calls the same collectives in the same order::

    import tensorflow as tf
    import tfdist.comm as comm

    comm.init()                                   # first thing: reads tfdist launch / TF_CONFIG / horovodrun / mpirun
    x = tf.fill([3], float(comm.rank()))
    total = comm.all_reduce(x, "sum")             # [0+1, 0+1, 0+1] on 2 processes
    parts = comm.all_gather(tf.range(comm.rank() + 1))   # first dimensions may differ: [0, 0, 1]

Run it with `tfdist launch -n 2 -- python script.py` (TF backend), `tfdist launch -n 2 --backend horovod`,
`horovodrun -np 2` or `mpirun -np 2` (Horovod backend). In a plain `python script.py` it is a world of one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tfdist.comm.process_group import Group
from tfdist.comm.startup import choose_backend, start_backend
from tfdist.comm.state import STATE, backend_for
from tfdist.errors import ConfigError, check_seconds

__all__ = ["get_backend", "init", "is_initialized", "local_rank", "local_size", "new_group", "rank", "size"]


def init(backend: str = "auto", *, cluster: Mapping | str | object | None = None, timeout_s: float = 60.0,
         check: bool = True) -> None:
    """Joins this process to the job's collectives. Call it first thing, on every process.

    Args:
        backend: 'tf' (TF collective ops over gRPC; processes from TF_CONFIG, as `tfdist launch` sets it),
            'horovod' (Horovod over Gloo or MPI: horovodrun, mpirun, `srun --mpi=pmix`,
            `tfdist launch --backend horovod`), or 'auto': Horovod when a Horovod/MPI launcher started the
            process, else TF (a plain `python script.py` is a world of one process).
        cluster: for the TF backend, the cluster instead of TF_CONFIG: a TF_CONFIG dict or JSON text, or an
            object with `tf_config()` (under plain srun: `tfdist.cluster.SlurmCluster.from_environment()`).
        timeout_s: seconds any one collective (and start-up) may wait for the other processes before it
            fails with an error instead of hanging.
        check: before each collective, exchange every rank's dtype and shape (one small all-gather) so a
            mismatch is an error naming each rank's tensor; False saves that message for speed.

    A second call keeps the backend of the first (only `check` changes); asking for another backend
    is an error.

    Example:
        >>> import tfdist.comm as comm
        >>> comm.init()          # python script.py: rank 0 of 1
        >>> comm.rank(), comm.size(), comm.get_backend()
        (0, 1, 'tf')
    """
    check_seconds(timeout_s, "tfdist.comm.init: timeout_s")
    chosen = choose_backend(backend, cluster)
    if STATE.backend is not None and STATE.backend.name != chosen:
        raise ConfigError(f"tfdist.comm.init(backend={backend!r}): already initialised with the "
                          f"{STATE.backend.name!r} backend in this process; one backend per process.")
    if STATE.backend is None:
        STATE.backend = start_backend(chosen, cluster, timeout_s)
    STATE.check = bool(check)


def is_initialized() -> bool:
    """Whether `init` has run in this process."""
    return STATE.backend is not None


def get_backend() -> str:
    """'tf' or 'horovod'."""
    return backend_for("get_backend").name


def rank() -> int:
    """This process's rank in the job, 0..size()-1 (TF backend: the TF_CONFIG chief first, then workers)."""
    return backend_for("rank").rank


def size() -> int:
    """Number of processes in the job."""
    return backend_for("size").size


def local_rank() -> int:
    """This process's rank among the job's processes on its host."""
    return backend_for("local_rank").local_rank


def local_size() -> int:
    """Number of processes of the job on this host."""
    return backend_for("local_size").local_size


def new_group(ranks: Sequence[int]) -> Group:
    """A group of some processes (global ranks; order does not matter). Call it on every process, in the
    same order, members or not (as torch.distributed.new_group and Horovod process sets require).

    Example:
        >>> pair = tfdist.comm.new_group([0, 1])
        >>> if pair.rank is not None:
        ...     total = tfdist.comm.all_reduce(x, group=pair)
    """
    backend = backend_for("new_group")
    try:
        chosen = sorted({int(r) for r in ranks})
    except (TypeError, ValueError):
        raise ConfigError(f"tfdist.comm.new_group: ranks must be a list of ints, got {ranks!r}.") from None
    if not chosen or chosen[0] < 0 or chosen[-1] >= backend.size:
        raise ConfigError(f"tfdist.comm.new_group: ranks must be a non-empty list of ranks 0..{backend.size - 1}, "
                          f"got {ranks!r}.")
    if len(chosen) == backend.size:
        return backend.world
    return backend.new_group(chosen)
