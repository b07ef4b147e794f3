"""The training program of tests/test_elastic.py: a tiny deterministic regression that resumes exactly, and
injects its own faults.

    python elastic_job.py OUT_DIR BACKUP_DIR EPOCHS

JOB_BACKEND: tf (tfdist.MultiWorkerMirroredStrategy, heartbeat JOB_HEARTBEAT_S) or horovod (HorovodStrategy).
JOB_FAULTS: space-separated ROUND:SIGNAL:RANK:EPOCH:BATCH, e.g. "0:KILL:1:2:5 1:STOP:0:3:5": in restart round
ROUND (TFDIST_RESTART_COUNT, set by `tfdist launch --max-restarts` and slurm/*.sbatch), worker RANK sends
itself SIGKILL or SIGSTOP after batch BATCH of epoch EPOCH (mid-epoch; both are signals no code can catch).
Prints "FAULT <signal> <pid> <time>" just before, "EPOCH_END <epoch>" after each backup, and at the end
"RESULT {...}" (restored epoch, epochs run); every rank saves its final weights as OUT_DIR/weights-rank<r>.npy.
"""

import os
import signal
import sys
import time

import numpy as np

out, backup_dir, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3])
backend = os.environ.get("JOB_BACKEND", "tf")
restart = int(os.environ.get("TFDIST_RESTART_COUNT", "0"))

import tfdist

if backend == "tf":
    heartbeat_s = float(os.environ.get("JOB_HEARTBEAT_S", "10"))
    strategy = tfdist.MultiWorkerMirroredStrategy(timeout_s=30, heartbeat_s=heartbeat_s)
else:
    strategy = tfdist.HorovodStrategy()

import keras
import tensorflow as tf

from tfdist.training import BackupAndRestore

rank = tfdist.cluster.rank(strategy)
faults = {}
for spec in os.environ.get("JOB_FAULTS", "").split():
    round_, sig, who, epoch, batch = spec.split(":")
    if int(round_) == restart and int(who) == rank:
        faults[(int(epoch), int(batch))] = getattr(signal, f"SIG{sig}")
print(f"START rank {rank} pid {os.getpid()} restart {restart}", flush=True)

rng = np.random.default_rng(0)
x = rng.normal(size=(512, 8)).astype("float32")
y = np.sin(x @ rng.normal(size=(8, 1))).astype("float32")
order = tfdist.data.EpochOrder(seed=3)  # epoch N's order depends on (seed, N) only: a resumed run replays it
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
ran: list[int] = []


class Faults(keras.callbacks.Callback):
    epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        sig = faults.get((self.epoch, batch))
        if sig is not None:
            print(f"FAULT {sig.name} {os.getpid()} {time.time():.3f}", flush=True)
            os.kill(os.getpid(), sig)

    def on_epoch_end(self, epoch, logs=None):  # after the backup callback: the chief has saved this epoch
        ran.append(epoch)
        print("EPOCH_END", epoch, flush=True)


model.fit(train, epochs=epochs, verbose=0, callbacks=[order, backup, Faults()])
np.save(os.path.join(out, f"weights-rank{rank}.npy"), np.concatenate([w.ravel() for w in model.get_weights()]))
print("RESULT", {"restored": backup.restored_epoch, "ran": ran}, flush=True)
