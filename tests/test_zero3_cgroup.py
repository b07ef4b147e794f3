"""The proof that ZeRO stage 3 fits where stages 0, 1 and 2 do not: one process with 4 replicas inside a
memory-capped cgroup (cgroup v1, as root). The cap is set from stage 3's own measured peak (+15 %), so
the test follows TensorFlow's baseline memory; stages 0-2 are OOM-killed under it, stage 3 trains, and its
loss equals an uncapped stage-0 run."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

CGROUPS = Path("/sys/fs/cgroup/memory")
JOB = Path(__file__).with_name("zero3_cgroup_job.py")
WIDTH, DEPTH, STEPS = 2048, 8, 3  # Psi = 33.6 M: 16 Psi = 537 MB at stage 3, 64 Psi = 2.1 GB at stage 0
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}


def _skip_unless_cgroups() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to create memory cgroups")
    if not (CGROUPS / "memory.limit_in_bytes").is_file():
        pytest.skip("needs the cgroup v1 memory controller at /sys/fs/cgroup/memory")
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    if available < 6:
        pytest.skip(f"needs ~5 GiB of free memory (an uncapped stage-0 run); {available:.1f} GiB free")


@contextlib.contextmanager
def _capped(tag: str, cap_bytes: int):
    """A memory cgroup capped at cap_bytes (swap included), removed on exit after killing what is left in it."""
    group = CGROUPS / f"tfdist-test-{os.getpid()}-zero3-{tag}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(cap_bytes))
        if (group / "memory.memsw.limit_in_bytes").exists():
            (group / "memory.memsw.limit_in_bytes").write_text(str(cap_bytes))
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


def _run(stage: int, group: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(JOB), str(stage), str(WIDTH), str(DEPTH), str(STEPS)]
    if group is not None:  # the shell joins the group, then becomes the job: only the job is charged
        cmd = ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV)


def _result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _usage(group: Path) -> dict:
    oom = (group / "memory.oom_control").read_text().split()
    return {"peak": int((group / "memory.max_usage_in_bytes").read_text()),
            "oom_kills": int(dict(zip(oom[::2], oom[1::2])).get("oom_kill", 0))}


@pytest.mark.slow
def test_only_stage3_trains_under_a_memory_cap_and_equals_uncapped_stage0():
    _skip_unless_cgroups()
    # Page cache is charged to the group that first reads a file: load TF's libraries outside the groups.
    subprocess.run([sys.executable, "-c", "import tensorflow, keras"], env=ENV, check=True, capture_output=True)
    reference = _result(_run(0))  # uncapped
    with _capped("calibrate", 16 << 30) as group:
        calibrated = _result(_run(3, group))
        peak3 = _usage(group)["peak"]
    assert calibrated["loss"] == pytest.approx(reference["loss"], rel=1e-4)
    cap = int(peak3 * 1.15)
    outcomes = {}
    for stage in (3, 2, 1, 0):
        with _capped(f"s{stage}", cap) as group:
            proc = _run(stage, group)
            outcomes[stage] = (proc, _usage(group))
    print(f"Psi = {reference['num_params']:,}; stage-3 peak {peak3 / 2**20:.0f} MiB, cap {cap / 2**20:.0f} MiB: "
          + ", ".join(f"stage {s}: exit {p.returncode}, OOM kills {u['oom_kills']}, peak {u['peak'] / 2**20:.0f} MiB"
                      for s, (p, u) in sorted(outcomes.items())))
    proc, usage = outcomes[3]
    result = _result(proc)
    assert usage["oom_kills"] == 0 and usage["peak"] <= cap
    assert result["loss"] == pytest.approx(reference["loss"], rel=1e-4)
    for stage in (0, 1, 2):
        proc, usage = outcomes[stage]
        assert proc.returncode == -signal.SIGKILL and usage["oom_kills"] >= 1, (stage, proc.returncode, usage,
                                                                                 proc.stderr[-2000:])
