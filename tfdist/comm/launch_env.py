"""The one table of launcher environment variables: who started this process, its rank, size and local rank.

Pure Python (no TensorFlow): `tfdist launch` and `tfdist cluster` read it before any worker starts. It
lives in the bottom layer so `tfdist.comm.init()` can tell an MPI/Horovod launch from a TF_CONFIG one;
`tfdist.comm.launch_env` re-exports it for the launcher, the strategies and rank detection.

Example:
    >>> launcher_of({"OMPI_COMM_WORLD_RANK": "1", "SLURM_PROCID": "1"}).kind
    'mpirun'
    >>> srun_step_tasks({"SLURM_NTASKS": "4"})      # a batch script: not inside an srun step
    1
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import hostlist

from tfdist.devices import LocalProcess
from tfdist.errors import ConfigError

__all__ = ["LAUNCHERS", "LOCAL_DEVICES_ENV", "LOCAL_RANK_ENV", "LOCAL_SIZE_ENV", "OWN_DEVICES_ENV", "RANK_ENV",
           "ROLE_ENV", "Launcher", "expand_tasks_per_node", "launched_by", "launcher_of", "local_device_count",
           "local_process", "srun_step_tasks"]

# `tfdist launch` tells each worker how many local devices (replicas) to use with this variable.
LOCAL_DEVICES_ENV = "TFDIST_LOCAL_DEVICES"
# ... its rank (0 = the chief; in a --ps job: chief 0, workers 1..n, parameter servers n+1..n+K) ...
RANK_ENV = "TFDIST_RANK"
# ... and, in a --ps job only, its TF task type: 'chief', 'worker' or 'ps'.
ROLE_ENV = "TFDIST_ROLE"
# Its place among the job's processes on this machine ...
LOCAL_RANK_ENV, LOCAL_SIZE_ENV = "TFDIST_LOCAL_RANK", "TFDIST_LOCAL_SIZE"
# ... and "1" when the launcher narrowed CUDA_VISIBLE_DEVICES to this process's own GPUs.
OWN_DEVICES_ENV = "TFDIST_OWN_DEVICES"


@dataclass(frozen=True)
class Launcher:
    """What one kind of launcher sets in every process it starts."""

    kind: str                     # 'horovodrun', 'mpirun', 'srun', 'tfdist launch'
    rank_var: str
    size_var: str | None
    local_rank_var: str | None
    local_size_var: str | None
    mpi_world: bool               # its processes form a Horovod/MPI world (HorovodStrategy's launchers)
    description: str              # how a user would have started it


# In order of precedence: Horovod's own variables first (horovodrun also sets OpenMPI's under --mpi),
# then the MPI implementations, PMIx (srun --mpi=pmix), SLURM's task id, and `tfdist launch`.
LAUNCHERS: tuple[Launcher, ...] = (
    Launcher("horovodrun", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", True,
             "horovodrun --gloo / tfdist launch --backend horovod"),
    Launcher("mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
             "OMPI_COMM_WORLD_LOCAL_SIZE", True, "mpirun (OpenMPI) / horovodrun --mpi"),
    Launcher("srun", "PMIX_RANK", None, None, None, True, "srun --mpi=pmix"),
    Launcher("mpirun", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", True, "mpirun (MPICH) / srun"),
    Launcher("mpirun", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
             "MV2_COMM_WORLD_LOCAL_SIZE", True, "mpirun (MVAPICH)"),
    Launcher("srun", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None, False, "srun"),
    Launcher("tfdist launch", RANK_ENV, None, LOCAL_RANK_ENV, LOCAL_SIZE_ENV, False, "tfdist launch"),
)


def launcher_of(environ: Mapping[str, str] | None = None, *, mpi_world: bool | None = None) -> Launcher | None:
    """The first launcher (in LAUNCHERS order) whose rank variable this process has, or None.

    `mpi_world=True` only considers launchers whose processes form an MPI/Horovod world.
    """
    env = os.environ if environ is None else environ
    for launcher in LAUNCHERS:
        if mpi_world is not None and launcher.mpi_world != mpi_world:
            continue
        if env.get(launcher.rank_var, "").strip():
            return launcher
    return None


def launched_by(environ: Mapping[str, str] | None = None) -> str | None:
    """Names the Horovod/MPI launcher that started this process, or None for a plain `python script.py`.

    Example:
        >>> launched_by({"OMPI_COMM_WORLD_RANK": "1"})
        'mpirun (OpenMPI) / horovodrun --mpi'
    """
    found = launcher_of(environ, mpi_world=True)
    return found.description if found else None


def local_device_count(environ: Mapping[str, str] | None = None) -> int | None:
    """The device count `tfdist launch --devices-per-worker M` gave this process (TFDIST_LOCAL_DEVICES), or None."""
    env = os.environ if environ is None else environ
    raw = env.get(LOCAL_DEVICES_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"{LOCAL_DEVICES_ENV} must be a whole number >= 1, got {raw!r}.")
    return int(raw)


def srun_step_tasks(environ: Mapping[str, str] | None = None) -> int:
    """How many tasks the srun step running this process has (SLURM_STEP_NUM_TASKS); 1 outside a step.

    SLURM_NTASKS is not used: it is set in the whole allocation, also in a batch script that runs
    one `python script.py` outside any step.
    """
    env = os.environ if environ is None else environ
    raw = env.get("SLURM_STEP_NUM_TASKS", "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else 1


def local_process(environ: Mapping[str, str] | None = None) -> LocalProcess:
    """This process's place on its machine, from what its launcher set: the local rank and size of the first
    launcher that names them (`tfdist launch` first, since it starts its processes itself, then LAUNCHERS order),
    and whether its GPUs were already narrowed to its own.

    SLURM gives the tasks of the step on this node (SLURM_STEP_TASKS_PER_NODE, SLURM_NODEID) and binds GPUs per
    task under `--gpus-per-task`. A TF_CONFIG with no launcher behind it (a cluster manager's) is one process
    per machine. Malformed values are a ConfigError naming the variable.

    Example:
        >>> local_process({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        ...                "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
        LocalProcess(local_rank=1, local_size=2, own_devices=False)
    """
    env = os.environ if environ is None else environ
    own = env.get(OWN_DEVICES_ENV, "").strip() == "1" or _slurm_bound_gpus(env)
    innermost_first = sorted(LAUNCHERS, key=lambda launcher: launcher.kind != "tfdist launch")  # it starts its own
    for launcher in innermost_first:
        if launcher.local_rank_var is None or not env.get(launcher.local_rank_var, "").strip():
            continue
        rank = _whole(env, launcher.local_rank_var, minimum=0)
        size = _whole(env, launcher.local_size_var, minimum=1) if env.get(launcher.local_size_var or "") else None
        if size is None and launcher.kind == "srun":
            # a batch script's own python, outside any srun step, is the node's one process
            size = _slurm_tasks_on_this_node(env) if srun_step_tasks(env) > 1 else 1
        if size is not None and rank >= size:
            of = launcher.local_size_var or "the step's tasks on this node"
            raise ConfigError(f"{launcher.local_rank_var}={rank} is not below {of}={size}: the launcher's environment "
                              "is inconsistent.")
        return LocalProcess(rank, size, own)
    return LocalProcess(0, 1, own)


def _slurm_bound_gpus(env: Mapping[str, str]) -> bool:
    """SLURM bound this task's GPUs (--gpus-per-task G): it shows the task exactly G of them."""
    per_task = env.get("SLURM_GPUS_PER_TASK", "").strip()
    shown = [g for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return per_task.isdigit() and int(per_task) == len(shown) > 0


def _slurm_tasks_on_this_node(env: Mapping[str, str]) -> int | None:
    """The step's tasks on this node: SLURM_STEP_TASKS_PER_NODE ('2(x3),1') at SLURM_NODEID, where both are set."""
    raw, node = env.get("SLURM_STEP_TASKS_PER_NODE", "").strip(), env.get("SLURM_NODEID", "").strip()
    if not raw:
        return None
    counts = expand_tasks_per_node(raw)
    if len(set(counts)) == 1:
        return counts[0]
    return counts[int(node)] if node.isdigit() and int(node) < len(counts) else None


def expand_tasks_per_node(value: str) -> list[int]:
    """Expands SLURM_STEP_TASKS_PER_NODE (`2(x3),1` -> [2, 2, 2, 1]); ConfigError when malformed."""
    try:
        counts = hostlist.parse_slurm_tasks_per_node(value)
    except (hostlist.BadHostlist, ValueError, TypeError) as err:
        raise ConfigError(f"SLURM_STEP_TASKS_PER_NODE={value!r} is not of the form '2(x3),1' ({err}).") from None
    if not counts or any(c < 1 for c in counts):
        raise ConfigError(f"SLURM_STEP_TASKS_PER_NODE={value!r} must list at least one count >= 1.")
    return counts


def _whole(env: Mapping[str, str], name: str, *, minimum: int) -> int:
    raw = env.get(name, "").strip()
    if not raw.isdigit() or int(raw) < minimum:
        raise ConfigError(f"{name} must be a whole number >= {minimum}, got {raw!r}.")
    return int(raw)
