"""MemoryPhases: a process's resident memory and TF's CPU allocator bytes, phase by phase (peak within each phase).

Used by `tfdist bench zero-capacity --phases` to attribute a training process's peak to start-up, model
creation, sharding, the first step or the steady state.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

__all__ = ["MemoryPhases", "proc_status"]

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM (peak resident set since start or the last reset), RssAnon and RssFile (mapped files:
    TF's shared libraries, not charged to a memory cgroup whose page cache was loaded elsewhere) of this
    process, bytes (Linux)."""
    out = {}
    for line in _STATUS.read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


class MemoryPhases:
    """Records, at each `mark(name)`, the resident set now (`rss`, of which `anon` is anonymous memory) and
    its peak since the previous mark (`rss_peak`, read from VmHWM, which `mark` then resets through
    /proc/self/clear_refs); with `cgroup` (a cgroup-v1 memory group holding this process alone) the bytes
    charged to it now and at their peak since the previous mark (`cgroup`, `cgroup_peak`: what a memory cap
    acts on); and, once TensorFlow is loaded, TF's CPU allocator bytes now and at their peak since the
    previous mark (`tf_current`, `tf_peak`; the CPU allocator counts the tensors of 256 KiB and more).

    A phase is what ran between two marks, so the row of mark "cut" holds the peak of everything between
    the previous mark and it.

    Example:
        >>> phases = MemoryPhases()
        >>> big = bytearray(200 * 2**20); del big
        >>> phases.mark("after the temporary")["rss_peak"] - phases.rows[0]["rss"] > 190 * 2**20
        True
    """

    def __init__(self, device: str = "CPU:0", cgroup: str | Path | None = None):
        self.device = device
        self.cgroup = Path(cgroup) if cgroup else None
        self.rows: list[dict] = []
        self.peak_resettable = self._reset_peak()
        self.mark("start")

    def mark(self, name: str) -> dict:
        status = proc_status()
        row = {"phase": name, "rss": status["VmRSS"], "rss_peak": status["VmHWM"], "anon": status.get("RssAnon", 0)}
        if self.cgroup is not None:
            row["cgroup"] = int((self.cgroup / "memory.usage_in_bytes").read_text())
            row["cgroup_peak"] = int((self.cgroup / "memory.max_usage_in_bytes").read_text())
            (self.cgroup / "memory.max_usage_in_bytes").write_text("0")  # resets the peak to the usage now
        row.update(self._tf_bytes())
        self.rows.append(row)
        self._reset_peak()
        return row

    def _tf_bytes(self) -> dict[str, int]:
        import sys

        if "tensorflow" not in sys.modules:
            return {}
        tf = sys.modules["tensorflow"]
        try:
            info = tf.config.experimental.get_memory_info(self.device)
            tf.config.experimental.reset_memory_stats(self.device)
        except (ValueError, RuntimeError, AttributeError):  # no allocator stats for this device
            return {}
        return {"tf_current": int(info["current"]), "tf_peak": int(info["peak"])}

    @staticmethod
    def _reset_peak() -> bool:
        # "5" resets VmHWM to the current RSS (Linux >= 4.0); without it the peaks are since the start.
        with contextlib.suppress(OSError):
            _CLEAR_REFS.write_text("5")
            return True
        return False
