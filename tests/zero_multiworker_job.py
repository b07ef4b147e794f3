"""Worker script of tests/test_zero_multiworker.py: the runs of one topology, one ZeRO stage after another in the
same processes (a strategy each, over the job the first one joined), results to JSON per run.

Usage (under `tfdist launch -n 2 [--devices-per-worker M]`): python zero_multiworker_job.py OUT RUNS, RUNS a
comma-separated list of TAG:STAGE:OFFLOAD:REF (REF: the tag whose stage-0 checkpoint to continue from, or -).
"""
import contextlib, functools, glob, json, os, shutil, sys, tempfile
import numpy as np
import lookups
import twins
out = sys.argv[1]
runs = [(tag, int(stage), offload == "1", ref) for tag, stage, offload, ref in
        (run.split(":") for run in sys.argv[2].split(","))]
import tfdist
# The first strategy comes first: collectives must be configured before TensorFlow initialises. The later ones
# are created over the job it joined.
first = tfdist.MultiWorkerMirroredStrategy(timeout_s=60, zero_stage=runs[0][1], offload=runs[0][2])
import keras
import tensorflow as tf
from tfdist.zero.tf_collectives import TFShardCollectives

# Tiny chunks, so this 161-parameter model's ZeRO-2 reduce-scatter runs as 11 chunked all-to-alls
# per shard, as a 25M-parameter model's does with the default 16 MiB.
TFShardCollectives.CHUNK_BYTES = 64

rank = tfdist.cluster.rank(first)
rng = np.random.default_rng(0)
x = rng.normal(size=(160, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1)) + 0.1).astype("float32")
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).with_options(options)  # 10 steps per epoch


def build(scope=None, optimizer=None):
    with (scope or strategy.scope)():
        # Named, so each model is its plain-Keras twin's equal (Keras numbers unnamed ones per process).
        model = keras.Sequential([
            keras.Input((8,), name="x"),
            keras.layers.Dense(16, activation="tanh", kernel_initializer=keras.initializers.GlorotUniform(1),
                               name="hidden"),
            keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(2), name="out"),
        ], name="mlp")  # 161 parameters: shards of 81 (2 replicas) or 41 (4), the last one padded
        model.compile(optimizer=optimizer() if optimizer else keras.optimizers.Adam(0.01, name="adam"), loss="mse")
    return model


@functools.cache
def plain_twin():
    """The job's model built and trained in plain Keras, on one device (this process's)."""
    model = build(scope=contextlib.nullcontext)
    model.fit(x, y, batch_size=16, shuffle=False, epochs=1, verbose=0)
    return model


flat = lambda m: np.concatenate([w.ravel() for w in m.get_weights()])
state = lambda m: [np.asarray(v) for v in m.optimizer.variables]  # every worker reads: gathers shards
for tag, stage, offload, ref in runs:
    strategy = first if tag == runs[0][0] else tfdist.MultiWorkerMirroredStrategy(timeout_s=60, zero_stage=stage,
                                                                                  offload=offload)
    print("RUN START", tag, flush=True)
    record = {}
    backup = os.path.join(out, f"backup-{tag}")

    # 1. 20 Adam steps with a backup and a checkpoint per epoch; every worker saves.
    a = build()
    record["twin"] = twins.serialization_differences(a.optimizer)
    a.fit(data, epochs=2, verbose=0, callbacks=[tfdist.training.BackupAndRestore(backup, delete_on_success=False),
                                                tfdist.training.ModelCheckpoint(os.path.join(out, f"{tag}.keras"))])
    record["twin"] += twins.differences(a, plain_twin())  # the same model in plain Keras
    record["w20"], record["slots"] = flat(a), state(a)
    tfdist.training.save_model(a, os.path.join(out, f"{tag}-saved.keras"))
    engine = tfdist.zero.engine_of(a.optimizer)
    if engine is not None:  # tf.train.Checkpoint: every worker writes (gathering), the chief's copy is kept
        where = out if rank == 0 else tempfile.mkdtemp(prefix="ckpt-")
        tf.train.Checkpoint(model=a, optimizer=a.optimizer).write(os.path.join(where, f"{tag}-tf"))
        if rank:
            shutil.rmtree(where)
        record["shard_ids"] = list(engine.comm.shard_ids)
        record["shard_shapes"] = [tuple(v.shape) for vs in engine.state.slots.values() for v in vs]
        record["shard_devices"] = [v.value.device for vs in engine.state.slots.values() for v in vs]
        record["inner_state_elements"] = sum(int(np.prod(v.shape)) for v in engine.inner.variables)
        record["local_devices"] = list(strategy.extended.worker_devices)
        report = strategy.memory_report(a)
        record["memory"] = report.to_dict()
        print(report, flush=True)
    # 2. 10 more steps in memory.
    a.fit(data, epochs=3, initial_epoch=2, verbose=0)
    record["w30"] = flat(a)
    # 3. A fresh model resumes from the backup (epoch 2) and runs epoch 3.
    b = build()
    restore = tfdist.training.BackupAndRestore(backup)
    b.fit(data, epochs=3, verbose=0, callbacks=[restore])
    record["resumed_epoch"], record["w30_resumed"] = restore.restored_epoch, flat(b)
    # 4. The stage-0 run's checkpoint (20 steps) loaded here, then epoch 3.
    if ref != "-":
        with strategy.scope():
            c = keras.models.load_model(os.path.join(out, f"{ref}.keras"))
        record["slots_loaded"], record["w20_loaded"] = state(c), flat(c)
        c.fit(data, epochs=3, initial_epoch=2, verbose=0)
        record["w30_loaded"] = flat(c)
    # 5. Global-norm clipping: every stage clips the summed gradient, as one device with the global batch does
    # (stock Keras clips each replica's gradient). SGD with momentum: its steps scale with the gradient.
    clip = lambda: keras.optimizers.SGD(0.1, momentum=0.5, global_clipnorm=0.05)
    clipped = build(optimizer=clip)
    clipped.fit(data, epochs=1, verbose=0)
    record["w_clip"] = flat(clipped)
    if rank == 0:
        single = build(scope=contextlib.nullcontext, optimizer=clip)  # no strategy: one device
        single.fit(x, y, batch_size=16, shuffle=False, epochs=1, verbose=0)
        record["w_clip_single"] = flat(single)
        unclipped = build(scope=contextlib.nullcontext, optimizer=lambda: keras.optimizers.SGD(0.1, momentum=0.5))
        unclipped.fit(x, y, batch_size=16, shuffle=False, epochs=1, verbose=0)
        record["w_unclipped_single"] = flat(unclipped)
    # 6. AdamW (decoupled weight decay) with a learning-rate schedule under the mixed_float16 policy:
    # Keras wraps it in a LossScaleOptimizer, which ZeRO must see through (the inner optimizer is sharded).
    keras.mixed_precision.set_global_policy("mixed_float16")
    schedule = lambda: keras.optimizers.schedules.ExponentialDecay(0.01, decay_steps=3, decay_rate=0.5)
    mixed = build(optimizer=lambda: keras.optimizers.AdamW(schedule(), weight_decay=0.1))
    mixed.fit(data, epochs=1, verbose=0)
    keras.mixed_precision.set_global_policy("float32")
    record["w_adamw_mixed"] = flat(mixed)
    inner = tfdist.zero.engine_of(mixed.optimizer.inner_optimizer)  # the sharded one
    record["adamw_mixed_optimizer"] = [type(mixed.optimizer).__name__, mixed.layers[0].compute_dtype,
                                       int(mixed.optimizer.iterations.numpy()), inner.stage if inner else 0]
    # 7. A custom loop's lookups (IndexedSlices, a different count on every replica) under Adam: each replica's
    # slices reach every owner (a padded all-gather across the workers), as stock's all-reduce of slices gives them.
    record["w_lookups"] = lookups.train_lookups(strategy)
    # This process's ModelCheckpoint scratch directories (the pid is in their name; a looser pattern also matched
    # other runs' random tfdist-* names that happened to contain these digits).
    record["leftovers"] = glob.glob(os.path.join(tempfile.gettempdir(), f"tfdist-ckpt-rank-{os.getpid()}-*"))
    record["replicas"] = strategy.num_replicas_in_sync
    with open(os.path.join(out, f"{tag}-rank{rank}.json"), "w") as f:
        json.dump({k: (v.tolist() if isinstance(v, np.ndarray) else [s.tolist() for s in v] if k.startswith("slots") else v)
                   for k, v in record.items()}, f)
    print("JOB DONE", tag, rank, flush=True)
