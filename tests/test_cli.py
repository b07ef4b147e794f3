"""The `tfdist` command: the main job's outputs and accuracy, the overhead benchmark, bad names."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def tfdist_cmd(*args: str, cwd=None, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    return subprocess.run([sys.executable, "-m", "tfdist", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env=env)


@pytest.mark.parametrize("args, message", [
    (["train", "--strategy", "bogus"], "argument --strategy: invalid choice: 'bogus'"),
    (["train", "--dataset", "cifar10"], "argument --dataset: invalid choice: 'cifar10'"),
    (["train", "--epochs", "0"], "--epochs must be >= 1"),
    (["train", "--replicas", "3", "--batch-size", "64"], "--batch-size 64 does not split evenly over --replicas 3"),
    (["train", "--replicas", "0"], "--replicas must be >= 1 (or left out: every local GPU, or one CPU), got 0."),
    (["train", "--save", "model.h5"], "--save must name a .keras file"),
])
def test_bad_input_exits_2_with_a_named_parameter(args, message):
    proc = tfdist_cmd(*args)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    if "--strategy" in args:
        assert "'mirrored'" in proc.stderr and "'ps'" in proc.stderr  # argparse lists the choices


@pytest.mark.parametrize("option", ["--save", "--json", "--plot", "--backup-dir"])
def test_unwritable_output_paths_are_refused_before_training(tmp_path, option):
    """A path below a regular file fails at once, naming the option, instead of after the whole run."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    target = blocker / ("out.keras" if option == "--save" else "out")
    proc = tfdist_cmd("train", option, str(target), "--epochs", "1", timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"{option} {target}: {blocker} is a file, not a directory" in proc.stderr
    assert "Traceback" not in proc.stderr and "Epoch 1" not in proc.stdout


def test_an_output_that_fails_after_training_is_rescued_not_lost(tmp_path, capsys):
    from tfdist.cli.outputs import write_or_rescue

    def write(path):
        if "tfdist-rescued-" not in path:
            raise PermissionError(13, "Permission denied")
        with open(path, "w") as f:
            f.write("the result")

    where = write_or_rescue(str(tmp_path / "run.json"), write, "the run record")
    assert where != str(tmp_path / "run.json") and open(where).read() == "the result"
    assert f"could not write the run record to {tmp_path / 'run.json'} (Permission denied); wrote it to {where}" \
        in capsys.readouterr().err


def test_help_lists_commands_without_starting_tensorflow():
    proc = tfdist_cmd("--help")
    assert proc.returncode == 0 and "train" in proc.stdout and "bench" in proc.stdout


def test_short_run_writes_json_plot_and_model(tmp_path):
    proc = tfdist_cmd("train", "--dataset", "digits", "--replicas", "2", "--epochs", "2", "--batch-size", "32",
                      "--verbose", "0", "--json", "out/run.json", "--plot", "out/curves.png",
                      "--save", "out/cnn.keras", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    record = json.loads((tmp_path / "out/run.json").read_text())
    assert record["strategy"] == "mirrored" and record["replicas"] == 2 and record["epochs"] == 2
    assert len(record["history"]["loss"]) == 2 and len(record["history"]["val_accuracy"]) == 2
    assert record["images_per_sec"] > 0 and 0.0 <= record["test_accuracy"] <= 1.0
    assert (tmp_path / "out/curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "out/cnn.keras").stat().st_size > 0


@pytest.mark.slow
def test_main_job_reaches_90_percent_on_mnist_in_5_epochs(tmp_path):
    proc = tfdist_cmd("train", "--strategy", "mirrored", "--replicas", "4", "--epochs", "5", "--dataset", "mnist",
                      "--verbose", "2", "--json", "run.json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["replicas"] == 4 and record["test_accuracy"] >= 0.90, record["test_accuracy"]
    assert "Epoch 5/5" in proc.stdout


@pytest.mark.slow
def test_overhead_benchmark_measures_both_strategies(tmp_path):
    proc = tfdist_cmd("bench", "overhead", "--replicas", "2", "--steps", "3", "--rounds", "2", "--json", "o.json",
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    record = json.loads((tmp_path / "o.json").read_text())
    results = record["results"]
    assert set(results) == {"tfdist.MirroredStrategy", "tf.distribute.MirroredStrategy"}
    assert all(r["steps_timed"] == 2 * 3 and r["median_step_ms"] > 0 for r in results.values())
    assert record["ratio"] == pytest.approx(results["tfdist.MirroredStrategy"]["median_step_ms"]
                                            / results["tf.distribute.MirroredStrategy"]["median_step_ms"])
    assert "ratio tfdist / stock" in proc.stdout
