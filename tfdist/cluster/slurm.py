"""The cluster of a SLURM job step, read from the step environment: hosts, ranks, ports, devices.

Every task of an `srun` step computes the same description from its own environment, with no
network call and no `nvidia-smi` (TF's `SlurmClusterResolver` runs `nvidia-smi` and fails on CPU
nodes). Host lists such as `n[01-03,07],gpu[1-2]` are expanded with the `python-hostlist` package,
which implements SLURM's own grammar (several prefixes, ranges, zero padding) in pure Python: it
needs no SLURM client inside containers, costs no subprocess per task at start-up, and the tests on
a real SLURM check it against `scontrol show hostnames`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

import hostlist

from tfdist.comm.launch_env import expand_tasks_per_node
from tfdist.errors import ConfigError

__all__ = ["SlurmCluster", "RankInfo", "in_slurm_step", "expand_hosts", "expand_tasks_per_node", "step_ports"]

# The variables srun sets in every task of a step; all of them are needed.
STEP_VARIABLES = ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST",
                  "SLURM_STEP_TASKS_PER_NODE")
# Without SLURM_STEP_RESV_PORTS, ports come from this window, chosen by job and step id.
PORT_WINDOW = (20000, 30000)


@dataclass(frozen=True)
class RankInfo:
    """Horovod/MPI-style position of one task: global, within its node, and across nodes."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int  # index of this task's node
    cross_size: int  # number of nodes


@dataclass(frozen=True)
class SlurmCluster:
    """One SLURM job step as a cluster: every task is a worker at `host:port`.

    Build it with `SlurmCluster.from_environment()` inside an `srun` step. Tasks are laid out on nodes
    the way SLURM does it: `block` (default: node 0 gets ranks 0..k-1) or `cyclic`.

    With `num_ps` = K >= 1 the step is a parameter-server cluster instead (slurm/ps.sbatch): task 0 is
    the chief, tasks 1..K the parameter servers (job 'ps'), the remaining tasks the workers (worker i is
    task K + 1 + i); `from_environment(num_ps=K)` checks that at least one worker is left.

    Example:
        >>> env = {"SLURM_JOB_ID": "42", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "3",
        ...        "SLURM_STEP_NODELIST": "n[01-02]", "SLURM_STEP_TASKS_PER_NODE": "2,1"}
        >>> c = SlurmCluster.from_environment(env)
        >>> c.cluster_spec()["worker"][1] == f"n01:{c.ports[1]}"
        True
        >>> c.tf_config()["task"]
        {'type': 'worker', 'index': 1}
    """

    job_id: str
    step_id: str | None
    hosts: tuple[str, ...]  # the step's nodes, in SLURM order
    tasks_per_node: tuple[int, ...]
    task_nodes: tuple[int, ...]  # node index of every rank
    ports: tuple[int, ...]  # port of every rank
    rank: int
    local_devices: tuple[str, ...]  # TF device names this task should use
    cpus_per_task: int | None = None
    num_ps: int = 0  # parameter servers (tasks 1..num_ps); 0: every task is a worker

    def __post_init__(self) -> None:
        if self.num_ps:
            _check_ps_layout(self.num_ps, self.num_tasks)

    # --- construction ---------------------------------------------------------------------------
    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None, *,
                         num_ps: int | None = None) -> "SlurmCluster":
        """Reads the step environment (default: os.environ). Raises ConfigError on anything unusable.

        `num_ps` = K >= 1 makes it a parameter-server cluster (chief, K parameter servers, workers; see the
        class docstring); None (the default) an all-reduce cluster of workers.
        """
        env = os.environ if environ is None else environ
        if num_ps is not None and (isinstance(num_ps, bool) or not isinstance(num_ps, int) or num_ps < 1):
            raise ConfigError(f"the number of parameter servers (--ps, TFDIST_NUM_PS in slurm/ps.sbatch) must be "
                              f"a whole number >= 1, got {num_ps!r}.")
        missing = [name for name in STEP_VARIABLES if not env.get(name)]
        if missing:
            seen = sorted(k for k in env if k.startswith("SLURM_"))
            where = (f"SLURM variables present: {', '.join(seen[:12])}{' ...' if len(seen) > 12 else ''}. "
                     if seen else "No SLURM variables are set. ")
            raise ConfigError(
                f"SLURM step environment is incomplete: missing {', '.join(missing)}. {where}"
                "Start every worker with `srun` inside an sbatch/salloc allocation (a batch script "
                "alone is not a step), or set TF_CONFIG yourself.")
        num_tasks = _int(env, "SLURM_STEP_NUM_TASKS", minimum=1)
        rank = _int(env, "SLURM_PROCID", minimum=0)
        hosts = tuple(expand_hosts(env["SLURM_STEP_NODELIST"], "SLURM_STEP_NODELIST"))
        per_node = tuple(expand_tasks_per_node(env["SLURM_STEP_TASKS_PER_NODE"]))
        if len(per_node) != len(hosts):
            raise ConfigError(
                f"SLURM_STEP_TASKS_PER_NODE={env['SLURM_STEP_TASKS_PER_NODE']!r} gives {len(per_node)} node(s) "
                f"but SLURM_STEP_NODELIST={env['SLURM_STEP_NODELIST']!r} names {len(hosts)}: {list(hosts)}.")
        if sum(per_node) != num_tasks:
            raise ConfigError(
                f"SLURM_STEP_TASKS_PER_NODE={env['SLURM_STEP_TASKS_PER_NODE']!r} adds up to {sum(per_node)} "
                f"tasks but SLURM_STEP_NUM_TASKS={num_tasks}.")
        if rank >= num_tasks:
            raise ConfigError(f"SLURM_PROCID={rank} but the step has only {num_tasks} task(s) (0..{num_tasks - 1}).")
        task_nodes = _layout(per_node, env.get("SLURM_DISTRIBUTION", "block"))
        if "SLURM_NODEID" in env and _int(env, "SLURM_NODEID", minimum=0) != task_nodes[rank]:
            raise ConfigError(
                f"SLURM_NODEID={env['SLURM_NODEID']} but rank {rank} falls on node {task_nodes[rank]} under "
                f"SLURM_DISTRIBUTION={env.get('SLURM_DISTRIBUTION', 'block')!r}; tfdist supports block and "
                "cyclic node distributions.")
        local_ranks = _local_ranks(task_nodes)
        ports = step_ports(env, local_ranks, max(per_node))
        cpus = _int(env, "SLURM_CPUS_PER_TASK", minimum=1) if env.get("SLURM_CPUS_PER_TASK") else None
        return cls(job_id=env["SLURM_JOB_ID"], step_id=env.get("SLURM_STEP_ID"), hosts=hosts,
                   tasks_per_node=per_node, task_nodes=task_nodes, ports=ports, rank=rank,
                   local_devices=tuple(_local_devices(env)), cpus_per_task=cpus, num_ps=num_ps or 0)

    # --- views -------------------------------------------------------------------------------
    @property
    def num_tasks(self) -> int:
        return len(self.task_nodes)

    @property
    def num_workers(self) -> int:
        """Tasks that train: every task, or with parameter servers all but the chief and the servers."""
        return self.num_tasks - (1 + self.num_ps if self.num_ps else 0)

    @property
    def num_replicas(self) -> int:
        """Replicas across the step: training tasks x devices per task."""
        return self.num_workers * len(self.local_devices)

    @property
    def is_chief(self) -> bool:
        """Rank 0 writes checkpoints and requeues the job (in a parameter-server step: the chief task)."""
        return self.rank == 0

    @property
    def task(self) -> tuple[str, int]:
        """This task's TF job and index: ('worker', rank), or with parameter servers ('chief', 0),
        ('ps', rank - 1) or ('worker', rank - 1 - num_ps)."""
        if not self.num_ps:
            return "worker", self.rank
        if self.rank == 0:
            return "chief", 0
        if self.rank <= self.num_ps:
            return "ps", self.rank - 1
        return "worker", self.rank - 1 - self.num_ps

    def task_addresses(self) -> list[str]:
        """`host:port` of every rank, in rank order."""
        return [f"{self.hosts[node]}:{port}" for node, port in zip(self.task_nodes, self.ports)]

    def cluster_spec(self) -> dict[str, list[str]]:
        """The TF cluster spec: one job, 'worker', with a task per rank (worker 0 is the chief); with
        parameter servers, jobs 'chief' (rank 0), 'worker' (ranks num_ps+1..) and 'ps' (ranks 1..num_ps)."""
        addresses = self.task_addresses()
        if not self.num_ps:
            return {"worker": addresses}
        return {"chief": addresses[:1], "worker": addresses[1 + self.num_ps:], "ps": addresses[1:1 + self.num_ps]}

    def tf_config(self) -> dict:
        """The TF_CONFIG dict of this task: {'cluster': ..., 'task': {'type': 'worker', 'index': rank}}
        (with parameter servers the type and index of `task`)."""
        task_type, index = self.task
        return {"cluster": self.cluster_spec(), "task": {"type": task_type, "index": index}}

    def export_tf_config(self, environ: dict | None = None) -> str:
        """Writes TF_CONFIG into `environ` (default os.environ) and returns it."""
        value = json.dumps(self.tf_config())
        (os.environ if environ is None else environ)["TF_CONFIG"] = value
        return value

    def rank_info(self) -> RankInfo:
        """Horovod-style ranks of this task (what `hvd.rank()`, `hvd.local_rank()` ... would say)."""
        node = self.task_nodes[self.rank]
        return RankInfo(rank=self.rank, size=self.num_tasks, local_rank=_local_ranks(self.task_nodes)[self.rank],
                        local_size=self.tasks_per_node[node], cross_rank=node, cross_size=len(self.hosts))

    def require_replicas(self, replicas: int) -> None:
        """Raises ConfigError when the step cannot hold `replicas` replicas (too few tasks or devices)."""
        if replicas > self.num_replicas:
            extra = 1 + self.num_ps if self.num_ps else 0
            ps = f" (the chief and {self.num_ps} parameter server(s) train none)" if self.num_ps else ""
            raise ConfigError(
                f"replicas={replicas} but this SLURM step has {self.num_workers} training task(s) x "
                f"{len(self.local_devices)} device(s) = {self.num_replicas} replica(s){ps}. Ask for more tasks "
                f"(sbatch --ntasks={extra + -(-replicas // max(1, len(self.local_devices)))}) or fewer replicas.")

    def describe(self) -> dict:
        """A JSON-able summary (what each task of the tests reports)."""
        return {"rank": self.rank, "job_id": self.job_id, "step_id": self.step_id, "hosts": list(self.hosts),
                "tasks_per_node": list(self.tasks_per_node), "cluster": self.cluster_spec(),
                "task": dict(zip(("type", "index"), self.task)),
                "rank_info": self.rank_info().__dict__, "local_devices": list(self.local_devices)}


def in_slurm_step(environ: Mapping[str, str] | None = None) -> bool:
    """True inside an `srun` step (any step variable set); a batch script alone is not a step."""
    env = os.environ if environ is None else environ
    return any(env.get(name) for name in STEP_VARIABLES if name.startswith("SLURM_STEP_"))


def expand_hosts(value: str, variable: str = "host list") -> list[str]:
    """Expands a SLURM host list (`n[01-03,07],gpu[1-2]`) into names; ConfigError when malformed.

    Example:
        >>> expand_hosts("n[01-03,07]")
        ['n01', 'n02', 'n03', 'n07']
    """
    try:
        hosts = hostlist.expand_hostlist(value)
    except hostlist.BadHostlist as err:
        raise ConfigError(f"{variable}={value!r} is not a SLURM host list tfdist can read ({err}); "
                          "expected forms like 'n1', 'n[01-03,07]' or 'a[1-2],b[3-4]'.") from None
    if not hosts:
        raise ConfigError(f"{variable}={value!r} names no host.")
    if len(set(hosts)) != len(hosts):
        raise ConfigError(f"{variable}={value!r} names a host twice: {hosts}.")
    return hosts


def step_ports(environ: Mapping[str, str], local_ranks: tuple[int, ...], tasks_on_busiest_node: int) -> tuple[int, ...]:
    """One port per rank, the same on every task: `local_rank`-th port of the node's range.

    Ranges come from, in order: TFDIST_PORT_BASE (ports base..base+k-1 on every node), the step's
    reserved ports SLURM_STEP_RESV_PORTS (`srun --resv-ports`, with MpiParams=ports=... in
    slurm.conf; SLURM reserves the same ports on every node of the step), else a window of
    PORT_WINDOW picked from the job and step ids, so concurrent jobs rarely meet.
    """
    need = tasks_on_busiest_node
    if environ.get("TFDIST_PORT_BASE"):
        base = _int(environ, "TFDIST_PORT_BASE", minimum=1024)
        ports = list(range(base, base + need))
    elif environ.get("SLURM_STEP_RESV_PORTS"):
        ports = _port_ranges(environ["SLURM_STEP_RESV_PORTS"])
        if len(ports) < need:
            raise ConfigError(f"SLURM_STEP_RESV_PORTS={environ['SLURM_STEP_RESV_PORTS']!r} has {len(ports)} port(s) "
                              f"but a node runs {need} task(s); srun --resv-ports reserves one per task.")
    else:
        job = _int(environ, "SLURM_JOB_ID", minimum=0)
        step_text = environ.get("SLURM_STEP_ID", "0")
        step = int(step_text) if step_text.isdigit() else 0  # e.g. "batch" or "extern": no number
        lo, hi = PORT_WINDOW
        slots = (hi - lo) // 64
        base = lo + ((job * 31 + step) % slots) * 64
        if need > 64:
            raise ConfigError(f"{need} tasks on one node need more than 64 ports; set TFDIST_PORT_BASE or use "
                              "srun --resv-ports.")
        ports = list(range(base, base + need))
    if ports[-1] > 65535:
        raise ConfigError(f"port {ports[-1]} is above 65535; lower TFDIST_PORT_BASE.")
    return tuple(ports[local] for local in local_ranks)


# --- helpers -------------------------------------------------------------------------------------
def _check_ps_layout(num_ps: int, num_tasks: int) -> None:
    # A parameter-server cluster without a worker would start and then wait forever for one.
    if isinstance(num_ps, bool) or not isinstance(num_ps, int) or num_ps < 0:
        raise ConfigError(f"SlurmCluster: num_ps must be a whole number >= 0, got {num_ps!r}.")
    if num_tasks < num_ps + 2:
        raise ConfigError(
            f"a parameter-server step needs 1 chief + {num_ps} parameter server(s) (--ps / TFDIST_NUM_PS="
            f"{num_ps}) + at least 1 worker = {num_ps + 2} tasks, but this step has {num_tasks} "
            f"(SLURM_STEP_NUM_TASKS). Ask for more tasks (sbatch --ntasks={num_ps + 2} or more) or fewer "
            "parameter servers.")


def _int(env: Mapping[str, str], name: str, *, minimum: int) -> int:
    try:
        value = int(env[name])
    except (KeyError, ValueError):
        raise ConfigError(f"{name} must be a whole number, got {env.get(name)!r}.") from None
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}.")
    return value


def _port_ranges(value: str) -> list[int]:
    ports: list[int] = []
    try:
        for part in value.split(","):
            lo, _, hi = part.partition("-")
            ports.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ConfigError(f"SLURM_STEP_RESV_PORTS={value!r} is not a port list like '12000-12003,12010'.") from None
    return ports


def _layout(per_node: tuple[int, ...], distribution: str) -> tuple[int, ...]:
    # SLURM_DISTRIBUTION is "<nodes>[:<sockets>[:<cores>]][,Pack|NoPack]"; only the node level matters.
    kind = (distribution or "block").split(":")[0].split(",")[0].lower()
    if kind in ("block", "unknown", ""):
        return tuple(node for node, count in enumerate(per_node) for _ in range(count))
    if kind == "cyclic":
        left, order = list(per_node), []
        while any(left):
            for node, count in enumerate(left):
                if count:
                    order.append(node)
                    left[node] -= 1
        return tuple(order)
    raise ConfigError(f"SLURM_DISTRIBUTION={distribution!r}: tfdist places tasks for 'block' and 'cyclic' only; "
                      "use srun --distribution=block (the default) or cyclic.")


def _local_ranks(task_nodes: tuple[int, ...]) -> tuple[int, ...]:
    seen: dict[int, int] = {}
    out = []
    for node in task_nodes:
        out.append(seen.get(node, 0))
        seen[node] = out[-1] + 1
    return tuple(out)


def _local_devices(env: Mapping[str, str]) -> list[str]:
    # SLURM binds GPUs by setting CUDA_VISIBLE_DEVICES (gres/gpu) per task, so TF sees them as
    # /gpu:0..k-1. Nothing here asks the driver: CPU nodes get one CPU device per task.
    visible = env.get("CUDA_VISIBLE_DEVICES", env.get("SLURM_STEP_GPUS", env.get("GPU_DEVICE_ORDINAL", "")))
    gpus = [g for g in visible.split(",") if g.strip() and g.strip() not in ("NoDevFiles", "-1")]
    return [f"/gpu:{i}" for i in range(len(gpus))] if gpus else ["/cpu:0"]
