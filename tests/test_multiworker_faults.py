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

    # Faults the backup life-cycle test injects: FAULTS = "point:rank:round,...", each killing that rank in that
    # round of the launcher (TFDIST_RESTART_COUNT) at that point: "write" (the chief: its backup of epoch 3 is
    # written but not yet renamed; another rank: at the end of epoch 3, as the chief writes), "restore" (inside
    # the restore), "end" (3 s into on_train_end, after the other ranks have finished fit), "delete" (the chief,
    # as it removes the finished backup: renamed, not yet marked incomplete).
    round_ = int(os.environ.get("TFDIST_RESTART_COUNT", "0"))
    faults = {point for point, r, k in (f.split(":") for f in os.environ.get("FAULTS", "").split(",") if f)
              if int(r) == rank and int(k) == round_}

    def die():
        print("KILLED", rank, "in round", round_, flush=True)
        os.kill(os.getpid(), 9)

    if "write" in faults and rank == 0:
        rename = os.rename
        os.rename = lambda src, dst: die() if os.path.basename(src).startswith(".tmp-epoch-3") else rename(src, dst)
    if "restore" in faults:
        def restore_fault(*args, **kwargs):
            if rank != 0:  # the chief restores and reports before the launcher stops it
                import time
                time.sleep(2)
            die()

        object.__setattr__(model, "load_weights", restore_fault)
    if "delete" in faults:
        remove = os.remove
        os.remove = lambda path: die() if ".deleted-" in path else remove(path)
    seen = {"before": sorted(os.listdir(backup_dir)) if os.path.isdir(backup_dir) else []}

    class Seen(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):  # after the backup's: what the restore left in the directory
            seen["after_restore"] = sorted(os.listdir(backup_dir)) if os.path.isdir(backup_dir) else []
            print("SEEN", rank, round_, seen, flush=True)

    class Faults(keras.callbacks.Callback):  # before the backup: callbacks run in list order
        def on_epoch_end(self, epoch, logs=None):
            if "write" in faults and rank != 0 and epoch == 2:
                die()

        def on_train_end(self, logs=None):
            if "end" in faults:
                import time
                time.sleep(3)
                die()

    class Log(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):  # after the backup: the chief has saved this epoch
            ran.append(epoch)
            print("EPOCH_END", epoch, flush=True)

    model.fit(train, epochs=epochs, verbose=0, callbacks=[order, Faults(), backup, Seen(), Log()])
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


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The training script and the weights of its uninterrupted run (shared by the fault tests below)."""
    root = tmp_path_factory.mktemp("faults")
    script = root / "train.py"
    script.write_text(TRAIN)
    clean = root / "clean"
    clean.mkdir()
    rc, log = _launch([sys.executable, str(script), str(clean), str(root / "clean-backup"), str(EPOCHS)])
    assert rc == 0, log[-3000:]
    assert _result(log, 0) == {"restored": None, "ran": list(range(EPOCHS))}
    assert not (root / "clean-backup").exists()  # deleted by the chief after success
    return script, np.load(clean / "weights-rank0.npy")


def test_kill_a_worker_then_resume_to_identical_weights(tmp_path, uninterrupted):
    script, reference = uninterrupted

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
    for rank in (0, 1):
        assert np.abs(np.load(run / f"weights-rank{rank}.npy") - reference).max() <= 1e-6
    assert f"resuming at epoch {epochs_done + 1}" in log


def test_no_completed_work_is_lost_at_any_point_of_the_backup_life_cycle(tmp_path, uninterrupted):
    """One launch, eight rounds of the launcher (max_restarts=7), each rank killed at each point of the backup's
    life cycle, one kill per round but the last:
    0: the chief, epoch 3's backup written but not yet in place;  1: worker 1, inside its restore;
    2: the chief, inside its restore;  3: worker 1 at the end of epoch 3, as the chief writes its backup;
    4: worker 1 after every rank has finished fit (the chief waits in its on_train_end);
    5: the chief after every rank has finished fit;  6: the chief while removing the finished backup.
    Each restart resumes from the last complete backup, partial copies are gone once training starts again, the
    rounds after the last epoch train nothing, and the weights are the uninterrupted run's."""
    script, reference = uninterrupted
    run, backup = tmp_path / "run", tmp_path / "backup"
    run.mkdir()
    out = io.StringIO()
    faults = "write:0:0,restore:1:1,restore:0:2,write:1:3,end:1:4,end:0:5,delete:0:6"
    rc = launch([sys.executable, str(script), str(run), str(backup), str(EPOCHS)], 2, out=out, timeout_s=480,
                max_restarts=7, env={"TF_CPP_MIN_LOG_LEVEL": "2", "FAULTS": faults})
    log = out.getvalue()
    assert rc == 0, log[-4000:]
    killed = [line.split("KILLED", 1)[1].strip() for line in log.splitlines() if "KILLED" in line]
    assert killed == [f"{rank} in round {round_}" for _, rank, round_ in (f.split(":") for f in faults.split(","))], \
        log[-4000:]
    seen = {(int(r), int(k)): eval(rest) for r, k, rest in (  # what rank r found in round k
        line.split("SEEN", 1)[1].split(None, 2) for line in log.splitlines() if "SEEN" in line)}
    resumed = [int(line.rsplit("resuming at epoch", 1)[1]) - 1 for line in log.splitlines() if "resuming at" in line]
    partial = [name for name in seen[0, 1]["before"] if name.startswith(".tmp-epoch-3-")]
    assert seen[0, 1]["before"] == [*partial, "epoch-2"] and len(partial) == 1, seen  # the chief died mid-write
    assert seen[0, 1]["after_restore"] == ["epoch-2"], seen  # removed when training starts again
    # Round 3's chief wrote epoch 3's backup as worker 1 died: in place (epoch 2's removed, or not yet), or cut
    # short by the launcher's stop.
    written = seen[0, 4]["after_restore"]
    assert written in (["epoch-2"], ["epoch-3"], ["epoch-2", "epoch-3"]), seen
    at = int(written[-1].split("-")[1])
    # Rounds 1 and 3-7 resume (round 2's chief died inside its restore): round 4 at the backup round 3 left,
    # 5-7 after the last epoch, whose backup rounds 4 and 5 kept and round 6's chief left whole while removing it.
    assert resumed == [2, 2, at, EPOCHS, EPOCHS, EPOCHS], (resumed, log[-4000:])
    assert seen[0, 5]["before"] == seen[0, 6]["before"] == [f"epoch-{EPOCHS}"], seen
    restored_from = [line for line in log.splitlines() if "tfdist: restored" in line]
    assert seen[0, 7]["before"] == [] and "backup.deleted-" in restored_from[-1], restored_from
    last = [eval(line.split("RESULT", 1)[1]) for line in log.splitlines() if "RESULT" in line]
    assert last[-2:] == [{"restored": EPOCHS, "ran": []}] * 2, log[-4000:]  # round 7: nothing left to train
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # the backup deleted once every rank had finished
    for rank in (0, 1):
        assert np.abs(np.load(run / f"weights-rank{rank}.npy") - reference).max() <= 1e-6


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


def test_a_strategy_over_another_job_than_the_one_joined_is_refused(monkeypatch):
    # Further strategies over the job a process joined are allowed (tests/test_zero_multiworker.py runs three per
    # launch); another cluster cannot be: TensorFlow starts one server per process.
    import tfdist
    from tfdist.comm import runtime
    from tfdist.comm.tf_config import ClusterConfig

    joined = ClusterConfig({"worker": ["localhost:1111", "localhost:2222"]}, "worker", 0)
    monkeypatch.setattr(runtime, "_joined", [joined])
    other = ClusterConfig({"worker": ["localhost:1111", "localhost:3333"]}, "worker", 0)
    for config, named in ((other, r"over a job of 2 workers \(localhost:1111, localhost:3333\) as worker 0"),
                          (None, "over a single local worker")):
        with pytest.raises(tfdist.InitOrderError, match=f"{named}, but this process already joined a job of 2 "
                                                        r"workers \(localhost:1111, localhost:2222\) as worker 0"):
            runtime.join_tf_job(config, lambda: pytest.fail("started"), timeout_s=5, who="the strategy")


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
