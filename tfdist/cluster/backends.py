"""The launcher's backends: per-process environments for TF_CONFIG jobs, all-reduce or parameter-server ("tf"),
and Horovod/Gloo ranks ("horovod")."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator, Sequence

from tfdist.cluster.ports import free_ports
from tfdist.cluster.rendezvous import NodeInfo, address_towards, join, parse_master
from tfdist.comm.launch_env import LOCAL_DEVICES_ENV, RANK_ENV, ROLE_ENV
from tfdist.errors import ConfigError

__all__ = ["GlooBackend", "NodesTFConfigBackend", "TFConfigBackend", "make_tf_configs", "ps_job_tasks"]


def ps_job_tasks(n: int, ps: int) -> list[tuple[str, int]]:
    """The (task type, index) of every process of a parameter-server job, in launch order: the chief, workers
    0..n-1, then parameter servers 0..ps-1. A task's position in this list is its TFDIST_RANK, which is also
    the rank `tfdist.cluster.rank()` reads from its TF_CONFIG (chief 0, worker i -> 1 + i, ps j -> 1 + n + j)."""
    return [("chief", 0), *(("worker", i) for i in range(n)), *(("ps", j) for j in range(ps))]


def make_tf_configs(n: int, host: str = "localhost", *, ps: int = 0, hosts: Sequence[str] | None = None) -> list[str]:
    """TF_CONFIG texts for `n` workers on this machine, each on a free loopback port (or worker i at
    `hosts[i]`, e.g. the nodes of an emulated network).

    With `ps` = K >= 1, a parameter-server cluster instead: 1 chief + n workers + K parameter servers (jobs
    'chief', 'worker', 'ps'), one TF_CONFIG per task in the order of `ps_job_tasks(n, K)`.

    Example:
        >>> [json.loads(c)["task"] for c in make_tf_configs(1, ps=1)]
        [{'type': 'chief', 'index': 0}, {'type': 'worker', 'index': 0}, {'type': 'ps', 'index': 0}]
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"make_tf_configs: n (number of workers) must be a whole number >= 1, got {n!r}.")
    if isinstance(ps, bool) or not isinstance(ps, int) or ps < 0:
        raise ConfigError(f"make_tf_configs: ps (number of parameter servers) must be a whole number >= 0, "
                          f"got {ps!r}.")
    if hosts is not None and (ps or len(hosts) != n):
        raise ConfigError(f"make_tf_configs: hosts must give one address per worker ({n}) and needs ps=0, got "
                          f"{len(hosts)} hosts with ps={ps}.")
    if ps == 0:
        addresses = [f"{hosts[i] if hosts else host}:{port}" for i, port in enumerate(free_ports(n))]
        return [json.dumps({"cluster": {"worker": addresses}, "task": {"type": "worker", "index": i}})
                for i in range(n)]
    tasks = ps_job_tasks(n, ps)
    addresses = iter(f"{host}:{port}" for port in free_ports(len(tasks)))
    cluster: dict[str, list[str]] = {}
    for task_type, _ in tasks:
        cluster.setdefault(task_type, []).append(next(addresses))
    return [json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})
            for task_type, index in tasks]


class TFConfigBackend:
    """Launcher backend "tf": TF_CONFIG on free loopback ports, the rank and the local device count.

    Each process gets TF_CONFIG, TFDIST_RANK (its index) and TFDIST_LOCAL_DEVICES (the devices it uses).
    With `ps` = K >= 1 (a parameter-server job) there are 1 + n + K processes, in the order of
    `ps_job_tasks`: TFDIST_RANK is 0 for the chief, 1..n for the workers, n+1..n+K for the parameter
    servers, and TFDIST_ROLE says 'chief', 'worker' or 'ps'.

    Example:
        >>> with TFConfigBackend().environments(2, devices_per_worker=1) as envs:
        ...     envs[1]["TF_CONFIG"]  # '{"cluster": {"worker": ["localhost:41213", ...]}, "task": {..., "index": 1}}'
    """

    name = "tf"
    supports_ps = True  # the launcher asks before it starts a --ps job
    # TF's gRPC servers bind every interface: the launcher runs such jobs in a private network namespace.
    listens_on_all_interfaces = True
    # environments(..., hosts=[...]) puts worker i at hosts[i] (the launcher's emulated nodes).
    supports_hosts = True

    @contextlib.contextmanager
    def environments(self, n: int, devices_per_worker: int, ps: int = 0,
                     hosts: Sequence[str] | None = None) -> Iterator[list[dict[str, str]]]:
        if isinstance(devices_per_worker, bool) or not isinstance(devices_per_worker, int) or devices_per_worker < 1:
            raise ConfigError(f"TFConfigBackend: devices_per_worker must be a whole number >= 1, "
                              f"got {devices_per_worker!r}.")
        configs = make_tf_configs(n, ps=ps, hosts=hosts)
        if ps == 0:
            yield [{"TF_CONFIG": cfg, LOCAL_DEVICES_ENV: str(devices_per_worker), RANK_ENV: str(i)}
                   for i, cfg in enumerate(configs)]
            return
        yield [{"TF_CONFIG": cfg, LOCAL_DEVICES_ENV: str(devices_per_worker), RANK_ENV: str(rank),
                ROLE_ENV: task_type}
               for rank, (cfg, (task_type, _)) in enumerate(zip(configs, ps_job_tasks(n, ps)))]


class NodesTFConfigBackend:
    """Launcher backend "tf" for one node of several (`tfdist launch --nnodes N --node-rank R --master HOST:PORT`).

    Each start (and each restart) meets the other nodes' launchers at the rendezvous on `master`
    (tfdist.cluster.rendezvous), then gives its n workers one TF_CONFIG for the whole job: the workers of node 0
    first, then node 1's, ..., so worker i of node R is task R*n + i (TFDIST_RANK).
    """

    name = "tf"
    supports_ps = False
    listens_on_all_interfaces = True

    def __init__(self, master: str, node_rank: int, nnodes: int, timeout_s: float):
        self.master, self.node_rank, self.nnodes, self.timeout_s = master, node_rank, nnodes, timeout_s
        self.host = address_towards(parse_master(master)[0])
        self.round = 0

    @contextlib.contextmanager
    def environments(self, n: int, devices_per_worker: int) -> Iterator[list[dict[str, str]]]:
        me = NodeInfo(self.node_rank, self.nnodes, n, self.host, free_ports(n), self.round)
        self.round += 1
        nodes = join(self.master, me, self.timeout_s)
        workers = [f"{node.host}:{port}" for node in nodes for port in node.ports]
        first = self.node_rank * n
        configs = [json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": first + i}})
                   for i in range(n)]
        yield [{"TF_CONFIG": config, LOCAL_DEVICES_ENV: str(devices_per_worker), RANK_ENV: str(first + i)}
               for i, config in enumerate(configs)]


class GlooBackend:
    """Launcher backend "horovod": starts Horovod's rendezvous server and gives each rank its environment.

    What `horovodrun --gloo -np N` does for one host, as a context manager the launcher keeps open
    for the job's lifetime: an HTTP rendezvous server on loopback (a free port chosen by the kernel)
    that the ranks' Gloo contexts meet at, and per rank HOROVOD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE/
    CROSS_RANK/CROSS_SIZE, HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT, HOROVOD_CONTROLLER=gloo,
    HOROVOD_CPU_OPERATIONS=gloo, HOROVOD_GLOO_IFACE, HOROVOD_HOSTNAME and TFDIST_LOCAL_DEVICES=M
    (HorovodStrategy then makes M local replicas per process).

    Args:
        host: the address the server binds and the ranks connect to (default loopback).
        iface: network interface Gloo binds its pairs to ('lo' on one host).

    Example:
        >>> import subprocess, sys, os
        >>> backend = GlooBackend()
        >>> with backend.environments(2, devices_per_worker=1) as envs:
        ...     procs = [subprocess.Popen([sys.executable, "train.py"], env={**os.environ, **e}) for e in envs]
        ...     codes = [p.wait() for p in procs]
    """

    name = "horovod"

    def __init__(self, host: str = "127.0.0.1", iface: str = "lo", verbose: int = 0):
        self.host, self.iface, self.verbose = host, iface, verbose

    @contextlib.contextmanager
    def environments(self, n: int, devices_per_worker: int) -> Iterator[list[dict[str, str]]]:
        for name, value in (("n", n), ("devices_per_worker", devices_per_worker)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{type(self).__name__}: {name} must be a whole number >= 1, got {value!r}.")
        try:
            from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
            from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer
        except ImportError as err:
            from tfdist.comm.horovod import INSTALL_HINT

            raise ImportError(f"{INSTALL_HINT} (import failed: {err})") from err

        plan = get_host_assignments(parse_hosts(self._hosts(n)), n)
        # Port 0: the kernel picks a free port (horovodrun's own find_port tries random ones).
        server = RendezvousHTTPServer((self.host, 0), RendezvousHandler, self.verbose)
        server.init(plan)
        port = server.server_address[1]
        thread = threading.Thread(target=server.serve_forever, name="horovod-rendezvous", daemon=True)
        thread.start()
        try:
            yield [self._slot_env(slot, port, devices_per_worker) for slot in plan]
        finally:
            server.shutdown()
            server.server_close()
            thread.join(timeout=10)

    def _hosts(self, n: int) -> str:
        """horovodrun's -H list: all ranks on this host."""
        return f"localhost:{n}"

    def _slot_env(self, slot, port: int, devices_per_worker: int) -> dict[str, str]:
        return self._rank_env(slot, port, "localhost", devices_per_worker)

    def _rank_env(self, slot, port: int, hostname: str, devices_per_worker: int) -> dict[str, str]:
        return {
            "HOROVOD_HOSTNAME": hostname,
            "HOROVOD_RANK": str(slot.rank),
            "HOROVOD_SIZE": str(slot.size),
            "HOROVOD_LOCAL_RANK": str(slot.local_rank),
            "HOROVOD_LOCAL_SIZE": str(slot.local_size),
            "HOROVOD_CROSS_RANK": str(slot.cross_rank),
            "HOROVOD_CROSS_SIZE": str(slot.cross_size),
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": self.host,
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
            "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_GLOO_IFACE": self.iface,
            LOCAL_DEVICES_ENV: str(devices_per_worker),
        }
