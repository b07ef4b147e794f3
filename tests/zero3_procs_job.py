"""Worker script of tests/test_zero3_procs.py: ZeRO stage 3 (and its stage-0 reference) across processes.

Usage, under `tfdist launch -n 2 --devices-per-worker 2` (mw: MultiWorkerMirroredStrategy, one stage per
launch, since collectives are configured once per process) or `--backend horovod` (hvd: stages in turn):
    python zero3_procs_job.py BACKEND OUT STAGE [STAGE ...]
Per stage and model (one with a layer called twice, one with BatchNorm's non-trainable statistics): 20
Adam steps with tfdist's ModelCheckpoint and BackupAndRestore, a save_model, the weights read on every
rank, the ZeRO-3 pieces this process holds, one more epoch continued and one resumed from the backup.
Results go to OUT/BACKEND-sSTAGE-rankR.json and OUT/BACKEND-MODEL-sSTAGE*.keras.
"""
import json
import os
import sys

import numpy as np

backend, out, stages = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3:]]
import tfdist

# First thing: MWMS configures collectives at program start, both set up the local logical CPUs.
make = (lambda stage: tfdist.MultiWorkerMirroredStrategy(timeout_s=60, zero_stage=stage)) if backend == "mw" \
    else (lambda stage: tfdist.HorovodStrategy(zero_stage=stage, offload=stage == 3, save_timeout_s=5))  # stage 3 offloaded here
first_strategy = make(stages[0])
import keras
import tensorflow as tf

from tfdist.errors import ConfigError

rng = np.random.default_rng(0)
x = rng.normal(size=(320, 8)).astype("float32")
y = np.tanh(x @ rng.normal(size=(8, 1)) + 0.1).astype("float32")
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(32).with_options(options)  # 10 global steps per epoch


def build(kind: str):
    init = keras.initializers.GlorotUniform
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="tanh", kernel_initializer=init(1), name="first")(inputs)
    if kind == "tied":  # one layer called twice: its weights are gathered for both calls
        shared = keras.layers.Dense(16, activation="tanh", kernel_initializer=init(2), name="shared")
        h = shared(shared(h))
    else:  # BatchNorm: trainable gamma/beta sharded, moving statistics replicated (non-trainable)
        h = keras.layers.Activation("tanh")(keras.layers.BatchNormalization(name="bn")(h))
    model = keras.Model(inputs, keras.layers.Dense(1, kernel_initializer=init(3), name="out")(h))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def weights(model) -> list:
    with tfdist.zero.gathered_state(model):  # every rank: reading sharded weights is a collective
        return [w.ravel().tolist() for w in model.get_weights()]


def slots(model) -> list:
    with tfdist.zero.gathered_state(model):
        return [np.asarray(v.numpy()).ravel().tolist() for v in model.optimizer.variables]


def run(strategy, stage: int, kind: str, rank: int) -> dict:
    tag = f"{backend}-{kind}-s{stage}"
    backup = os.path.join(out, f"backup-{tag}")
    with strategy.scope():
        a = build(kind)
    history = a.fit(data, epochs=2, verbose=0, callbacks=[
        tfdist.training.BackupAndRestore(backup, delete_on_success=False),
        tfdist.training.ModelCheckpoint(os.path.join(out, f"{tag}.keras"))])
    rec = {"loss": history.history["loss"], "w20": weights(a), "slots": slots(a), "iterations": int(a.optimizer.iterations.numpy()),
           "replicas": strategy.num_replicas_in_sync, "local_devices": list(strategy.extended.worker_devices)}
    tfdist.training.save_model(a, os.path.join(out, f"{tag}-saved.keras"))
    engine = tfdist.zero.engine_of(a)
    if stage == 3:
        rec["shard_ids"] = list(engine.comm.shard_ids)
        rec["params"] = [{"path": p.name, "size": p.size, "pieces": [list(c.shape) for c in p.components],
                          "devices": [c.device for c in p.components]} for p in engine.params]
        rec["slot_shapes"] = [list(v.shape) for vs in engine.state.slots.values() for v in vs]
        canon = lambda d: tf.DeviceSpec.from_string(d).to_string()  # noqa: E731
        rec["slot_devices"] = [canon(v.value.device) for vs in engine.state.slots.values() for v in vs]
        rec["host_device"] = canon(engine.config.host_device)
        rec["non_trainable"] = [v.path for v in a.non_trainable_variables]
        rec["memory"] = strategy.memory_report(a).to_dict()  # this process's replicas, read from the variables
        if backend == "hvd" and rank == 0:  # a rank-0-only save must fail clearly instead of hanging
            try:
                a.save(os.path.join(out, "rank0-only.keras"))
                rec["rank0_only_save"] = "saved"
            except ConfigError as err:
                rec["rank0_only_save"] = str(err)
        # the stage-0 file (written by the stage-0 run of this job) loads into the sharded model
        with strategy.scope():
            c = build(kind)
            c.optimizer.build(c.trainable_variables)
        c.load_weights(os.path.join(out, f"{backend}-{kind}-s0-saved.keras"))
        rec["w20_loaded_from_stage0"] = weights(c)
    a.fit(data, epochs=1, verbose=0)
    rec["w30"] = weights(a)
    with strategy.scope():
        b = build(kind)
    b.fit(data, epochs=3, verbose=0, callbacks=[tfdist.training.BackupAndRestore(backup, delete_on_success=False)])
    rec["w30_resumed"], rec["slots30"], rec["slots30_resumed"] = weights(b), slots(a), slots(b)
    return rec


ids = rng.integers(0, 5, size=(64, 6)).astype("int32")  # tokens repeat within and across replicas
lookup_data = tf.data.Dataset.from_tensor_slices((ids, y[:64])).batch(32).with_options(options)  # 2 steps


def lookups(strategy) -> list:
    """An Embedding under Adam: a stage-3 unit's backward all-gathers the lookups' slices across the processes, and
    the update takes those of its piece, as stock hands Keras the slices."""
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,), dtype="int32"),
                                  keras.layers.Embedding(12, 4, embeddings_initializer=keras.initializers.RandomNormal(
                                      seed=4), name="emb"),
                                  keras.layers.GlobalAveragePooling1D(),
                                  keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(5),
                                                     name="out")], name="lookup")
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    model.fit(lookup_data, epochs=1, verbose=0)
    return weights(model)


for stage in stages:
    strategy = first_strategy if stage == stages[0] else make(stage)  # (mw: one stage per process)
    rank = tfdist.cluster.rank(strategy)
    record = {kind: run(strategy, stage, kind, rank) for kind in ("tied", "bn")}
    record["lookups"] = lookups(strategy)
    with open(os.path.join(out, f"{backend}-s{stage}-rank{rank}.json"), "w") as f:
        json.dump(record, f)
    print(f"JOB DONE {backend} stage {stage} rank {rank}", flush=True)
