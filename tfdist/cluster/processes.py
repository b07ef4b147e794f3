"""The launcher's child processes: start one with its output prefixed line by line, stop groups, describe exits."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence

__all__ = ["STOP_GRACE_S", "describe_exit", "exit_code", "is_stopped", "kill_group", "start_process", "stop_processes"]

# Seconds a process being stopped gets between SIGTERM and SIGKILL.
STOP_GRACE_S = 5.0


def start_process(command: Sequence[str], env: Mapping[str, str], prefix: str,
                  say: Callable[[str], None]) -> tuple[subprocess.Popen, threading.Thread]:
    """Starts `command` with exactly `env`; a daemon thread passes each output line (stdout and stderr) to
    `say` with `prefix`. Returns the process and that thread (join it after the process has ended)."""
    # Own process group per process: stopping it also stops what it started (e.g. `tfdist train`).
    proc = subprocess.Popen(list(command), env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    reader = threading.Thread(target=_pump, args=(proc.stdout, prefix, say), daemon=True)
    reader.start()
    return proc, reader


def _pump(stream, prefix: str, say: Callable[[str], None]) -> None:
    # Keras progress bars redraw with '\r' and '\b': keep what a terminal would finally show.
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        line = line.rsplit("\r", 1)[-1].replace("\b", "")
        if line.strip():
            say(prefix + line)
    stream.close()


def stop_processes(procs: Sequence[subprocess.Popen]) -> None:
    """Stops the process group of every live process: SIGTERM, then SIGKILL after STOP_GRACE_S.

    A stopped process (SIGSTOP) gets SIGKILL at once: it cannot act on SIGTERM before it is continued,
    and continuing it would let it run on (e.g. write a checkpoint) while its peers are being stopped."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        if is_stopped(p):
            kill_group(p)
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in live:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_group(p)
            p.wait()


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the process group of `proc`, whose leader may already have ended (its children may not:
    a restarted worker must not meet its predecessor's children on its port)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def is_stopped(proc: subprocess.Popen) -> bool:
    """True while `proc` is stopped by a signal (SIGSTOP, SIGTSTP: state T in /proc/PID/stat), i.e. alive but
    silent to its peers. False when it runs, has ended, or where there is no /proc."""
    try:
        with open(f"/proc/{proc.pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    # "PID (COMMAND) STATE ...": the command may hold spaces and parentheses, the state follows the last ')'.
    return stat[stat.rfind(b")") + 2:][:1] in (b"T", b"t")


def describe_exit(code: int) -> str:
    """'exited with code 3' or 'was killed by SIGKILL', from a Popen return code."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def exit_code(code: int) -> int:
    """A Popen return code as a shell reports it: a signal N becomes 128 + N."""
    return 128 - code if code < 0 else code
