"""`tfdist bench network-scaling`: its argument checks, its arithmetic, and a small run on emulated nodes (root only).
No timed asserts: the figures are judged in docs/benchmarks.md from a full run."""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from benchmarks import network_scaling
from benchmarks.network_scaling_job import model_for
from tfdist.data_parallel.powersgd import PowerSGD
from tfdist.errors import ConfigError

PROBLEM = network_scaling._problem()
needs_root = pytest.mark.skipif(PROBLEM is not None, reason=f"no emulated nodes or CPU quotas here: {PROBLEM}")


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    network_scaling.add_arguments(p)
    return p.parse_args(list(argv))


def test_defaults_are_the_issues_setting_and_bad_options_are_config_errors():
    args = _args()
    assert (args.nodes, args.rates, args.variants) == ([2, 4], ["1gbit", "10gbit"], list(network_scaling.VARIANTS))
    assert args.bucket_cap_mb == 25.0 and args.powersgd_rank == 4 and args.rounds >= 5
    assert sum(int(np.prod(w.shape)) for w in model_for(args.dense_units).trainable_weights) >= 10_000_000
    network_scaling._check(args)
    for argv, match in ((["--nodes", "1"], "--nodes must list node counts >= 2"),
                        (["--rates", "fast"], "link rate must look like"),
                        (["--cpus-per-node", "0"], "--cpus-per-node must be between"),
                        (["--steps", "0"], "--steps must be >= 1"),
                        (["--bucket-cap-mb", "0"], "--bucket-cap-mb must be > 0")):
        with pytest.raises(ConfigError, match=match):
            network_scaling._check(_args(*argv))


def _job(nodes: int, rate: str | None, plain: list[float], fp16: list[float]) -> dict:
    variant = {"step_ms": [float(nodes // 2 + 1)], "buckets": 1, "gradient_bytes": 400, "trace": {"steps": 2, "comm_ms": 8.0,
                                                                                  "hidden_fraction": 0.25}}
    return {"nodes": nodes, "rate": rate, "parameters": 100, "load_average": {}, "job_seconds": 1.0,
            "cpus_used": [0.5] * nodes,
            "variants": {"plain": {**variant, "images_per_sec": plain, "sent_bytes": 400},
                         "fp16": {**variant, "images_per_sec": fp16, "sent_bytes": 200}}}


def test_efficiency_is_images_per_second_over_n_times_the_one_node_plain_median():
    jobs = [_job(1, None, [100, 90, 110], [80, 80, 80]), _job(4, "1gbit", [200, 300, 100], [320, 330, 310])]
    result = network_scaling.summarize(jobs, _args())
    one, four = result["jobs"]
    assert one["variants"]["plain"]["efficiency"] == 1.0 and one["variants"]["fp16"]["efficiency"] == 0.8
    assert one["variants"]["plain"]["communication_ms"] is None  # one node: nothing to communicate
    plain, fp16 = four["variants"]["plain"], four["variants"]["fp16"]
    assert plain["images_per_sec"] == {"median": 200, "min": 100, "max": 300, "rounds": 3}
    assert plain["efficiency"] == 200 / (4 * 100) and fp16["efficiency"] == 320 / (4 * 100)
    assert fp16["efficiency_vs_own_1_node"] == 320 / (4 * 80)
    assert (fp16["communication_ms"], fp16["hidden_fraction"], fp16["bytes_cut"]) == (8.0, 0.25, 2.0)
    assert four["variants"]["plain"]["exposed_ms"] == 3.0 - 1.0  # step ms at 4 nodes - at 1 node


@pytest.mark.slow  # ~2-4 min: a 1-node and a 2-node job of a small CNN, four variants each
@needs_root
def test_a_small_run_on_two_emulated_nodes_writes_its_record(tmp_path):
    out, png = tmp_path / "ns.json", tmp_path / "ns.png"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tfdist", "bench", "network-scaling", "--nodes", "2", "--rates", "1gbit",
         "--dense-units", "64", "--batch-size", "16", "--steps", "1", "--rounds", "2", "--profile-steps", "2",
         # 1 CPU per node instead of the default 0.5: the quota is applied from start-up on (each node imports
         # TensorFlow under it), and nothing checked here depends on its size
         "--cpus-per-node", "1", "--json", str(out), "--png", str(png)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "fixed amount of compute" in stdout and png.stat().st_size > 0
    record = json.loads(out.read_text())
    assert [(j["nodes"], j["rate"]) for j in record["jobs"]] == [(1, None), (2, "1gbit")]
    model = model_for(64)
    full = 4 * sum(int(np.prod(w.shape)) for w in model.trainable_weights)
    hook = PowerSGD(rank=4)
    views = [hook.compressed(tf.TensorShape(w.shape)) for w in model.trainable_weights]
    powersgd = 4 * sum(int(np.prod(w.shape)) if v is None else (v[0] + v[1]) * 4
                       for w, v in zip(model.trainable_weights, views))
    for job in record["jobs"]:
        assert len(job["cpus_used"]) == job["nodes"] and all(c > 0 for c in job["cpus_used"])
        v = job["variants"]
        assert {name: (x["gradient_bytes"], x["sent_bytes"]) for name, x in v.items()} == {
            "plain": (full, full), "buckets": (full, full), "fp16": (full, full // 2), "powersgd": (full, powersgd)}
        for x in v.values():
            assert x["images_per_sec"]["rounds"] == 2 and x["images_per_sec"]["min"] > 0
            assert x["efficiency"] > 0
    for name, x in record["jobs"][1]["variants"].items():  # node 0's trace saw its gradient collectives
        assert x["communication_ms"] > 0 and 0 <= x["hidden_fraction"] <= 1, (name, x)
    # node 0's CPU per step by thread: with peers, the collective executor's or gRPC's I/O threads worked too
    peers = {g for x in record["jobs"][1]["variants"].values() for g, s in x["thread_cpu_s_per_step"].items() if s > 0}
    assert peers & {"collective_ops", "event_engine"}, peers
    for job in record["jobs"]:
        assert all(sum(x["thread_cpu_s_per_step"].values()) > 0 for x in job["variants"].values())
    # Its cgroups (named after the benchmark's process) and emulated nodes are gone.
    assert not glob.glob(f"/sys/fs/cgroup/*/tfdist-straggler-{proc.pid}")
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert f"tfdnode{proc.pid % 100000}-" not in namespaces
