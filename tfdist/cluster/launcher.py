"""Local launcher: N worker processes with per-rank environments, rank-prefixed output, fail-fast exit;
with --ps K, a parameter-server job (chief, workers, parameter servers) supervised by ps_supervisor."""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import ContextManager, Protocol, TextIO

from tfdist.cluster.backends import ps_job_tasks
from tfdist.cluster.processes import describe_exit, exit_code, start_process, stop_processes
from tfdist.cluster.private_net import private_network
from tfdist.cluster.ps_supervisor import supervise_ps, task_label
from tfdist.errors import ConfigError

__all__ = ["LaunchBackend", "BACKENDS", "DEFAULT_MAX_RESTARTS", "load_backend", "launch"]


class LaunchBackend(Protocol):
    """Where a job's per-process environment comes from (TF_CONFIG, a Gloo rendezvous, ...).

    `environments(n, devices_per_worker)` is a context manager yielding one dict of extra environment
    variables per process; it stays open for the job's lifetime, so a backend can run a server. A backend
    that can make parameter-server jobs has `supports_ps = True` and takes `ps=K` there too.
    """

    def environments(self, n: int, devices_per_worker: int) -> ContextManager[list[dict[str, str]]]: ...


# backend name -> "module:attribute" of a zero-argument factory; imported only when chosen.
BACKENDS: dict[str, str] = {
    "tf": "tfdist.cluster.backends:TFConfigBackend",
    "horovod": "tfdist.cluster.backends:GlooBackend",
}

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
) -> int:
    """Runs `command` as `n` local processes and returns the first non-zero exit code (0 if all succeed).

    Each process gets the environment of `backend` for its rank; every line it prints (stdout and
    stderr) is written to `out` prefixed with "[rank] ". When a process fails (non-zero exit or a
    signal, reported as 128 + signal number) the others are stopped (SIGTERM, then SIGKILL after
    processes.STOP_GRACE_S) and the launcher says which rank died and how. `on_start` receives the processes
    (e.g. to send signals in tests); `timeout_s` stops the whole job and returns 124.

    With `ps` = K >= 1 (backend "tf" only) it runs a parameter-server job instead: 1 chief + n workers +
    K parameter servers, each with TF_CONFIG (jobs 'chief', 'worker', 'ps'), TFDIST_ROLE and TFDIST_RANK
    (chief 0, workers 1..n, parameter servers n+1..n+K); lines are prefixed "[chief] ", "[worker i] ",
    "[ps j] ". Its rules (tfdist.cluster.ps_supervisor): the job returns the chief's exit code, and the
    chief's exit, whatever its code, stops the workers and servers (which never end by themselves); a
    failed worker is restarted with the same environment (so it rejoins) up to `max_restarts` times
    (default DEFAULT_MAX_RESTARTS) and the job goes on; a parameter server that ends is reported, not
    restarted. The list `on_start` receives is kept current: a restarted worker replaces its entry.

    Example:
        >>> launch(["python", "train.py"], 2)       # same as: tfdist launch -n 2 -- python train.py
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
    backend = load_backend(backend) if isinstance(backend, str) else backend
    say = _line_writer(out or sys.stdout)
    labels = [str(r) for r in range(n)] if ps is None else [task_label(*t) for t in ps_job_tasks(n, ps)]
    with _environments(backend, n, devices_per_worker, ps) as envs, _network(backend, network, say) as prefix:
        procs: list[subprocess.Popen] = []
        readers: list[threading.Thread] = []

        def start(i: int) -> subprocess.Popen:
            full_env = {**os.environ, **(env or {}), **envs[i], "PYTHONUNBUFFERED": "1"}
            proc, reader = start_process([*prefix, *command], full_env, f"[{labels[i]}] ", say)
            readers.append(reader)
            return proc

        try:
            for i in range(len(envs)):
                procs.append(start(i))
            if on_start:
                on_start(procs)
            if ps is None:
                code = _supervise(procs, say, timeout_s)
            else:
                restarts = DEFAULT_MAX_RESTARTS if max_restarts is None else max_restarts
                code = supervise_ps(procs, ps_job_tasks(n, ps), start, say, max_restarts=restarts,
                                    timeout_s=timeout_s)
        except BaseException:
            stop_processes(procs)
            raise
        finally:
            for t in readers:
                t.join(timeout=5)
    return code


@contextlib.contextmanager
def _network(backend: LaunchBackend, network: str, say: Callable[[str], None]) -> Iterator[list[str]]:
    """The command prefix that puts a process in the job's private network (tfdist.cluster.private_net), or
    [] on the host network. Backends whose servers bind loopback themselves (Horovod's Gloo rendezvous
    and pairs) stay on the host network: their rendezvous runs in this process."""
    if network == "host" or not getattr(backend, "listens_on_all_interfaces", False):
        yield []
        return
    with private_network() as (net, reason):
        if net is None:
            say(f"[launch] warning: no private network for this job ({reason}); its TensorFlow servers listen on "
                "every interface, unauthenticated — see docs/security.md. Pass --network host to silence this.")
            yield []
        else:
            yield net.command_prefix


def _line_writer(out: TextIO) -> Callable[[str], None]:
    """A `say(line)` that writes whole lines to `out`, one thread at a time (every process has a reader)."""
    lock = threading.Lock()

    def say(line: str) -> None:
        with lock:
            out.write(line if line.endswith("\n") else line + "\n")
            out.flush()

    return say


def _environments(backend: LaunchBackend, n: int, devices_per_worker: int,
                  ps: int | None) -> ContextManager[list[dict[str, str]]]:
    if ps is None:
        return backend.environments(n, devices_per_worker)
    if not getattr(backend, "supports_ps", False):
        name = getattr(backend, "name", type(backend).__name__)
        raise ConfigError(f"--ps needs --backend tf (TF_CONFIG with chief, worker and ps jobs), got --backend "
                          f"{name!r}, which has no parameter servers; drop --ps or use --backend tf.")
    return backend.environments(n, devices_per_worker, ps=ps)


def _check_ps_options(ps: int | None, max_restarts: int | None) -> None:
    """ConfigError for a --ps that is not a count of parameter servers, or --max-restarts without --ps."""
    if ps is not None and (isinstance(ps, bool) or not isinstance(ps, int) or ps < 1):
        raise ConfigError(f"--ps (number of parameter servers) must be a whole number >= 1, got {ps!r}; leave "
                          "--ps out for an all-reduce job.")
    if max_restarts is None:
        return
    if ps is None:
        raise ConfigError(f"--max-restarts {max_restarts} applies only to parameter-server jobs (--ps K): in an "
                          "all-reduce job the others cannot go on without a lost worker, so the job stops.")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ConfigError(f"--max-restarts (restarts per worker) must be a whole number >= 0, got {max_restarts!r}.")


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


def _supervise(procs: list[subprocess.Popen], say: Callable[[str], None], timeout_s: float | None) -> int:
    """All-reduce jobs: the first failure stops everyone (the others would wait for it forever)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]
            alive = [r for r, c in enumerate(codes) if c is None]
            say(f"[launch] worker {rank} (pid {procs[rank].pid}) {describe_exit(code)}"
                + (f"; stopping worker(s) {alive}" if alive else ""))
            stop_processes(procs)
            return exit_code(code)
        if all(c == 0 for c in codes):
            return 0
        if deadline is not None and time.monotonic() > deadline:
            say(f"[launch] job exceeded its timeout of {timeout_s:g} s; stopping all workers")
            stop_processes(procs)
            return 124
        time.sleep(0.05)
