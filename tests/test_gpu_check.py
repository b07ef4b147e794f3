"""`make gpu-check` (benchmarks/gpu_check.py) kept ready without a GPU: it refuses cleanly on this machine, and its
checks all pass on logical CPUs (`--cpu N`), each configuration against one device."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_check

ROOT = Path(__file__).resolve().parents[1]  # the clone: `python -m benchmarks` runs from it


def args(**over) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    gpu_check.add_arguments(p)
    return argparse.Namespace(**{**vars(p.parse_args([])), **over})


def test_without_a_gpu_it_refuses_before_tensorflow_and_names_the_fix(monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpu_check.run(args()) == 2
    err = capsys.readouterr().err
    assert "no NVIDIA GPU" in err and "tensorflow[and-cuda]" in err and "--cpu N" in err


@pytest.mark.slow
def test_every_configuration_equals_one_device_on_logical_cpus(tmp_path):
    """As `make gpu-check` runs it, in its own process (`python -m benchmarks gpu-check`): fifteen strategies built
    and trained one after another need a TensorFlow of their own, not the pytest worker's."""
    out = tmp_path / "gpu_check.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks", "gpu-check", "--cpu", "2", "--width", "16",
                          "--batch-size", "16", "--steps", "2", "--json", str(out)], capture_output=True, text=True,
                         timeout=600, cwd=ROOT, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["configuration"] for r in rows] == [
        "one device", "Mirrored, all-reduce default", "ZeRO-1, offload", "ZeRO-2, offload", "ZeRO-3",
        "tensor parallel 1 x N", "pipeline, N stages", "one device, bfloat16", "Mirrored, bfloat16",
        "ZeRO-3, bfloat16", "tensor parallel, bfloat16", "pipeline, bfloat16", "one device, float16",
        "Mirrored, float16", "logical devices, non-NCCL"]
    assert all(r["equal"] and r["relative_diff"] <= r["tolerance"] for r in rows), rows
    assert {r["replicas"] for r in rows if r["configuration"].startswith(("Mirrored", "ZeRO"))} == {2}
    assert all(r["samples_per_s"] > 0 and r["step_ms"] > 0 for r in rows)
    assert "gpu-check on 2 logical CPUs (not a GPU figure)" in run.stdout
