"""TF_CONFIG: parse and check it with clear errors. The one parser: `tfdist.comm.init()` reads its process's
rank and the workers' addresses with it; `tfdist.comm.tf_config` re-exports it for the launcher (whose
"tf" backend writes TF_CONFIG: cluster/backends.py), rank detection and the strategies. Pure Python."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

from tfdist.errors import ConfigError

__all__ = ["ClusterConfig", "MULTI_WORKER_JOBS", "PARAMETER_SERVER_JOBS", "parse_tf_config", "tf_config_from_env"]

# Jobs MultiWorkerMirroredStrategy can run. 'ps' belongs to ParameterServerStrategy; 'evaluator' runs
# outside the collective group (side-car evaluation), which this strategy does not support.
MULTI_WORKER_JOBS = ("chief", "worker")
# Jobs of a parameter-server cluster (`tfdist launch --ps K`, slurm/ps.sbatch), in rank order.
PARAMETER_SERVER_JOBS = ("chief", "worker", "ps")


@dataclass(frozen=True)
class ClusterConfig:
    """A checked TF_CONFIG: the cluster (job -> addresses) and this process's task.

    `rank` numbers tasks chief first, then workers, which is also the order of TF's collective group;
    parameter servers (if the config was parsed with jobs=PARAMETER_SERVER_JOBS) come after the workers.
    """

    cluster: dict[str, list[str]]
    task_type: str
    task_index: int

    @property
    def num_workers(self) -> int:
        return sum(len(self.cluster.get(job, [])) for job in MULTI_WORKER_JOBS)

    @property
    def rank(self) -> int:
        if self.task_type == "chief":
            return 0
        before = ("chief",) if self.task_type == "worker" else ("chief", "worker")
        return sum(len(self.cluster.get(job, [])) for job in before) + self.task_index

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    @property
    def task_name(self) -> str:
        """E.g. '/job:worker/replica:0/task:1', the way TensorFlow's errors name a task."""
        return f"/job:{self.task_type}/replica:0/task:{self.task_index}"

    def address(self, task_type: str | None = None, task_index: int | None = None) -> str:
        task_type = self.task_type if task_type is None else task_type
        task_index = self.task_index if task_index is None else task_index
        return self.cluster[task_type][task_index]

    def peers(self) -> list[tuple[str, int, str]]:
        """Every other task as (task_type, index, address)."""
        return [(job, i, addr) for job in PARAMETER_SERVER_JOBS
                for i, addr in enumerate(self.cluster.get(job, [])) if (job, i) != (self.task_type, self.task_index)]

    def to_json(self) -> str:
        return json.dumps({"cluster": self.cluster, "task": {"type": self.task_type, "index": self.task_index}})


def parse_tf_config(value: str | Mapping, *, jobs: tuple[str, ...] = MULTI_WORKER_JOBS) -> ClusterConfig:
    """Checks a TF_CONFIG (JSON text or a dict) and returns it as a ClusterConfig.

    Raises ConfigError for text that is not JSON, a missing 'cluster' or 'task', a job not in `jobs`
    (default: MultiWorkerMirroredStrategy's; PARAMETER_SERVER_JOBS also accepts 'ps'), an index out of
    range, a malformed or duplicate address.

    Example:
        >>> cfg = parse_tf_config('{"cluster": {"worker": ["localhost:2222", "localhost:2223"]},'
        ...                       ' "task": {"type": "worker", "index": 1}}')
        >>> cfg.num_workers, cfg.rank, cfg.is_chief
        (2, 1, False)
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ConfigError(f"TF_CONFIG is not valid JSON ({err.msg} at character {err.pos}): {value[:200]!r}. "
                              'Expected e.g. {"cluster": {"worker": ["host1:2222", "host2:2222"]}, '
                              '"task": {"type": "worker", "index": 0}}.') from None
    if not isinstance(value, Mapping):
        raise ConfigError(f"TF_CONFIG must be a JSON object with 'cluster' and 'task', got {type(value).__name__}.")
    cluster, task = value.get("cluster"), value.get("task")
    if not isinstance(cluster, Mapping) or not cluster:
        raise ConfigError(f"TF_CONFIG has no 'cluster' (job name -> list of 'host:port'), got {cluster!r}.")
    if not isinstance(task, Mapping) or "type" not in task or "index" not in task:
        raise ConfigError(f"TF_CONFIG has no 'task' with 'type' and 'index' (which task this process is), "
                          f"got {task!r}. Example: \"task\": {{\"type\": \"worker\", \"index\": 0}}.")
    found: dict[str, list[str]] = {}
    seen: dict[str, str] = {}
    for job, addresses in cluster.items():
        if job not in jobs:
            who = "MultiWorkerMirroredStrategy runs only" if tuple(jobs) == MULTI_WORKER_JOBS else "expected only"
            raise ConfigError(f"TF_CONFIG cluster has job {job!r}; {who} {list(jobs)} tasks (drop {job!r}, or "
                              "use another strategy for it).")
        if isinstance(addresses, str) or not isinstance(addresses, list) or not addresses:
            raise ConfigError(f"TF_CONFIG cluster[{job!r}] must be a non-empty list of 'host:port', got {addresses!r}.")
        for i, addr in enumerate(addresses):
            _check_address(addr, f"cluster[{job!r}][{i}]")
            if addr in seen:
                raise ConfigError(f"TF_CONFIG lists address {addr!r} twice ({seen[addr]} and {job}[{i}]); "
                                  "every task needs its own host:port.")
            seen[addr] = f"{job}[{i}]"
        found[job] = list(addresses)
    if len(found.get("chief", [])) > 1:
        raise ConfigError(f"TF_CONFIG has {len(found['chief'])} chief tasks; there can be at most one.")
    task_type, index = task["type"], task["index"]
    if task_type not in found:
        raise ConfigError(f"TF_CONFIG task type {task_type!r} is not a job of the cluster {sorted(found)}.")
    if isinstance(index, bool) or not isinstance(index, int):
        raise ConfigError(f"TF_CONFIG task index must be an integer, got {index!r}.")
    if not 0 <= index < len(found[task_type]):
        raise ConfigError(f"TF_CONFIG task index {index} is out of range: job {task_type!r} has "
                          f"{len(found[task_type])} task(s), so the index must be 0..{len(found[task_type]) - 1}.")
    return ClusterConfig(found, task_type, index)


def _check_address(addr: object, where: str) -> None:
    if not isinstance(addr, str) or ":" not in addr:
        raise ConfigError(f"TF_CONFIG {where} must be 'host:port', got {addr!r}.")
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"TF_CONFIG {where} must be 'host:port' with a port 1..65535, got {addr!r}.")


def tf_config_from_env(environ: Mapping[str, str] | None = None) -> ClusterConfig | None:
    """The checked TF_CONFIG of this process, or None when TF_CONFIG is unset or empty."""
    text = (os.environ if environ is None else environ).get("TF_CONFIG", "").strip()
    return parse_tf_config(text) if text else None

