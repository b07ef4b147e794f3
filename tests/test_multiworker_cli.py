"""Across processes from the command line: `tfdist launch -- tfdist train`, bench allreduce and bench zero."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

TFDIST = [sys.executable, "-m", "tfdist"]
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}


def test_train_under_the_launcher_writes_outputs_once_from_the_chief(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([*TFDIST, "launch", "-n", "2", "--", *TFDIST, "train", "--strategy", "multiworker",
                           "--dataset", "digits", "--epochs", "2", "--json", str(out / "run.json"),
                           "--plot", str(out / "curves.png"), "--save", str(out / "cnn.keras")],
                          capture_output=True, text=True, env=ENV, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert sorted(os.listdir(out)) == ["cnn.keras", "curves.png", "run.json"]
    assert [line for line in lines if "wrote" in line] == [f"[0] wrote {out / n}" for n in
                                                           ("curves.png", "run.json", "cnn.keras")]
    assert not any(line.startswith("[1] Epoch") for line in lines)  # progress bar: chief only
    record = json.loads((out / "run.json").read_text())
    assert record["replicas"] == 2 and record["strategy"] == "multiworker"
    assert len(record["history"]["loss"]) == 2 and record["history"]["loss"][1] < record["history"]["loss"][0]
    # both workers evaluated the same model
    accuracies = {line.split()[0]: line.split()[3].rstrip(",") for line in lines if "test accuracy" in line}
    assert accuracies["[0]"] == accuracies["[1]"] and float(accuracies["[0]"]) > 0.5


def test_bench_allreduce_tf_backend_writes_bus_bandwidth(tmp_path):
    path = tmp_path / "allreduce.json"
    proc = subprocess.run([*TFDIST, "bench", "allreduce", "--backend", "tf", "--sizes-mb", "1", "4", "--iters", "3",
                           "--json", str(path)], capture_output=True, text=True, env=ENV, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads(path.read_text())
    assert record["backend"] == "tf" and record["num_workers"] == 2
    assert [r["size_mb"] for r in record["results"]] == [1.0, 4.0]
    for r in record["results"]:
        assert r["bytes"] == int(r["size_mb"] * 2**20)
        # N = 2: busbw = 2(N-1)/N * bytes / time = bytes / time
        assert r["busbw_gbps"] == pytest.approx(r["bytes"] / (r["median_ms"] / 1000) / 1e9)
        assert r["busbw_gbps"] > 0
        # TF's default ring, interleaved in the same rounds (3 by default), is timed beside tfdist's
        assert r["stock_busbw_gbps"] == pytest.approx(r["bytes"] / (r["stock_median_ms"] / 1000) / 1e9)
        assert r["speedup_over_stock"]["rounds"] == 3 and r["speedup_over_stock"]["min"] > 0
        # and the same ring in pieces (MultiWorkerMirroredStrategy(ring_piece_mb=2)), in the same rounds
        assert r["pieces_busbw_gbps"] == pytest.approx(r["bytes"] / (r["pieces_median_ms"] / 1000) / 1e9)
        assert r["pieces_speedup"]["rounds"] == 3 and r["pieces_speedup"]["min"] > 0
    assert record["ring_piece_mb"] == 2.0
    assert "GB/s" in proc.stdout and "stock TF" in proc.stdout and "pieces" in proc.stdout
    assert (tmp_path / "allreduce.png").stat().st_size > 10_000


def test_bench_allreduce_refuses_a_piece_size_below_a_quarter_mb():
    proc = subprocess.run([*TFDIST, "bench", "allreduce", "--backend", "tf", "--ring-piece-mb", "0.1"],
                          capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode != 0
    assert "--ring-piece-mb must be >= 0.25 (a size in MB; 2 suits 1 Gbit/s), got 0.1." in proc.stderr + proc.stdout


def test_bench_zero_processes_measures_every_stage_under_both_allocators(tmp_path):
    # One round of real launches (every stage under both allocators, stage 3 with prefetch); how rounds are
    # interleaved and summarised is checked with two rounds in test_bench_zero_rounds_are_interleaved_and_summarised.
    path, png = tmp_path / "zero.json", tmp_path / "zero.png"
    proc = subprocess.run([*TFDIST, "bench", "zero", "--processes", "2", "--backend", "tf", "--width", "256",
                           "--proc-steps", "2", "--proc-batch-size", "16", "--proc-rounds", "1",
                           "--json", str(path), "--png", str(png)],
                          capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads(path.read_text())
    assert record["num_params"] == 1024 * 256 + 256 + 256 * 256 + 256 + 256 * 1024 + 1024
    for allocator in ("pooled", "returning"):
        for stage in ("0", "1", "2"):
            ranks = record["per_rank"][allocator][stage]
            assert sorted(r["rank"] for r in ranks) == [0, 1]
            assert all(r["allocator"] == allocator and r["peak_rss_bytes"] > 0 for r in ranks)
            # TF keeps allocator statistics only with oneDNN's allocator (the pooled one)
            assert all(bool(r["tf_step_peak_bytes"]) == (allocator == "pooled") for r in ranks)
            assert all(r["report"]["stage"] == int(stage) for r in ranks)
    theory = record["savings"]["1"]["theoretical_bytes"]
    assert theory == 8 * record["num_params"] / 2
    assert record["savings"]["1"]["ratio"] == pytest.approx(record["savings"]["1"]["measured_bytes"] / theory)
    assert png.stat().st_size > 0 and "peak RSS, returning" in proc.stdout
    # stage 3 once more with fsdp_prefetch=True (its step time, reported next to stage 3's)
    prefetched = record["per_rank"]["pooled"]["3_prefetch"]
    assert sorted(r["rank"] for r in prefetched) == [0, 1]
    assert all(r["prefetch"] and r["stage"] == 3 for r in prefetched)
    rounds = record["step_ms_rounds"]
    assert sorted(rounds) == ["0", "1", "2", "3", "3_prefetch"] and all(len(t) == 1 for t in rounds.values())
    assert rounds["3_prefetch"][0] == max(r["median_step_ms"] for r in prefetched) > 0
    assert all(r["save_seconds"] is not None for r in record["per_rank"]["pooled"]["0"])  # round 0 times the save
    assert "ZeRO-3 with fsdp_prefetch=True" in proc.stdout


def test_bench_zero_rounds_are_interleaved_and_summarised(monkeypatch):
    """`run_processes` over two rounds, with ranks that write what a real rank writes (step times made up):
    every variant launched once per round in ABBA order, ratios taken within a round, the median judged."""
    import argparse

    from benchmarks import processes, zero_procs

    launches = []

    def fake_run_workers(cmd, n, launcher, env):
        opts, i = {}, 3  # cmd: python -m benchmarks.zero_procs --name value ... --flag ...
        while i < len(cmd):
            takes_value = i + 1 < len(cmd) and not cmd[i + 1].startswith("--")
            opts[cmd[i]] = cmd[i + 1] if takes_value else True
            i += 2 if takes_value else 1
        stage, allocator, round_ = int(opts["--stage"]), opts["--allocator"], int(opts["--round"])
        prefetch = "--prefetch" in opts
        launches.append((stage, prefetch, allocator, round_))
        step = 10.0 * (1 + stage / 10 + (0.05 if prefetch else 0)) * (1 + round_)  # round 1: a slower machine
        for rank in range(n):
            record = {"rank": rank, "stage": stage, "allocator": allocator, "prefetch": prefetch, "round": round_,
                      "peak_rss_bytes": (400 - 50 * stage) * 2**20, "tf_step_peak_bytes": 2**20 if allocator ==
                      "pooled" else None, "median_step_ms": step + rank, "num_params": 1000,
                      "save_seconds": None if round_ else 0.1}
            tag = f"stage{stage}{'_prefetch' if prefetch else ''}_{allocator}_round{round_}"
            with open(os.path.join(opts["--out"], f"{tag}_rank{rank}.json"), "w") as f:
                json.dump(record, f)
        return 0

    monkeypatch.setattr(processes, "run_workers", fake_run_workers)
    args = argparse.Namespace(backend="tf", processes=2, width=8, proc_steps=2, proc_batch_size=16, proc_rounds=2)
    record = zero_procs.run_processes(args)
    pooled = [(s, p, r) for s, p, a, r in launches if a == "pooled"]
    keys = [(0, False), (1, False), (2, False), (3, False), (3, True)]
    assert pooled == [(*k, 0) for k in keys] + [(*k, 1) for k in reversed(keys)]  # ABBA
    assert [(s, a) for s, p, a, r in launches if a == "returning"] == [(s, "returning") for s in range(4)]
    rounds = record["step_ms_rounds"]
    assert sorted(rounds, key=str) == sorted([0, 1, 2, 3, "3_prefetch"], key=str)
    assert all(len(t) == 2 for t in rounds.values())
    assert rounds[0] == [11.0, 21.0]  # the slowest rank's median step, per round
    for key in (1, 2, 3, "3_prefetch"):
        ratios = [t / t0 for t, t0 in zip(rounds[key], rounds[0])]
        assert record["step_ratio_rounds"][key] == pytest.approx(ratios)
        assert record["step_ratio_spread"][key] == pytest.approx(
            {"median": sum(ratios) / 2, "min": min(ratios), "max": max(ratios), "rounds": 2})
    assert record["savings"][3]["prefetch_step_ratio_to_stage0"] == record["step_ratio_spread"]["3_prefetch"]["median"]
    assert record["median_step_ms_stage3_prefetch"] == pytest.approx(sum(rounds["3_prefetch"]) / 2)
    assert record["per_rank"]["pooled"][0][0]["round"] == 0  # per_rank keeps round 0's ranks (the save is timed)


def test_bench_allreduce_horovod_without_its_module_is_a_clear_error(monkeypatch):
    import argparse
    import builtins

    from benchmarks import allreduce
    from tfdist.errors import ConfigError

    real_import = builtins.__import__

    def no_horovod(name, *args, **kwargs):
        if name == "benchmarks.allreduce_horovod":
            raise ImportError("No module named 'benchmarks.allreduce_horovod'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(allreduce.importlib, "import_module", lambda name: no_horovod(name))
    args = argparse.Namespace(backend="horovod", sizes_mb=[1.0], iters=3, warmup=1, num_workers=2, json=None)
    with pytest.raises(ConfigError, match="--backend horovod needs"):
        allreduce.run(args)


def test_bench_allreduce_horovod_backend_compares_engines_side_by_side(tmp_path):
    path = tmp_path / "allreduce_horovod.json"
    proc = subprocess.run([*TFDIST, "bench", "allreduce", "--backend", "horovod", "--sizes-mb", "1", "--iters", "2",
                           "--rounds", "1", "--no-gloo", "--json", str(path)],
                          capture_output=True, text=True, env=ENV, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads(path.read_text())
    assert record["backend"] == "horovod" and record["ranks"] == 2
    # mpi4py alone is timed before Horovod starts; beside it, while Horovod's thread negotiates
    assert set(record["results"]) == {"horovod-mpi", "horovod-step-mpi", "strategy-mpi", "mpi4py",
                                      "mpi4py-beside-horovod"}
    assert all(r["1"]["busbw_gbps"] > 0 and r["1"]["samples"] == 2 for r in record["results"].values())
    assert all(r["1"]["round_busbw_gbps"]["rounds"] == 1 for r in record["results"].values())
    ratio = record["ratios"]["strategy/horovod (mpi)"]["1"]
    assert ratio == pytest.approx(record["results"]["strategy-mpi"]["1"]["busbw_gbps"]
                                  / record["results"]["horovod-mpi"]["1"]["busbw_gbps"])
    assert record["horovod_step_over_mpi4py_1mb"] == pytest.approx(
        record["results"]["horovod-step-mpi"]["1"]["busbw_gbps"] / record["results"]["mpi4py"]["1"]["busbw_gbps"])


def test_cli_launch_backend_horovod_runs_tfdist_train_end_to_end(tmp_path):
    pytest.importorskip("horovod.tensorflow")
    out = tmp_path / "out"
    proc = subprocess.run([*TFDIST, "launch", "-n", "2", "--backend", "horovod", "--", *TFDIST, "train", "--strategy",
                           "horovod", "--dataset", "digits", "--epochs", "2", "--verbose", "0",
                           "--json", str(out / "run.json")], capture_output=True, text=True, env=ENV, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert os.listdir(out) == ["run.json"]  # the chief wrote it, once
    record = json.loads((out / "run.json").read_text())
    assert record["strategy"] == "horovod" and record["replicas"] == 2  # 2 processes through Gloo
    digests = [line.split()[-1] for line in proc.stdout.splitlines() if "final weights sha256" in line]
    assert len(digests) == 2 and digests[0] == digests[1], proc.stdout[-3000:]
