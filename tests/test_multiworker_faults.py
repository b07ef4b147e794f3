"""Faults with real processes and real signals: a killed worker, resume to identical weights, peers that
never start, and strategies created too late."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from tfdist.cluster.launcher import launch
from tfdist.cluster.backends import TFConfigBackend

pytestmark = pytest.mark.slow

EPOCHS = 6

TRAIN = textwrap.dedent('''
    import os, sys
    import numpy as np
    out, backup_dir, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3])
    import tfdist
    strategy = tfdist.MultiWorkerMirroredStrategy(timeout_s=30)
    import keras
    import tensorflow as tf
    from tfdist.training import BackupAndRestore

    rank = tfdist.cluster.rank(strategy)
    print("PID", os.getpid(), flush=True)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype("float32")
    y = (np.sin(x @ rng.normal(size=(8, 1)))).astype("float32")
    order = tfdist.data.EpochOrder(seed=3)  # epoch N's order depends on (seed, N) only
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    train = order.apply(tf.data.Dataset.from_tensor_slices((x, y))).batch(32).with_options(options)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((8,)),
            keras.layers.Dense(32, activation="relu", kernel_initializer=keras.initializers.GlorotUniform(1)),
            keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(2)),
        ])
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")  # optimizer state must resume too
    backup = BackupAndRestore(backup_dir, strategy=strategy)
    ran = []

    class Log(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):  # after the backup: the chief has saved this epoch
            ran.append(epoch)
            print("EPOCH_END", epoch, flush=True)

    model.fit(train, epochs=epochs, verbose=0, callbacks=[order, backup, Log()])
    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    np.save(os.path.join(out, f"weights-rank{rank}.npy"), weights)
    print("RESULT", {"restored": backup.restored_epoch, "ran": ran}, flush=True)
''')


def _launch(cmd: list[str], n: int = 2) -> tuple[int, str]:
    out = io.StringIO()
    rc = launch(cmd, n, out=out, timeout_s=240, env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    return rc, out.getvalue()


def _result(log: str, rank: int) -> dict:
    line = next(line for line in log.splitlines() if line.startswith(f"[{rank}] RESULT"))
    return eval(line.split("RESULT", 1)[1])  # a dict literal printed by the job


def test_kill_a_worker_then_resume_to_identical_weights(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)

    # 1. The uninterrupted run.
    clean = tmp_path / "clean"
    clean.mkdir()
    rc, log = _launch([sys.executable, str(script), str(clean), str(tmp_path / "clean-backup"), str(EPOCHS)])
    assert rc == 0, log[-3000:]
    assert _result(log, 0) == {"restored": None, "ran": list(range(EPOCHS))}
    assert not (tmp_path / "clean-backup").exists()  # deleted by the chief after success

    # 2. Two workers started directly (no launcher to stop them): SIGKILL worker 1 after epoch 2.
    #    Worker 0 must fail on its own, within 60 s, naming the lost task.
    run = tmp_path / "run"
    run.mkdir()
    backup = tmp_path / "backup"
    with TFConfigBackend().environments(2, 1) as envs:
        procs = [subprocess.Popen([sys.executable, str(script), str(run), str(backup), str(EPOCHS)],
                                  env={**os.environ, **e, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for e in envs]
    try:
        lines: list[str] = []
        killed_at = None
        for line in procs[0].stdout:
            lines.append(line)
            if line.startswith("EPOCH_END 1"):
                procs[1].send_signal(signal.SIGKILL)
                killed_at = time.monotonic()
                break
        assert killed_at is not None, "".join(lines)[-3000:]
        rest = threading.Thread(target=lambda: lines.extend(procs[0].stdout), daemon=True)
        rest.start()
        code = procs[0].wait(timeout=90)
        seconds = time.monotonic() - killed_at
        rest.join(timeout=10)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            p.stdout.close()
    text = "".join(lines)
    message = next((line for line in lines if "tfdist: error:" in line), "")
    print(f"\nworker 0 exited with {code} {seconds:.1f} s after worker 1 was killed: {message.strip()}")
    assert code != 0 and seconds < 60, (code, seconds, text[-3000:])
    assert "lost /job:worker/replica:0/task:1" in text, text[-3000:]
    assert "Traceback" not in text  # one clear line, not TensorFlow's deep traceback
    saved = sorted(os.listdir(backup))
    assert len(saved) == 1 and saved[0].startswith("epoch-")
    epochs_done = int(saved[0].split("-")[1])
    assert 2 <= epochs_done < EPOCHS

    # 3. Relaunch the same command: it resumes after the last finished epoch and ends where run 1 did.
    rc, log = _launch([sys.executable, str(script), str(run), str(backup), str(EPOCHS)])
    assert rc == 0, log[-3000:]
    for rank in (0, 1):
        assert _result(log, rank) == {"restored": epochs_done, "ran": list(range(epochs_done, EPOCHS))}
    reference = np.load(clean / "weights-rank0.npy")
    for rank in (0, 1):
        assert np.abs(np.load(run / f"weights-rank{rank}.npy") - reference).max() <= 1e-6
    assert f"resuming at epoch {epochs_done + 1}" in log


def test_a_peer_that_never_starts_gives_a_clear_error(tmp_path):
    # One cluster of 2, but only one process is started: as the leader (task 0) and as task 1.
    code = "import tfdist; tfdist.MultiWorkerMirroredStrategy(timeout_s=3)"
    with TFConfigBackend().environments(2, 1) as envs:
        cluster = json.loads(envs[0]["TF_CONFIG"])["cluster"]["worker"]
        procs = {i: subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **envs[i],
                                                                        "TF_CPP_MIN_LOG_LEVEL": "3"},
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in (0,)}
    with TFConfigBackend().environments(2, 1) as envs2:
        procs[1] = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **envs2[1],
                                                                       "TF_CPP_MIN_LOG_LEVEL": "3"},
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        cluster2 = json.loads(envs2[1]["TF_CONFIG"])["cluster"]["worker"]
    try:
        outputs = {i: p.communicate(timeout=90) for i, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    for i, (peer, addresses) in {0: (1, cluster), 1: (0, cluster2)}.items():
        err = outputs[i][1]
        assert procs[i].returncode != 0
        assert "ConfigError" in err and "could not form the cluster of 2 workers within timeout_s=3 s" in err, err
        assert f"/job:worker/replica:0/task:{peer} at {addresses[peer]}" in err, err


def test_strategy_after_tensorflow_started_is_an_init_order_error(python):
    proc = python("""
        import tensorflow as tf, tfdist
        tf.constant(1.0)  # TensorFlow is now initialised
        try:
            tfdist.MultiWorkerMirroredStrategy()
        except tfdist.InitOrderError as err:
            print("OK", err)
    """)
    assert "OK tfdist.MultiWorkerMirroredStrategy must be created before TensorFlow initialises" in proc.stdout
