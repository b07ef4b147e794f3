"""The proof that ZeRO stage 3 fits where stages 0, 1 and 2 do not: one process with 4 replicas inside a
memory-capped cgroup (cgroup v1, as root). The cap is set from stage 3's own measured peak (+15 %), so
the test follows TensorFlow's baseline memory; stages 0-2 are OOM-killed under it, stage 3 trains, and its
loss equals an uncapped stage-0 run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.zero_cgroups import capped, join_command, unavailable
from benchmarks.zero_cgroups import usage as group_usage

JOB = Path(__file__).with_name("zero3_cgroup_job.py")
WIDTH, DEPTH, STEPS = 2048, 8, 3  # Psi = 33.6 M: 16 Psi = 537 MB at stage 3, 64 Psi = 2.1 GB at stage 0
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}


def _skip_unless_cgroups() -> None:
    why = unavailable(free_gib=6)  # an uncapped stage-0 run needs ~5 GiB
    if why:
        pytest.skip(why)


def _run(stage: int, group: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(JOB), str(stage), str(WIDTH), str(DEPTH), str(STEPS)]
    if group is not None:  # the shell joins the group, then becomes the job: only the job is charged
        cmd = join_command(group, cmd)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV, check=False)


def _result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_only_stage3_trains_under_a_memory_cap_and_equals_uncapped_stage0():
    _skip_unless_cgroups()
    # Page cache is charged to the group that first reads a file: load TF's libraries outside the groups.
    subprocess.run([sys.executable, "-c", "import tensorflow, keras"], env=ENV, check=True, capture_output=True)
    reference = _result(_run(0))  # uncapped
    with capped("calibrate", 16 << 30) as group:
        calibrated = _result(_run(3, group))
        peak3 = group_usage(group)["peak"]
    assert calibrated["loss"] == pytest.approx(reference["loss"], rel=1e-4)
    cap = int(peak3 * 1.15)
    outcomes = {}
    for stage in (3, 2, 1, 0):
        with capped(f"s{stage}", cap) as group:
            proc = _run(stage, group)
            outcomes[stage] = (proc, group_usage(group))
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
