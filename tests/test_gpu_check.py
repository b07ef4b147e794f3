"""`make gpu-check` (benchmarks/gpu_check.py) kept ready without a GPU: it refuses cleanly on this machine, and its
checks all pass on logical CPUs (`--cpu N`), each configuration against one device."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import gpu_check


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
def test_every_configuration_equals_one_device_on_logical_cpus(tmp_path, capsys):
    out = tmp_path / "gpu_check.json"
    assert gpu_check.run(args(cpu=2, width=16, batch_size=16, steps=2, json=str(out))) == 0, capsys.readouterr()
    rows = json.loads(out.read_text())["rows"]
    assert [r["configuration"] for r in rows] == [
        "one device", "Mirrored, all-reduce default", "ZeRO-1, offload", "ZeRO-2, offload", "ZeRO-3",
        "tensor parallel 1 x N", "pipeline, N stages", "one device, bfloat16", "Mirrored, bfloat16",
        "ZeRO-3, bfloat16", "tensor parallel, bfloat16", "pipeline, bfloat16", "one device, float16",
        "Mirrored, float16", "logical devices, non-NCCL"]
    assert all(r["equal"] and r["relative_diff"] <= r["tolerance"] for r in rows), rows
    assert {r["replicas"] for r in rows if r["configuration"].startswith(("Mirrored", "ZeRO"))} == {2}
    assert all(r["samples_per_s"] > 0 and r["step_ms"] > 0 for r in rows)
    assert "gpu-check on 2 logical CPUs (not a GPU figure)" in capsys.readouterr().out
