"""MemoryPhases (benchmarks/memory_phases.py): per-phase resident peaks read from /proc, reset at each mark.

Fast and TensorFlow-free (TensorFlow's allocator columns appear only once it is imported)."""

from __future__ import annotations

import sys

import pytest

FREED_TEMPORARY = """
from benchmarks.memory_phases import MemoryPhases, proc_status

MIB = 2**20
phases = MemoryPhases(device="no-such-device")
if not phases.peak_resettable:
    print("SKIP")
    raise SystemExit(0)
before = proc_status()["VmRSS"]
temporary = bytearray(300 * MIB)  # zero-filled: every page touched
del temporary
row = phases.mark("with a 300 MiB temporary")
assert row["rss_peak"] - before >= 290 * MIB
assert row["rss"] < row["rss_peak"] - 250 * MIB  # freed (large allocations are unmapped at once)
quiet = phases.mark("nothing")
assert quiet["rss_peak"] < row["rss_peak"] - 250 * MIB  # the peak was reset at the previous mark
assert [r["phase"] for r in phases.rows] == ["start", "with a 300 MiB temporary", "nothing"]
assert all(r["anon"] > 0 for r in phases.rows)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
def test_a_phase_peak_holds_a_temporary_freed_before_its_mark_and_the_next_phase_does_not(python):
    # In a fresh Python: the pytest worker's allocator may have been told to keep freed memory mapped by a
    # library an earlier test loaded (MPI's memory hooks do), and then nothing is unmapped at once.
    proc = python(FREED_TEMPORARY)
    if proc.stdout.strip() == "SKIP":
        pytest.skip("/proc/self/clear_refs cannot reset VmHWM here")
