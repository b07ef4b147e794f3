"""CPU-quota cgroups for benchmarks: one cgroup per process of a job, a quota each, the CPU time each used.

cgroup v1 only (the CPU controller at /sys/fs/cgroup/cpu, cpuacct beside it); needs root. Every cgroup
made is removed by `CpuGroups.remove()`, which the benchmark calls also after errors and signals.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

__all__ = ["CPUACCT_ROOT", "CPU_ROOT", "CgroupsUnavailable", "CpuGroups", "cgroup_problem"]

CPU_ROOT = "/sys/fs/cgroup/cpu"
CPUACCT_ROOT = "/sys/fs/cgroup/cpuacct"

class CgroupsUnavailable(RuntimeError):
    """No way to put a process under a CPU quota here (not root, or no cgroup v1 CPU controller)."""


def cgroup_problem(cpu_root: str = CPU_ROOT) -> str | None:
    """Why CPU-quota cgroups cannot be made here, or None when they can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return (f"tfdist bench straggler needs root: it slows a worker with a cgroup CPU quota, and only root may "
                f"create cgroups under {cpu_root} (running as uid {os.getuid() if hasattr(os, 'getuid') else '?'})")
    if not os.path.isfile(os.path.join(cpu_root, "cpu.cfs_quota_us")):
        return (f"tfdist bench straggler needs the cgroup v1 CPU controller, and {cpu_root} has no cpu.cfs_quota_us "
                "(cgroup v2 only, or not mounted there; --cgroup-root names another mount point)")
    if not os.access(cpu_root, os.W_OK):
        return f"tfdist bench straggler cannot create cgroups under {cpu_root} (read-only cgroup file system?)"
    return None


def _pids_of_group(pgid: int) -> list[int]:
    """Every live process in process group `pgid` (the launcher starts each task in its own session)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


class CpuGroups:
    """One cgroup per task of a job, under a parent named after this process, in the CPU controller's
    hierarchy and, when it is mounted apart, the cpuacct one (CPU time used). `remove()` deletes them all.

    Example:
        >>> groups = CpuGroups(["worker 0", "worker 1"])
        >>> groups.move("worker 0", proc.pid); groups.set_quota("worker 0", 0.6)
        >>> groups.cpu_seconds()        # {"worker 0": 12.3, "worker 1": 4.1}
        >>> groups.remove()
    """

    def __init__(self, names: list[str], cpu_root: str = CPU_ROOT, acct_root: str = CPUACCT_ROOT,
                 period_us: int = 100_000):
        problem = cgroup_problem(cpu_root)
        if problem:
            raise CgroupsUnavailable(problem)
        self.period_us = period_us
        self.roots = [cpu_root]
        if (os.path.isfile(os.path.join(acct_root, "cpuacct.usage"))
                and os.path.realpath(acct_root) != os.path.realpath(cpu_root)):
            self.roots.append(acct_root)
        parent = f"tfdist-straggler-{os.getpid()}"
        self.parents = [os.path.join(root, parent) for root in self.roots]
        self.names = list(names)
        self.made: list[str] = []  # directories made, parents first
        try:
            for path in self.parents:
                os.makedirs(path, exist_ok=True)
                self.made.append(path)
                if path == self.parents[0]:
                    # A cgroup competes with the tasks beside it as ONE task (1024 shares): give the parent
                    # one task's weight per group, as its processes would have had outside any cgroup, so that
                    # on a busy machine the quotas, not the other jobs, decide the workers' speeds.
                    _write(os.path.join(path, "cpu.shares"), str(1024 * len(self.names)))
                for name in self.names:
                    os.mkdir(self._dir(path, name))
                    self.made.append(self._dir(path, name))
        except BaseException:
            self.remove()
            raise

    @staticmethod
    def _dir(parent: str, name: str) -> str:
        return os.path.join(parent, name.replace(" ", ""))

    def paths(self) -> list[str]:
        return list(self.made)

    def move(self, name: str, pid: int) -> None:
        """Moves process `pid` and the rest of its process group (what it started) into group `name`."""
        pids = _pids_of_group(pid) or [pid]
        for parent in self.parents:
            for p in pids:
                with contextlib.suppress(ProcessLookupError):
                    _write(os.path.join(self._dir(parent, name), "cgroup.procs"), str(p))

    def set_quota(self, name: str, cpus: float | None) -> None:
        """CPU quota of group `name`: `cpus` CPUs' worth of time per period (None: no limit)."""
        directory = self._dir(self.parents[0], name)
        if cpus is None:
            _write(os.path.join(directory, "cpu.cfs_quota_us"), "-1")
            return
        _write(os.path.join(directory, "cpu.cfs_period_us"), str(self.period_us))
        _write(os.path.join(directory, "cpu.cfs_quota_us"), str(max(1000, round(cpus * self.period_us))))

    def quota(self, name: str) -> float | None:
        directory = self._dir(self.parents[0], name)
        quota = int(_read(os.path.join(directory, "cpu.cfs_quota_us")))
        return None if quota < 0 else quota / int(_read(os.path.join(directory, "cpu.cfs_period_us")))

    def members(self, name: str) -> list[int]:
        return [int(p) for p in _read(os.path.join(self._dir(self.parents[0], name), "cgroup.procs")).split()]

    def cpu_seconds(self) -> dict[str, float] | None:
        """CPU time used so far by each group (cpuacct.usage), or None without the cpuacct controller."""
        usage = {}
        for name in self.names:
            for parent in reversed(self.parents):
                path = os.path.join(self._dir(parent, name), "cpuacct.usage")
                if os.path.isfile(path):
                    usage[name] = int(_read(path)) / 1e9
                    break
            else:
                return None
        return usage

    def throttling(self) -> dict[str, dict[str, float]]:
        """From cpu.stat: periods, periods throttled and seconds throttled so far, per group."""
        result = {}
        for name in self.names:
            stat = dict(line.split() for line in _read(os.path.join(self._dir(self.parents[0], name),
                                                                     "cpu.stat")).splitlines() if line.strip())
            result[name] = {"periods": int(stat.get("nr_periods", 0)), "throttled": int(stat.get("nr_throttled", 0)),
                            "throttled_seconds": int(stat.get("throttled_time", 0)) / 1e9}
        return result

    def remove(self) -> None:
        """Deletes every group made (children first); a process still inside goes back to the root group."""
        for path in reversed(self.made):
            root = next(r for r in self.roots if path.startswith(r + os.sep))
            for _ in range(50):
                with contextlib.suppress(OSError):
                    for pid in _read(os.path.join(path, "cgroup.procs")).split():
                        with contextlib.suppress(OSError):
                            _write(os.path.join(root, "cgroup.procs"), pid)
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)
            else:
                print(f"warning: could not remove cgroup {path}; remove it with: rmdir {path}", file=sys.stderr)
        self.made = [p for p in self.made if os.path.isdir(p)]


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
