"""Local launcher: N worker processes with per-rank environments, rank-prefixed output, fail-fast exit."""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import ContextManager, Protocol, TextIO

from tfdist.errors import ConfigError

__all__ = ["LaunchBackend", "BACKENDS", "load_backend", "launch"]


class LaunchBackend(Protocol):
    """Where a job's per-process environment comes from (TF_CONFIG, a Gloo rendezvous, ...).

    `environments(n, devices_per_worker)` is a context manager yielding one dict of extra environment
    variables per process; it stays open for the job's lifetime, so a backend can run a server.
    """

    def environments(self, n: int, devices_per_worker: int) -> ContextManager[list[dict[str, str]]]: ...


# backend name -> "module:attribute" of a zero-argument factory; imported only when chosen.
BACKENDS: dict[str, str] = {
    "tf": "tfdist.cluster.backends:TFConfigBackend",
    "horovod": "tfdist.cluster.backends:GlooBackend",
}

# Seconds a stopped worker gets between SIGTERM and SIGKILL.
STOP_GRACE_S = 5.0


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
    devices_per_worker: int = 1,
    backend: str | LaunchBackend = "tf",
    env: Mapping[str, str] | None = None,
    out: TextIO | None = None,
    on_start: Callable[[list[subprocess.Popen]], None] | None = None,
    timeout_s: float | None = None,
) -> int:
    """Runs `command` as `n` local processes and returns the first non-zero exit code (0 if all succeed).

    Each process gets the environment of `backend` for its rank; every line it prints (stdout and
    stderr) is written to `out` prefixed with "[rank] ". When a process fails (non-zero exit or a
    signal, reported as 128 + signal number) the others are stopped (SIGTERM, then SIGKILL after
    STOP_GRACE_S) and the launcher says which rank died and how. `on_start` receives the processes
    (e.g. to send signals in tests); `timeout_s` stops the whole job and returns 124.

    Example:
        >>> launch(["python", "train.py"], 2)       # same as: tfdist launch -n 2 -- python train.py
        0
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"-n (number of workers) must be a whole number >= 1, got {n!r}.")
    if not command:
        raise ConfigError("no command to launch; usage: tfdist launch -n 2 -- python train.py")
    _check_program(command[0])
    out = out or sys.stdout
    backend = load_backend(backend) if isinstance(backend, str) else backend
    lock = threading.Lock()

    def say(line: str) -> None:
        with lock:
            out.write(line if line.endswith("\n") else line + "\n")
            out.flush()

    with backend.environments(n, devices_per_worker) as envs:
        procs: list[subprocess.Popen] = []
        readers: list[threading.Thread] = []
        try:
            for rank, extra in enumerate(envs):
                full_env = {**os.environ, **(env or {}), **extra, "PYTHONUNBUFFERED": "1"}
                # Own process group per worker: stopping it also stops what it started (e.g. `tfdist train`).
                p = subprocess.Popen(list(command), env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
                procs.append(p)
                t = threading.Thread(target=_pump, args=(p.stdout, f"[{rank}] ", say), daemon=True)
                t.start()
                readers.append(t)
            if on_start:
                on_start(procs)
            code = _supervise(procs, say, timeout_s)
        except BaseException:
            _stop(procs)
            raise
        finally:
            for t in readers:
                t.join(timeout=5)
    return code


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
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]
            alive = [r for r, c in enumerate(codes) if c is None]
            say(f"[launch] worker {rank} (pid {procs[rank].pid}) {_describe(code)}"
                + (f"; stopping worker(s) {alive}" if alive else ""))
            _stop(procs)
            return _exit_code(code)
        if all(c == 0 for c in codes):
            return 0
        if deadline is not None and time.monotonic() > deadline:
            say(f"[launch] job exceeded its timeout of {timeout_s:g} s; stopping all workers")
            _stop(procs)
            return 124
        time.sleep(0.05)


def _pump(stream, prefix: str, say: Callable[[str], None]) -> None:
    # Keras progress bars redraw with '\r' and '\b': keep what a terminal would finally show.
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        line = line.rsplit("\r", 1)[-1].replace("\b", "")
        if line.strip():
            say(prefix + line)
    stream.close()


def _stop(procs: list[subprocess.Popen]) -> None:
    live = [p for p in procs if p.poll() is None]
    for p in live:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in live:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _describe(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code
