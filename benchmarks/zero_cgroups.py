"""Memory-capped cgroups (v1) for the ZeRO capacity proofs: is the controller usable, a capped group, its usage."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["CGROUPS", "capped", "join_command", "unavailable", "usage"]

CGROUPS = Path("/sys/fs/cgroup/memory")


def unavailable(free_gib: float = 0.0) -> str | None:
    """Why memory cgroups cannot be used here (for a skip message), or None when they can: needs root,
    the cgroup v1 memory controller at /sys/fs/cgroup/memory and `free_gib` GiB of available memory."""
    if os.geteuid() != 0:
        return "needs root to create memory cgroups"
    if not (CGROUPS / "memory.limit_in_bytes").is_file():
        return "needs the cgroup v1 memory controller at /sys/fs/cgroup/memory"
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    if available < free_gib:
        return f"needs ~{free_gib:.0f} GiB of free memory; {available:.1f} GiB free"
    return None


@contextlib.contextmanager
def capped(tag: str, cap_bytes: int) -> Iterator[Path]:
    """A memory cgroup capped at `cap_bytes` (swap included where the kernel accounts it); on exit what is
    left in it is killed and the group removed.

    Example:
        >>> with capped("demo", 512 * 2**20) as group:              # as root, cgroup v1
        ...     subprocess.run(join_command(group, ["python", "-c", "print(1)"]))
        ...     usage(group)["oom_kills"]
        0
    """
    group = CGROUPS / f"tfdist-{os.getpid()}-{tag}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(int(cap_bytes)))
        if (group / "memory.memsw.limit_in_bytes").exists():
            (group / "memory.memsw.limit_in_bytes").write_text(str(int(cap_bytes)))
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def join_command(group: Path, command: list[str]) -> list[str]:
    """`command` started inside `group`: a shell joins the group, then becomes the command (only the
    command is charged; the page cache of files first read there is charged too, so load big libraries
    once outside the group first)."""
    return ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", *command]


def usage(group: Path) -> dict[str, int]:
    """{"peak": bytes (memory.max_usage_in_bytes), "oom_kills": processes the group's OOM killer killed}."""
    oom = (group / "memory.oom_control").read_text().split()
    return {"peak": int((group / "memory.max_usage_in_bytes").read_text()),
            "oom_kills": int(dict(zip(oom[::2], oom[1::2])).get("oom_kill", 0))}
