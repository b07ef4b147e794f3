"""tfdist.ParameterServerStrategy: Keras 3 fit/evaluate/predict with variables on parameter servers.

Real jobs (slow): 1 chief + 2 workers + 2 parameter servers as processes on loopback, through the launcher.
Bad input (fast): the cluster checks happen before TensorFlow connects to anything.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import tfdist
from tfdist.cluster.launcher import launch
from tfdist.cluster.ports import free_ports

JOB = str(Path(__file__).with_name("ps_job.py"))
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}
# The tests read their processes' CPU time by PID: fresh processes, no stand-ins.
pytestmark = pytest.mark.usefixtures("fresh_processes")


class _Lines(io.TextIOBase):
    """The launcher's output, kept, with a hook called on every line."""

    def __init__(self, on_line=None):
        self.lines: list[str] = []
        self.on_line = on_line

    def write(self, text: str) -> int:
        for line in text.splitlines():
            self.lines.append(line)
            if self.on_line:
                self.on_line(line)
        return len(text)


def _job(tmp_path: Path, epochs: int, on_line=None, on_start=None, backup: Path | None = None) -> tuple[int, dict, str]:
    out = _Lines(on_line)
    extra = [str(backup)] if backup else []
    code = launch([sys.executable, JOB, str(tmp_path), str(epochs), *extra], 2, ps=2, out=out, env=ENV,
                  on_start=on_start, timeout_s=400)
    log = "\n".join(out.lines)
    result_file = tmp_path / "result.json"
    return code, (json.loads(result_file.read_text()) if result_file.exists() else {}), log


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.fixture(scope="module")
def killed_worker_job(tmp_path_factory):
    """One 9-epoch job on 2 workers and 2 servers in which worker 0 is SIGKILLed after epoch 0, restarted and
    rejoins. Shared (a job of 5 TF processes costs ~30 s): the restart test reads the recovery from it, and the
    training test its accuracy, shards, errors and saved model, which a completed job must have whether or
    not a worker was lost on the way (that is what asynchronous training promises)."""
    # 9 epochs: the restarted worker (1 s back-off + TF start-up) must have epochs left to take steps in
    tmp_path = tmp_path_factory.mktemp("ps_killed_worker")
    holder: dict = {}
    killed = threading.Event()
    cpu: dict[str, float] = {}

    def on_line(line: str) -> None:
        if "ps_job: epoch 0 done" in line and not killed.is_set():
            killed.set()
            os.kill(holder["procs"][1].pid, signal.SIGKILL)  # worker 0 (order: chief, workers, parameter servers)
        elif killed.is_set() and line.startswith("[worker 0] [tfdist] worker 0 serving at"):
            cpu["rejoined"] = _cpu_seconds(holder["procs"][1].pid)  # the restarted process, ready to serve
            cpu["rejoined_at"] = time.monotonic()
        elif line.startswith("[chief] ps_job: epoch 8 done"):
            cpu["end"] = _cpu_seconds(holder["procs"][1].pid)
            cpu["end_at"] = time.monotonic()

    code, result, log = _job(tmp_path, epochs=9, on_line=on_line, on_start=lambda procs: holder.setdefault("procs", procs))
    return tmp_path, killed, cpu, code, result, log


@pytest.mark.slow
def test_async_training_on_two_servers_learns_mnist_and_saves_a_plain_keras_model(killed_worker_job):
    tmp_path, _, _, code, result, log = killed_worker_job
    assert code == 0, log[-3000:]
    assert result["history"]["val_accuracy"][2] >= 0.90, result["history"]  # after 3 epochs (the test split)
    assert result["test_accuracy"] >= 0.90, result["history"]
    assert result["worker_eval_accuracy"] >= 0.90
    # Workers update the metrics on the servers at once: each update is one AssignAdd there (Keras' own
    # read-add-assign lost updates; the accuracy then came out far too low)
    assert result["test_step_writes"] == ["AssignAddVariableOp"], result["test_step_writes"]
    # Variables live on the parameter servers; the big kernels (and their Adam slots) are split over both.
    shards = result["shards"]
    assert all(d.startswith("/job:ps/") for devices in shards.values() for d in devices)
    for name in ("cnn/dense1/kernel", "adam/cnn_dense1_kernel_momentum", "adam/cnn_dense1_kernel_velocity"):
        assert sorted(shards[name]) == ["/job:ps/replica:0/task:0/device:CPU:0",
                                        "/job:ps/replica:0/task:1/device:CPU:0"], (name, shards[name])
    # An embedding table split over both servers (rows 0-1999 and 2000-3999), its Adam slots split the same
    # way; training updates exactly the rows the batches used (sparse gradients, joined per shard).
    embedding = result["embedding"]
    both = [((2000, 32), "/job:ps/replica:0/task:0/device:CPU:0"), ((2000, 32), "/job:ps/replica:0/task:1/device:CPU:0")]
    assert sorted((tuple(shape), device) for shape, device in embedding["shards"]) == both
    assert sorted((tuple(shape), device) for shape, device in embedding["slot_shards"]) == sorted(both * 2)
    assert np.isfinite(embedding["loss"]).all()
    assert 0 < embedding["changed_rows"] <= embedding["used_rows"]
    # Bad input to fit: clear errors with the fix.
    assert "must be a dataset function" in result["errors"]["dataset"]
    assert "def dataset_fn(input_context)" in result["errors"]["dataset"]
    assert "steps_per_epoch=" in result["errors"]["no_steps"]
    # tfdist.data given this strategy: a dataset function with one pass over the 1438 digits at 32 per step.
    helper = result["helper"]
    assert helper["callable"] and helper["steps_per_epoch"] == 45
    assert len(helper["history"]["loss"]) == len(helper["history"]["val_loss"]) == 1
    assert np.isfinite(helper["history"]["loss"] + helper["history"]["val_loss"]).all()
    # The chief's CNN and its optimizer against the same ones trained in plain Keras (tests/twins.py).
    assert result["twin"] == [], result["twin"]

    # The .keras file loads in plain Keras and under MirroredStrategy, with the chief's accuracy.
    import keras

    arrays = tfdist.data.load_arrays("mnist")
    plain = keras.saving.load_model(tmp_path / "model.keras")
    _, accuracy = plain.evaluate(arrays.x_test, arrays.y_test, verbose=0)
    assert accuracy == pytest.approx(result["test_accuracy"], abs=1e-6)
    assert plain.predict(arrays.x_test[:8], verbose=0).argmax(1).tolist() == result["predict"]
    strategy = tfdist.MirroredStrategy(devices=["/cpu:0", "/cpu:1"])
    with strategy.scope():
        mirrored = keras.saving.load_model(tmp_path / "model.keras")
    for a, b in zip(plain.get_weights(), mirrored.get_weights()):
        np.testing.assert_array_equal(a, b)
    _, mirrored_accuracy = mirrored.evaluate(arrays.x_test, arrays.y_test, verbose=0)
    assert mirrored_accuracy == pytest.approx(accuracy, abs=1e-6)


@pytest.mark.slow
def test_a_worker_killed_mid_training_is_restarted_rejoins_and_the_job_completes(killed_worker_job):
    _, killed, cpu, code, result, log = killed_worker_job
    assert killed.is_set(), log[-3000:]
    assert code == 0, log[-3000:]
    assert "worker 0 was killed by SIGKILL; restarting it in 1 s (1/3)" in log
    assert log.count("[worker 0] [tfdist] worker 0 serving at") == 2  # restarted with the same TF_CONFIG
    # It rejoined: the coordinator says so, and ran steps on it (an idle TF server uses almost no CPU).
    assert "Worker /job:worker/replica:0/task:0 has been recovered" in log
    # An idle TF server spends about 0.005 CPU-s per second (0.047 in 10 s, measured); on a loaded machine the
    # rejoined worker may get only a few steps before the end (one run: 0.48 s), so the bar is three times idle,
    # and at least 0.25 s.
    idle = 0.005 * (cpu["end_at"] - cpu["rejoined_at"])
    assert cpu["end"] - cpu["rejoined"] > max(0.25, 3 * idle), cpu
    assert result["test_accuracy"] >= 0.90, result["history"]
    assert len(result["history"]["loss"]) == 9


@pytest.mark.slow
def test_a_lost_parameter_server_stops_the_job_clearly_and_a_rerun_resumes_from_the_backup(tmp_path):
    holder: dict = {}
    killed = threading.Event()
    backup = tmp_path / "backup"

    def on_line(line: str) -> None:
        if "ps_job: epoch 1 done" in line and not killed.is_set():  # after the backup of epoch 2
            killed.set()
            os.kill(holder["procs"][3].pid, signal.SIGKILL)  # ps 0 (order: chief, 2 workers, ps 0, ps 1)

    code, result, log = _job(tmp_path, epochs=4, on_line=on_line, backup=backup,
                             on_start=lambda procs: holder.setdefault("procs", procs))
    assert killed.is_set(), log[-3000:]
    assert code == 1, log[-3000:]
    assert "ParameterServerLost: a parameter server stopped answering" in log
    assert "ps 0 was killed by SIGKILL; parameter servers are not restarted" in log
    assert not result  # the chief stopped before writing its result
    assert (backup / "epoch-2").is_dir()
    # A tf.train.Checkpoint, each server's shards in its own data file, not a .weights.h5 read whole by the chief.
    files = sorted(p.name for p in (backup / "epoch-2").iterdir())
    assert "state.index" in files and "state.weights.h5" not in files, files

    code, result, log = _job(tmp_path, epochs=4, backup=backup)  # the same command again
    assert code == 0, log[-3000:]
    assert "restored" in log and "resuming at epoch 3" in log
    assert len(result["history"]["loss"]) == 2  # epochs 3 and 4 only
    assert result["test_accuracy"] >= 0.90, result["history"]


def _tf_config(monkeypatch, cluster: dict, task_type: str = "chief") -> None:
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": task_type, "index": 0}}))


def _addresses(n: int) -> list[str]:
    return [f"localhost:{p}" for p in free_ports(n)]


def test_a_cluster_without_parameter_servers_is_named(monkeypatch):
    chief, worker = _addresses(2)
    _tf_config(monkeypatch, {"chief": [chief], "worker": [worker]})
    with pytest.raises(tfdist.ConfigError, match=r"has no ps job.*tfdist launch -n 2 --ps 1"):
        tfdist.ParameterServerStrategy()


def test_a_cluster_without_chief_is_named(monkeypatch):
    worker, ps = _addresses(2)
    _tf_config(monkeypatch, {"worker": [worker], "ps": [ps]}, task_type="worker")
    with pytest.raises(tfdist.ConfigError, match=r"has no chief job"):
        tfdist.ParameterServerStrategy()


def test_no_tf_config_says_how_to_start_the_job(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(tfdist.ConfigError, match=r"tfdist launch -n 2 --ps 1"):
        tfdist.ParameterServerStrategy()


def test_a_parameter_server_that_never_comes_up_is_a_clear_error_not_a_hang(monkeypatch):
    chief, worker, ps = _addresses(3)  # nothing listens on these ports
    _tf_config(monkeypatch, {"chief": [chief], "worker": [worker], "ps": [ps]})
    with pytest.raises(tfdist.ConfigError, match=rf"not answering after connect_timeout_s=1 s: ps 0 at {ps}"):
        tfdist.ParameterServerStrategy(connect_timeout_s=1)


@pytest.mark.parametrize("option", ["zero_stage", "offload", "stages"])
def test_sharding_and_placement_options_are_refused_with_the_reason(option):
    with pytest.raises(tfdist.ConfigError, match=rf"does not take {option}=: "):
        tfdist.ParameterServerStrategy(**{option: 1})


def test_a_bad_partitioner_is_named(monkeypatch):
    from tfdist.strategies.parameter_server import _partitioner

    with pytest.raises(tfdist.ConfigError, match="variable_partitioner must be"):
        _partitioner("even", 1024, 2)


@pytest.mark.slow
def test_tfdist_train_with_the_ps_strategy_through_the_launcher(tmp_path):
    tfdist_cli = str(Path(sys.executable).with_name("tfdist"))
    out = _Lines()
    code = launch([tfdist_cli, "train", "--strategy", "ps", "--epochs", "2", "--steps-per-epoch", "40",
                   "--verbose", "2", "--json", str(tmp_path / "run.json"), "--save", str(tmp_path / "m.keras"),
                   "--backup-dir", str(tmp_path / "backup")], 2, ps=1, out=out, env=ENV, timeout_s=300)
    log = "\n".join(out.lines)
    assert code == 0, log[-3000:]
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["strategy"] == "ps" and len(record["history"]["val_accuracy"]) == 2
    assert record["test_accuracy"] >= 0.85
    assert (tmp_path / "m.keras").is_file()
    assert not (tmp_path / "backup").exists()  # removed after a successful run
