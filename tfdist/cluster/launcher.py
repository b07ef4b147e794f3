"""Local launcher: N worker processes with per-rank environments, rank-prefixed output, fail-fast exit or
whole-job restarts (--max-restarts, tfdist.cluster.elastic); with --ps K, a parameter-server job (chief,
workers, parameter servers) supervised by ps_supervisor."""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Protocol, TextIO

from tfdist.cluster.backends import NodesTFConfigBackend, ps_job_tasks
from tfdist.cluster.elastic import run_with_restarts
from tfdist.cluster.emulated_network import EmulatedNetwork, parse_rate
from tfdist.cluster.local_gpus import per_process_env, visible_gpus
from tfdist.cluster.private_net import private_network
from tfdist.cluster.processes import start_process, stop_processes
from tfdist.cluster.ps_supervisor import supervise_ps, task_label
from tfdist.cluster.rendezvous import is_loopback, job_deadline, parse_master, watch_rounds
from tfdist.cluster.rendezvous_server import RendezvousServer
from tfdist.errors import ConfigError

__all__ = ["BACKENDS", "DEFAULT_MAX_RESTARTS", "LaunchBackend", "launch", "load_backend"]


class LaunchBackend(Protocol):
    """Where a job's per-process environment comes from (TF_CONFIG, a Gloo rendezvous, ...).

    `environments(n, devices_per_worker)` is a context manager yielding one dict of extra environment
    variables per process; it stays open while those processes run (one round of an all-reduce job: a
    restart opens a fresh one; the whole of a parameter-server job), so a backend can run a server. A backend
    that can make parameter-server jobs has `supports_ps = True` and takes `ps=K` there too.
    """

    def environments(self, n: int, devices_per_worker: int) -> AbstractContextManager[list[dict[str, str]]]: ...


# backend name -> "module:attribute" of a zero-argument factory; imported only when chosen.
BACKENDS: dict[str, str] = {
    "tf": "tfdist.cluster.backends:TFConfigBackend",
    "horovod": "tfdist.cluster.backends:GlooBackend",
}

# backend name -> "module:attribute" of a factory(network) of that backend on emulated nodes (--link-rate), for
# backends whose ranks need more than an address per node (Horovod/Gloo: the rendezvous and each node's interface).
ON_NODES: dict[str, str] = {"horovod": "tfdist.cluster.gloo_nodes:GlooNodesBackend"}

# --network: "private" (a network namespace with loopback only, for backends whose servers listen on
# every interface) or "host".
NETWORKS = ("private", "host")

# Restarts per worker of a --ps job, unless --max-restarts says otherwise.
DEFAULT_MAX_RESTARTS = 3


def load_backend(name: str) -> LaunchBackend:
    """Imports and builds the launcher backend called `name` (see BACKENDS)."""
    if name not in BACKENDS:
        raise ConfigError(f"--backend must be one of {sorted(BACKENDS)}, got {name!r}.")
    module_name, _, attr = BACKENDS[name].partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"launcher backend {name!r} is not available: {BACKENDS[name]} could not be loaded "
                          f"({type(err).__name__}: {err}). Install its extra or use --backend tf.") from None
    return factory()


def launch(
    command: Sequence[str],
    n: int,
    *,
    ps: int | None = None,
    max_restarts: int | None = None,
    devices_per_worker: int = 1,
    backend: str | LaunchBackend = "tf",
    env: Mapping[str, str] | None = None,
    out: TextIO | None = None,
    on_start: Callable[[list[subprocess.Popen]], None] | None = None,
    timeout_s: float | None = None,
    network: str = "private",
    link_rate: str | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    master: str | None = None,
    rdzv_timeout_s: float = 300.0,
) -> int:
    """Runs `command` as `n` local processes and returns the first non-zero exit code (0 if all succeed).

    Each process gets the environment of `backend` for its rank; every line it prints (stdout and
    stderr) is written to `out` prefixed with "[rank] ". When a process fails (non-zero exit or a
    signal, reported as 128 + signal number) the others are stopped (SIGTERM, then SIGKILL after
    processes.STOP_GRACE_S) and the launcher says which rank died and how, and which ranks it found
    stopped (SIGSTOP: alive but silent). `on_start` receives the processes (e.g. to send signals in tests);
    `timeout_s` stops the whole job and returns 124.

    With `max_restarts` = R >= 1 (default 0), a failure does not end the job: after stopping the others the
    launcher starts all `n` workers again, at most R times (tfdist.cluster.elastic: a fresh TF_CONFIG or
    Gloo rendezvous per round, TFDIST_RESTART_COUNT = the round); the program resumes from its own
    checkpoint (tfdist.training.BackupAndRestore). `on_start` is called again with each round's processes.

    With `ps` = K >= 1 (backend "tf" only) it runs a parameter-server job instead: 1 chief + n workers +
    K parameter servers, each with TF_CONFIG (jobs 'chief', 'worker', 'ps'), TFDIST_ROLE and TFDIST_RANK
    (chief 0, workers 1..n, parameter servers n+1..n+K); lines are prefixed "[chief] ", "[worker i] ",
    "[ps j] ". Its rules (tfdist.cluster.ps_supervisor): the job returns the chief's exit code, and the
    chief's exit, whatever its code, stops the workers and servers (which never end by themselves); a
    failed worker is restarted with the same environment (so it rejoins) up to `max_restarts` times
    (default DEFAULT_MAX_RESTARTS) and the job goes on; a parameter server that ends is reported, not
    restarted. The list `on_start` receives is kept current: a restarted worker replaces its entry.

    With `link_rate` (e.g. "1gbit"; backend "tf" or "horovod", no `ps`), every worker runs on a node of its
    own: a network namespace whose link to the others is shaped at that rate (tfdist.cluster.emulated_network;
    root only); its TF_CONFIG address is the node's ("tf"), or its Gloo pairs bind the node's interface and
    meet at a rendezvous on the network's gateway ("horovod", tfdist.cluster.gloo_nodes).

    With `nnodes` = N > 1 this is node `node_rank` of a job over N machines (torchrun's shape; backend "tf"):
    node 0's launcher serves a rendezvous at `master` ("HOST:PORT", an address of node 0), every node's launcher
    meets there at each start and restart (`rdzv_timeout_s` bounds the wait, and so does the end of `timeout_s`), and
    the `n` workers of node R are tasks R*n .. R*n+n-1 of one TF_CONFIG. The workers listen on the host's network,
    reachable from the other nodes. When another node starts a new round (it restarted, or its launcher was
    restarted) this node's workers are stopped, so that every node restarts together.

    Example:
        >>> launch(["python", "train.py"], 2)       # same as: tfdist launch -n 2 -- python train.py
        0
        >>> launch(["python", "train.py"], 2, max_restarts=3)  # tfdist launch -n 2 --max-restarts 3 -- ...
        0
        >>> launch(["python", "train.py"], 2, ps=1) # same as: tfdist launch -n 2 --ps 1 -- python train.py
        0
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"-n (number of workers) must be a whole number >= 1, got {n!r}.")
    _check_ps_options(ps, max_restarts)
    if not command:
        raise ConfigError("no command to launch; usage: tfdist launch -n 2 -- python train.py")
    _check_program(command[0])
    if network not in NETWORKS:
        raise ConfigError(f"--network must be one of {list(NETWORKS)}, got {network!r}.")
    say = _line_writer(out or sys.stdout)
    rendezvous: AbstractContextManager = contextlib.nullcontext()
    together: _Together | None = None
    if (nnodes, node_rank, master) != (1, 0, None):
        backend, rendezvous = _nodes(backend, nnodes, node_rank, master, ps, link_rate, rdzv_timeout_s, say)
        together = _Together(master, node_rank, say)
        network = "host"  # the other nodes reach the workers on this machine's own addresses
    backend = load_backend(backend) if isinstance(backend, str) else backend
    if ps is not None:
        _check_supports_ps(backend)
    if link_rate is not None:
        _check_link_rate(backend, ps, link_rate)
    # Each worker's local rank and, on a GPU machine, its own GPUs (a parameter-server job keeps TF's placement).
    gpus = visible_gpus({**os.environ, **(env or {})}) if ps is None else []
    local = per_process_env(n, devices_per_worker, gpus)  # too few GPUs: refused before anything starts
    readers: list[threading.Thread] = []
    with rendezvous, _network(backend, network, say, link_rate, n) as (prefix, nodes):

        def start(label: str, extra_env: Mapping[str, str], rank: int | None = None) -> subprocess.Popen:
            full_env = {**os.environ, **(env or {}), **extra_env, "PYTHONUNBUFFERED": "1"}
            argv = nodes.command(rank, command) if nodes is not None else [*prefix, *command]
            proc, reader = start_process(argv, full_env, f"[{label}] ", say)
            readers.append(reader)
            if together is not None:
                together.started(proc)
            return proc

        def environments():
            if nodes is None:
                envs = _merged(backend.environments(n, devices_per_worker), local)
                return envs if together is None else together.round(envs)
            if _name(backend) in ON_NODES and not getattr(backend, "supports_hosts", False):
                return _merged(_on_nodes(_name(backend), nodes).environments(n, devices_per_worker), local)
            return _merged(backend.environments(n, devices_per_worker, hosts=[nodes.address(i) for i in range(n)]),
                           local)

        try:
            if ps is None:
                with job_deadline(timeout_s):  # a rendezvous wait ends with the job
                    return run_with_restarts(environments, lambda rank, extra: start(str(rank), extra, rank), say,
                                             max_restarts=max_restarts or 0, timeout_s=timeout_s, on_start=on_start)
            return _launch_ps(backend, n, ps, devices_per_worker, start, say,
                              max_restarts=DEFAULT_MAX_RESTARTS if max_restarts is None else max_restarts,
                              timeout_s=timeout_s, on_start=on_start)
        finally:
            for t in readers:
                t.join(timeout=5)


def _nodes(backend: str | LaunchBackend, nnodes: int, node_rank: int, master: str | None, ps: int | None,
           link_rate: str | None, rdzv_timeout_s: float,
           say: Callable[[str], None]) -> tuple[LaunchBackend, AbstractContextManager]:
    """The backend of one node of a multi-node job, and node 0's rendezvous; every option checked first."""
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 1:
        raise ConfigError(f"--nnodes must be a whole number >= 1, got {nnodes!r}.")
    if isinstance(node_rank, bool) or not isinstance(node_rank, int) or not 0 <= node_rank < nnodes:
        raise ConfigError(f"--node-rank must be in 0..{nnodes - 1} for --nnodes {nnodes}, got {node_rank!r}.")
    if master is None:
        raise ConfigError("--nnodes > 1 needs --master HOST:PORT: an address of node 0 and a free port, the same "
                          "on every node (e.g. --master 10.0.0.1:29400).")
    host, port = parse_master(master)
    if (backend if isinstance(backend, str) else _name(backend)) != "tf":
        raise ConfigError("--nnodes runs --backend tf; for Horovod across machines start the ranks with "
                          "`horovodrun -H host1:4,host2:4` or `mpirun`.")
    if ps is not None or link_rate is not None:
        raise ConfigError("--nnodes cannot be combined with --ps or --link-rate.")
    if not isinstance(rdzv_timeout_s, int | float) or rdzv_timeout_s <= 0:
        raise ConfigError(f"--rdzv-timeout must be > 0 seconds, got {rdzv_timeout_s!r}.")
    node = NodesTFConfigBackend(master, node_rank, nnodes, rdzv_timeout_s)
    if nnodes > 1 and is_loopback(node.host):  # right for nodes on one machine; a node elsewhere never comes
        say(f"[launch] --master {master} is reached over loopback ({node.host}): only launchers on this machine can "
            "join. For nodes on other machines, give every node an address of node 0 that they all reach.")
    server = (RendezvousServer(host, port, nnodes=nnodes, timeout_s=rdzv_timeout_s, say=say) if node_rank == 0
              else contextlib.nullcontext())
    return node, server


class _Together:
    """One node of several: its workers of the current round, stopped when another node opens a newer round of the
    rendezvous (it restarted, or its launcher was restarted and came back). All-reduce workers cannot go on without
    that node's, and may not notice it left for a long time: stopping them makes every node restart together."""

    def __init__(self, master: str, node_rank: int, say: Callable[[str], None]):
        self.master, self.node_rank, self.say = master, node_rank, say
        self._procs: list[subprocess.Popen] = []
        self._stopping = False
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def round(self, environments: AbstractContextManager[list[dict[str, str]]]) -> Iterator[list[dict[str, str]]]:
        """One round: `environments` (its entry meets the other nodes), watched until the round ends."""
        with self._lock:
            self._procs, self._stopping = [], False
        with environments as envs, watch_rounds(self.master, self.node_rank, self._new_round):
            yield envs

    def started(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs.append(proc)
            if self._stopping:  # the other nodes moved on while this round's workers were starting
                _terminate(proc)

    def _new_round(self, round: int, ranks: list[int]) -> None:
        self.say(f"[launch] node(s) {ranks} started round {round} of the rendezvous (a node restarted, or its launcher "
                 "was restarted): stopping this node's workers, so that every node restarts together")
        with self._lock:
            self._stopping = True
            for proc in self._procs:
                _terminate(proc)


def _terminate(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group of `proc`; the round's supervisor then sees it end and stops the rest."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)


@contextlib.contextmanager
def _merged(environments: AbstractContextManager[list[dict[str, str]]],
            extra: list[dict[str, str]]) -> Iterator[list[dict[str, str]]]:
    with environments as envs:
        yield [{**e, **x} for e, x in zip(envs, extra)]


def _launch_ps(backend: LaunchBackend, n: int, ps: int, devices_per_worker: int,
               start: Callable[[str, Mapping[str, str]], subprocess.Popen], say: Callable[[str], None], *,
               max_restarts: int, timeout_s: float | None,
               on_start: Callable[[list[subprocess.Popen]], None] | None) -> int:
    """A parameter-server job: one set of environments for the whole job (a restarted worker rejoins with its own)."""
    tasks = ps_job_tasks(n, ps)
    with backend.environments(n, devices_per_worker, ps=ps) as envs:
        procs: list[subprocess.Popen] = []
        try:
            for i, task in enumerate(tasks):
                procs.append(start(task_label(*task), envs[i]))
            if on_start:
                on_start(procs)
            return supervise_ps(procs, tasks, lambda i: start(task_label(*tasks[i]), envs[i]), say,
                                max_restarts=max_restarts, timeout_s=timeout_s)
        except BaseException:
            stop_processes(procs)
            raise


@contextlib.contextmanager
def _network(backend: LaunchBackend, network: str, say: Callable[[str], None], link_rate: str | None,
             n: int) -> Iterator[tuple[list[str], EmulatedNetwork | None]]:
    """(command prefix, emulated nodes): with `link_rate`, one emulated node per worker (no prefix: each
    rank runs under its node's command); else the prefix that puts a process in the job's private network
    (tfdist.cluster.private_net), or [] on the host network. Backends whose servers bind loopback
    themselves (Horovod's Gloo rendezvous and pairs) stay on the host network: their rendezvous runs in
    this process."""
    if link_rate is not None:
        with EmulatedNetwork(n, link_rate) as nodes:
            say(f"[launch] {n} emulated nodes, each linked at {link_rate}: "
                + ", ".join(nodes.address(i) for i in range(n)))
            yield [], nodes
        return
    if network == "host" or not getattr(backend, "listens_on_all_interfaces", False):
        yield [], None
        return
    with private_network() as (net, reason):
        if net is None:
            say(f"[launch] warning: no private network for this job ({reason}); its TensorFlow servers listen on "
                "every interface, unauthenticated — see docs/security.md. Pass --network host to silence this.")
            yield [], None
        else:
            yield net.command_prefix, None


def _name(backend: LaunchBackend) -> str:
    return getattr(backend, "name", type(backend).__name__)


def _on_nodes(name: str, nodes: EmulatedNetwork) -> LaunchBackend:
    """The backend called `name` bound to the emulated network `nodes` (see ON_NODES)."""
    module_name, _, attr = ON_NODES[name].partition(":")
    return getattr(importlib.import_module(module_name), attr)(nodes)


def _check_link_rate(backend: LaunchBackend, ps: int | None, link_rate: str) -> None:
    name = _name(backend)
    if ps is not None or not (getattr(backend, "supports_hosts", False) or name in ON_NODES):
        raise ConfigError(f"--link-rate (emulated nodes) works with --backend tf or horovod and no --ps; got "
                          f"--backend {name!r}{' with --ps' if ps is not None else ''}. Drop --link-rate"
                          f"{' or --ps' if ps is not None else ''}.")
    parse_rate(link_rate)  # a bad rate fails here, before anything starts


def _line_writer(out: TextIO) -> Callable[[str], None]:
    """A `say(line)` that writes whole lines to `out`, one thread at a time (every process has a reader)."""
    lock = threading.Lock()

    def say(line: str) -> None:
        with lock:
            out.write(line if line.endswith("\n") else line + "\n")
            out.flush()

    return say


def _check_supports_ps(backend: LaunchBackend) -> None:
    if not getattr(backend, "supports_ps", False):
        name = getattr(backend, "name", type(backend).__name__)
        raise ConfigError(f"--ps needs --backend tf (TF_CONFIG with chief, worker and ps jobs), got --backend "
                          f"{name!r}, which has no parameter servers; drop --ps or use --backend tf.")


def _check_ps_options(ps: int | None, max_restarts: int | None) -> None:
    """ConfigError for a --ps that is not a count of parameter servers, or a --max-restarts that is not a count."""
    if ps is not None and (isinstance(ps, bool) or not isinstance(ps, int) or ps < 1):
        raise ConfigError(f"--ps (number of parameter servers) must be a whole number >= 1, got {ps!r}; leave "
                          "--ps out for an all-reduce job.")
    if max_restarts is not None and (isinstance(max_restarts, bool) or not isinstance(max_restarts, int)
                                     or max_restarts < 0):
        what = "restarts per worker" if ps is not None else "restarts of all workers"
        raise ConfigError(f"--max-restarts ({what}) must be a whole number >= 0, got {max_restarts!r}.")


def _check_program(program: str) -> None:
    """ConfigError when `program` cannot be started: a path that is not an executable file, or a name that
    is on no directory of PATH (checked once here, instead of a traceback from every worker's Popen)."""
    if os.sep in program:
        if not os.path.isfile(program):
            raise ConfigError(f"cannot launch {program!r}: no such file. usage: tfdist launch -n 2 -- python train.py")
        if not os.access(program, os.X_OK):
            raise ConfigError(f"cannot launch {program!r}: the file is not executable (chmod +x it, or run it "
                              "through its interpreter, e.g. -- python script.py).")
    elif shutil.which(program) is None:
        raise ConfigError(f"cannot launch {program!r}: no such program on PATH. usage: tfdist launch -n 2 -- "
                          "python train.py")
