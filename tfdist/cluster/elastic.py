"""Supervising an all-reduce job (`tfdist launch` without --ps): fail fast, then restart every worker.

The workers of an all-reduce job wait for each other at every step, so none can go on without the others:

- the first worker to fail (non-zero exit or a signal) stops the others (SIGTERM, then SIGKILL after
  processes.STOP_GRACE_S; a stopped worker gets SIGKILL at once); the launcher names the failed worker and any
  worker it finds stopped (SIGSTOP: alive but silent, which is why its peers gave up);
- with `max_restarts` R > 0 (`--max-restarts R`), the launcher then starts all N workers again, at most R
  times per job (torchrun's policy: a whole new round, not one worker), each round in a fresh environment
  from the backend: new TF_CONFIG ports, a new Gloo rendezvous server. Reusing the old ones worked in a
  test here, but the old rendezvous store still holds the previous round's addresses, and a fresh port
  cannot meet a leftover of the previous round, so nothing stale can be read or met. Every worker gets
  TFDIST_RESTART_COUNT (0 in the first round) and TFDIST_MAX_RESTARTS. The launcher knows nothing of
  checkpoints: the program resumes itself, e.g. with tfdist.training.BackupAndRestore;
- the job succeeds when every worker of a round exits 0, and otherwise returns the last round's first failure;
- `timeout_s` bounds the whole job, every round included: past it everything is stopped and the job returns 124.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

from tfdist.cluster.processes import (
    describe_exit,
    exit_code,
    is_stopped,
    stop_processes,
)
from tfdist.errors import troubleshooting

__all__ = ["MAX_RESTARTS_ENV", "RESTART_COUNT_ENV", "TIMEOUT_CODE", "run_with_restarts", "supervise_round"]

# Environment of every worker: which round this is (0 = the first start) and how many restarts the job allows.
RESTART_COUNT_ENV = "TFDIST_RESTART_COUNT"  # torchrun's TORCHELASTIC_RESTART_COUNT
MAX_RESTARTS_ENV = "TFDIST_MAX_RESTARTS"
# What the job returns when timeout_s ran out (as the `timeout` command does).
TIMEOUT_CODE = 124
POLL_S = 0.05


def run_with_restarts(
    environments: Callable[[], AbstractContextManager[list[dict[str, str]]]],
    start: Callable[[int, dict[str, str]], subprocess.Popen],
    say: Callable[[str], None],
    *,
    max_restarts: int,
    timeout_s: float | None,
    on_start: Callable[[list[subprocess.Popen]], None] | None = None,
) -> int:
    """Runs rounds of all workers until one round succeeds, restarts run out, or time does (module docstring).

    Args:
        environments: opens one round's per-worker environments (the backend's `environments(n, m)`); kept
            open while that round runs, closed before the next round opens a fresh one.
        start: starts worker `rank` with these extra environment variables and returns its process.
        say: writes one line of launcher output.
        max_restarts: whole-job restarts allowed after the first round (0: fail fast, no restart).
        timeout_s: stop everything after this many seconds of the whole job and return 124 (None: no limit).
        on_start: called with each round's processes once they are all started (e.g. tests sending signals).
    Returns:
        0, the exit code of the last round's first failure (a signal N as 128 + N), or 124.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    restart = 0
    while True:
        with environments() as envs:
            procs: list[subprocess.Popen] = []
            try:
                for rank, env in enumerate(envs):
                    procs.append(start(rank, {**env, RESTART_COUNT_ENV: str(restart),
                                              MAX_RESTARTS_ENV: str(max_restarts)}))
                if on_start:
                    on_start(procs)
                code, timed_out = supervise_round(procs, say, deadline=deadline, timeout_s=timeout_s)
            except BaseException:
                stop_processes(procs)
                raise
        if timed_out or code == 0 or max_restarts == 0:
            return code
        if restart == max_restarts:
            say(f"[launch] no restart left (--max-restarts {max_restarts} used up); the job fails with code {code}."
                + troubleshooting("the-launcher-stopped-the-job"))
            return code
        if deadline is not None and time.monotonic() > deadline:
            say(f"[launch] job exceeded its timeout of {timeout_s:g} s; not restarting")
            return TIMEOUT_CODE
        restart += 1
        say(f"[launch] restarting all {len(procs)} workers ({restart}/{max_restarts}); they resume from their "
            "last checkpoint (e.g. tfdist.training.BackupAndRestore)")


def supervise_round(procs: list[subprocess.Popen], say: Callable[[str], None], *, deadline: float | None,
                    timeout_s: float | None) -> tuple[int, bool]:
    """Waits until every worker of the round has exited 0, one has failed, or `deadline` (time.monotonic; the
    end of the job's `timeout_s`) has passed; stops the rest in the last two cases. Returns (exit code, whether
    the deadline ran out: the code is then TIMEOUT_CODE)."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]
            say(f"[launch] worker {rank} (pid {procs[rank].pid}) {describe_exit(code)}"
                + _stopped_note(procs, codes) + _stopping_note(codes))
            stop_processes(procs)
            return exit_code(code), False
        if all(c == 0 for c in codes):
            return 0, False
        if deadline is not None and time.monotonic() > deadline:
            say(f"[launch] job exceeded its timeout of {timeout_s:g} s; stopping all workers")
            stop_processes(procs)
            return TIMEOUT_CODE, True
        time.sleep(POLL_S)


def _stopped_note(procs: list[subprocess.Popen], codes: list[int | None]) -> str:
    """Names the workers that are stopped (alive but silent): their peers time out waiting for them, so a
    stopped worker, not the one that exited first, is usually what broke the round."""
    stopped = [r for r, c in enumerate(codes) if c is None and is_stopped(procs[r])]
    return "".join(f"; worker {r} (pid {procs[r].pid}) is stopped (SIGSTOP or SIGTSTP: alive but silent, so its "
                   "peers gave up waiting for it)" for r in stopped)


def _stopping_note(codes: list[int | None]) -> str:
    alive = [r for r, c in enumerate(codes) if c is None]
    return f"; stopping worker(s) {alive}" if alive else ""
