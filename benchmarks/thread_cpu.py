"""CPU time of this process per thread group, read from /proc (Linux): what a step's CPU went to.

A group is a thread's name (`/proc/self/task/<tid>/comm`) with trailing digits and separators removed, so a pool's
threads add up: TensorFlow's compute pool, gRPC's executor and poller threads, the Python main thread. Threads that
ended between two snapshots are missed (their time is gone with them); the threads that run a step are pools and
live as long as the process.
"""

from __future__ import annotations

import os
import re

_TICKS = os.sysconf("SC_CLK_TCK")


def _group(name: str) -> str:
    return re.sub(r"[\d_\-/:.]+$", "", name.strip()) or name.strip()


def snapshot() -> dict[int, tuple[str, int]]:
    """{thread id: (group, user + system clock ticks)} for every live thread of this process."""
    threads: dict[int, tuple[str, int]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended while we listed them
            continue
        # "pid (comm) state ..." -- comm may hold spaces and parentheses, so split at the last ")"
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        threads[int(tid)] = (_group(name), int(fields[11]) + int(fields[12]))  # utime, stime
    return threads


def seconds_by_group(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]]) -> dict[str, float]:
    """CPU seconds each group used between two snapshots (threads born in between count from zero)."""
    used: dict[str, float] = {}
    for tid, (group, ticks) in after.items():
        start = before.get(tid, (group, 0))[1]
        if ticks > start:
            used[group] = used.get(group, 0.0) + (ticks - start) / _TICKS
    return dict(sorted(used.items(), key=lambda kv: -kv[1]))
