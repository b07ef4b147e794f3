"""`tfdist bench straggler`: the record's structure, the cgroups it makes and removes, and the message without
root or cgroups. No timed asserts: the async >= 1.5 x sync target is judged in docs/benchmarks.md from a full run."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

import pytest

from benchmarks import straggler

PROBLEM = straggler.cgroup_problem()
needs_cgroups = pytest.mark.skipif(PROBLEM is not None, reason=f"no CPU-quota cgroups here: {PROBLEM}")
CPUACCT = any(os.path.isfile(f"/sys/fs/cgroup/{c}/cpuacct.usage") for c in ("cpuacct", "cpu"))  # CPU time used


def tfdist_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tfdist", *args], check=False, capture_output=True, text=True,
                          timeout=timeout,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})


def leftover_groups(pid: int) -> list[str]:
    return glob.glob(f"/sys/fs/cgroup/*/tfdist-straggler-{pid}")


@pytest.mark.slow
@needs_cgroups
def test_a_small_run_writes_its_record_and_removes_its_cgroups(tmp_path):
    out, png = tmp_path / "straggler.json", tmp_path / "straggler.png"
    # One round of the real jobs; how rounds interleave and are summarised: test_rounds_interleave_and_are_summarised
    proc = tfdist_cli("bench", "straggler", "--rounds", "1", "--steps", "8", "--json", str(out), "--png", str(png))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "async / sync" in proc.stdout and png.stat().st_size > 0
    record = json.loads(out.read_text())
    assert record["benchmark"] == "straggler" and record["rounds"] == 1
    assert record["order"] == ["async", "sync"]
    assert record["quota_cpus"]["worker 0"] == 0.6 and record["quota_cpus"]["worker 1"] == 0.2
    assert record["steps_per_epoch"] == {"async": 16, "sync": 8}
    assert record["images_per_step"] == {"async": 64, "sync": 128}
    for mode in ("async", "sync"):
        runs = record["runs"][mode]
        assert len(runs) == 1
        for run in runs:
            assert run["images_per_sec"] > 0 and run["timed_seconds"] > 0
            assert run["timed_images"] == 8 * 128 and run["train_images"] == 2 * 8 * 128  # equal in both modes
            assert 0.0 < run["test_accuracy"] <= 1.0
            assert all(n == 1 for n in run["members"].values()), run["members"]  # one process per cgroup
            if CPUACCT:
                assert all(c >= 0 for c in run["cpus_used"].values()) and run["images_per_cpu_second"] > 0
        spread = record["images_per_sec"][mode]
        assert 0 < spread["min"] <= spread["median"] <= spread["max"]
        assert 0 < record["test_accuracy"][mode]["median"] <= 1
    if CPUACCT:
        assert set(record["cpus_used"]["async"]) == {"chief", "worker 0", "worker 1", "ps 0"}
        assert set(record["cpus_used"]["sync"]) == {"worker 0", "worker 1"}
    assert record["ratio"] > 0 and isinstance(record["met"], bool) and record["target_ratio"] == 1.5
    assert record["cgroups"] and not [p for p in record["cgroups"] if os.path.exists(p)]


def test_rounds_interleave_and_are_summarised(monkeypatch, tmp_path, capsys):
    """`measure` over two rounds with jobs that return what a real job returns (figures made up): ABBA order,
    the median of each mode, the per-round ratio, and the record and chart written."""
    import argparse

    class Groups:  # the CPU-quota groups, which only the real jobs need
        def __init__(self, names, **kwargs):
            pass

        def paths(self):
            return ["/sys/fs/cgroup/cpu/tfdist-straggler-test"]

        def remove(self):
            pass

    rates = {"async": iter([300.0, 360.0]), "sync": iter([200.0, 150.0])}

    def job(mode, args, groups, out_path):
        return {"images_per_sec": next(rates[mode]), "timed_images": 1024, "train_images": 2048,
                "timed_seconds": 1.0, "test_accuracy": 0.5, "job_seconds": 9.0, "members": {"worker 0": 1},
                "cpus_used": {"worker 0": 0.5, "worker 1": 0.2}, "images_per_cpu_second": 100.0}

    monkeypatch.setattr(straggler, "CpuGroups", Groups)
    monkeypatch.setattr(straggler, "run_job", job)
    parser = argparse.ArgumentParser()
    straggler.add_arguments(parser)
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    straggler.measure(parser.parse_args(["--rounds", "2", "--json", str(out), "--png", str(png)]))
    record = json.loads(out.read_text())
    assert record["order"] == ["async", "sync", "sync", "async"] and record["rounds"] == 2
    assert record["images_per_sec"]["async"] == {"median": 330.0, "min": 300.0, "max": 360.0, "rounds": 2}
    assert record["images_per_sec"]["sync"]["median"] == 175.0
    assert record["ratio"] == pytest.approx(330 / 175) and record["met"]
    assert record["ratio_per_round"]["values"] == pytest.approx([1.5, 2.4])
    assert record["cpus_used"]["sync"] == {"worker 0": 0.5, "worker 1": 0.2}
    assert png.stat().st_size > 0 and "async / sync = 1.89" in capsys.readouterr().out


@pytest.mark.slow
@needs_cgroups
def test_a_failing_job_still_removes_the_cgroups(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "tfdist", "bench", "straggler", "--rounds", "1", "--steps", "4",
                             "--timeout", "3", "--json", str(tmp_path / "s.json"), "--png", ""],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stdout + stderr
    assert "the async job failed (exit code 124, timed out)" in stderr
    assert not leftover_groups(proc.pid)
    assert not (tmp_path / "s.json").exists()


@needs_cgroups
def test_cpu_groups_throttle_a_process_and_are_removed():
    groups = straggler.CpuGroups(["worker 0", "worker 1"])
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        groups.move("worker 1", spinner.pid)
        groups.set_quota("worker 1", 0.1)
        assert groups.members("worker 1") == [spinner.pid] and groups.members("worker 0") == []
        assert groups.quota("worker 1") == pytest.approx(0.1) and groups.quota("worker 0") is None
        before = groups.cpu_seconds()
        time.sleep(1.0)
        used = groups.cpu_seconds()["worker 1"] - before["worker 1"]
        assert used < 0.5  # 0.1 CPU for ~1 s; generous bound, the machine is shared
    finally:
        spinner.kill()
        spinner.wait()
        groups.remove()
    assert not groups.paths() and not leftover_groups(os.getpid())


def test_without_root_it_says_why_and_exits_non_zero(monkeypatch, capsys):
    monkeypatch.setattr(straggler.os, "geteuid", lambda: 1000)
    assert "needs root" in straggler.cgroup_problem()
    with pytest.raises(straggler.CgroupsUnavailable, match="needs root"):
        straggler.CpuGroups(["worker 0"])
    assert straggler.main(["--rounds", "1"]) == 1
    assert "needs root" in capsys.readouterr().err


def test_without_a_cpu_controller_it_says_why(tmp_path, capsys):
    if os.geteuid() != 0:
        pytest.skip("as non-root the root check speaks first")
    assert straggler.main(["--cgroup-root", str(tmp_path)]) == 1
    assert "cgroup v1 CPU controller" in capsys.readouterr().err


def test_bad_options_are_config_errors():
    from tfdist.errors import ConfigError

    with pytest.raises(ConfigError, match="--slow-cpus"):
        straggler.main(["--slow-cpus", "0"])
    with pytest.raises(ConfigError, match="--rounds"):
        straggler.main(["--rounds", "0"])
