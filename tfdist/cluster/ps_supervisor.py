"""Supervising a parameter-server job (`tfdist launch --ps K`): the chief decides, workers come back.

An all-reduce job fails as a whole when one process dies (the others would wait for it forever). A
parameter-server job is built to survive lost workers, so its rules differ:

- the chief's exit (any code) ends the job, with the chief's exit code; workers and parameter servers are
  then stopped, because their TF servers never return by themselves;
- a worker that fails (non-zero exit or a signal) is restarted with the same environment, hence the same
  TF_CONFIG and port, so it rejoins the cluster (the chief's ClusterCoordinator reschedules its steps
  meanwhile), at most `max_restarts` times per worker, after a back-off that doubles with each restart
  (1, 2, 4 ... s, at most 30 s): a worker that fails at start-up does not burn its restarts in a second;
- a parameter server that ends is reported and not restarted: its variables are gone, and the chief fails
  with its own message (resuming from a checkpoint is the chief's business);
- a worker that exits with code 0 did so on purpose and is not restarted;
- past `timeout_s` everything is stopped and the job returns 124.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Sequence

from tfdist.cluster.processes import describe_exit, exit_code, kill_group, stop_processes

__all__ = ["supervise_ps", "task_label"]

POLL_S = 0.05
BACKOFF_S = 1.0  # wait before a worker's first restart; doubled for each further one
MAX_BACKOFF_S = 30.0


def task_label(task_type: str, index: int) -> str:
    """How output lines and messages name a task: 'chief', 'worker 1', 'ps 0'."""
    return "chief" if task_type == "chief" else f"{task_type} {index}"


def supervise_ps(
    procs: list[subprocess.Popen],
    tasks: Sequence[tuple[str, int]],
    restart: Callable[[int], subprocess.Popen],
    say: Callable[[str], None],
    *,
    max_restarts: int,
    timeout_s: float | None,
    backoff_s: float = BACKOFF_S,
) -> int:
    """Watches a parameter-server job until the chief ends (see the module docstring) and returns its exit code.

    Args:
        procs: the running processes, one per entry of `tasks`; a restarted worker replaces its entry in
            this same list, so a caller's cleanup always sees the live processes.
        tasks: (task type, index) of every process, the chief first (`backends.ps_job_tasks`).
        restart: starts process number i again with its original environment and returns it.
        say: writes one line of launcher output.
        max_restarts: restarts allowed per worker (0: none).
        backoff_s: seconds before a worker's first restart, doubled for each further one (at most
            MAX_BACKOFF_S); the chief is watched meanwhile.
        timeout_s: stop everything after this many seconds and return 124 (None: no limit).
    """
    if not tasks or tasks[0][0] != "chief" or len(tasks) != len(procs):
        raise ValueError(f"supervise_ps needs one process per task, the chief first; got tasks {list(tasks)} "
                         f"for {len(procs)} process(es).")
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    restarts = [0] * len(procs)
    settled: set[int] = set()  # tasks that ended for good (reported once, never polled again)
    due: dict[int, float] = {}  # failed workers waiting out their back-off: when to start them again
    while True:
        chief_code = procs[0].poll()
        if chief_code is not None:
            return _end_with_chief(procs, tasks, chief_code, say)
        for i, when in list(due.items()):
            if time.monotonic() >= when:
                del due[i]
                procs[i] = restart(i)
        for i in range(1, len(procs)):
            code = None if i in settled or i in due else procs[i].poll()
            if code is None:
                continue
            if _should_restart(tasks[i], code, restarts[i], max_restarts):
                restarts[i] += 1
                wait = min(MAX_BACKOFF_S, backoff_s * 2 ** (restarts[i] - 1))
                say(f"[launch] {task_label(*tasks[i])} {describe_exit(code)}; restarting it in {wait:g} s "
                    f"({restarts[i]}/{max_restarts})")
                kill_group(procs[i])  # its children must not hold the port the new process binds
                due[i] = time.monotonic() + wait
            else:
                settled.add(i)
                say(f"[launch] {task_label(*tasks[i])} {describe_exit(code)}; "
                    f"{_why_not_restarted(tasks[i][0], code, max_restarts)}")
        if deadline is not None and time.monotonic() > deadline:
            say(f"[launch] job exceeded its timeout of {timeout_s:g} s; stopping all processes")
            stop_processes(procs)
            return 124
        time.sleep(POLL_S)


def _should_restart(task: tuple[str, int], code: int, done: int, max_restarts: int) -> bool:
    return task[0] == "worker" and code != 0 and done < max_restarts


def _why_not_restarted(task_type: str, code: int, max_restarts: int) -> str:
    if task_type == "ps":
        return "parameter servers are not restarted (their variables are lost); the chief decides how the job ends"
    if code == 0:
        return "not restarted (it ended on purpose; only failed workers are restarted)"
    used = "used up" if max_restarts else "allows none"
    return f"not restarting it (--max-restarts {max_restarts} {used}); the other workers go on"


def _end_with_chief(procs: list[subprocess.Popen], tasks: Sequence[tuple[str, int]], code: int,
                    say: Callable[[str], None]) -> int:
    alive = [task_label(*tasks[i]) for i in range(1, len(procs)) if procs[i].poll() is None]
    # Not a failure: worker and ps servers serve until they are stopped; the chief's code is the job's.
    say(f"[launch] chief {describe_exit(code)}; the job ends with it"
        + (f": stopping {', '.join(alive)}" if alive else ""))
    stop_processes(procs)
    return exit_code(code)
