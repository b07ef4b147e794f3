"""One rank of tests/test_buckets.py's 2-process runs: `python buckets_job.py OUT BACKEND` under `tfdist launch -n 2`.

BACKEND 'tf' (tfdist.MultiWorkerMirroredStrategy) or 'horovod' (tfdist.HorovodStrategy). The same CNN trains
three times from the same weights: the plain path (one all-reduce after the backward), buckets of 2 KB, and
buckets with the fp16 hook. Writes OUT.<rank> (JSON): the three final weight vectors, bucket count, bytes.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
out, backend = sys.argv[1], sys.argv[2]

import tfdist

# The strategy comes first (MWMS configures collectives before TensorFlow initialises); one per process.
strategy = tfdist.MultiWorkerMirroredStrategy(timeout_s=120) if backend == "tf" else tfdist.HorovodStrategy()

import keras
import numpy as np
import tensorflow as tf

rank = tfdist.cluster.rank(strategy)
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 8, 8, 1)).astype("float32")
y = (x.reshape(256, -1)[:, :8].sum(1) > 0).astype("int32")


def train() -> tuple[list[float], list[list[bool]], dict[str, bool]]:
    """Two epochs (the first while TF records the graphs it runs, the second under TF's profiler on rank 0): the
    final weights, per profiled step and local device whether a collective ran during that device's backward, and
    per device whether a gradient collective is free to run during it (from the executed graphs)."""
    from tfdist._compat.tf_runtime import executed_partition_graphs, partition_devices
    from benchmarks.ddp_trace import free_to_overlap, overlap_by_step, profile

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(32).with_options(options)  # 8 steps
    with strategy.scope():
        model = tfdist.models.cnn(input_shape=(8, 8, 1), num_classes=2)
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="sparse_categorical_crossentropy")
    partitions = executed_partition_graphs(lambda: model.fit(data, epochs=1, verbose=0))
    device_of, free = partition_devices(partitions), free_to_overlap(partitions, model.optimizer.name)
    if rank != 0:  # only the collective group leader is profiled (benchmarks.ddp_trace.profile)
        model.fit(data, epochs=1, verbose=0)
        return np.concatenate([w.ravel() for w in model.get_weights()]).tolist(), [], free
    # Steps 1-3 of the 4 each rank runs (Keras counts 8: it sees the dataset before it is split between ranks).
    trace = profile(lambda callbacks: model.fit(data, epochs=1, verbose=0, callbacks=callbacks), steps=3)
    steps = overlap_by_step(trace, device_of, model.optimizer.name)
    overlaps = [[d.overlaps and d.hidden_ms > 0 for d in step.values()] for step in steps]
    return np.concatenate([w.ravel() for w in model.get_weights()]).tolist(), overlaps, free


record = {}
record["plain"], record["plain_overlaps"], record["plain_free"] = train()
strategy.set_bucket_cap(0.002)
record["bucketed"], record["bucketed_overlaps"], record["bucketed_free"] = train()
record["buckets"] = len(strategy.gradient_path.buckets)


def uneven() -> dict:
    """Ranks with 6 and 4 batches ('stop'): with buckets the agreement rides along with the first bucket."""
    before = strategy.uneven_data_agreements()

    def make(context: tf.distribute.InputContext) -> tf.data.Dataset:
        n = 6 if context.input_pipeline_id == 0 else 4
        return tf.data.Dataset.from_tensor_slices((x[: 16 * n], y[: 16 * n])).batch(16)

    data = strategy.distribute_datasets_from_function(make, uneven_data="stop")
    with strategy.scope():
        model = tfdist.models.cnn(input_shape=(8, 8, 1), num_classes=2)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    steps = []
    model.fit(data, epochs=2, verbose=0, callbacks=[keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: steps.append(batch))])
    after = strategy.uneven_data_agreements()
    return {"steps": len(steps), "fused": after["fused"] - before["fused"],
            "weights": np.concatenate([w.ravel() for w in model.get_weights()]).tolist()}


record["uneven"] = uneven()
strategy.register_comm_hook("fp16")
record["fp16"], *_ = train()
record["fp16_wire_bytes"] = strategy.gradient_path.wire_bytes
record["fp16_gradient_bytes"] = strategy.gradient_path.gradient_bytes
with open(f"{out}.{rank}", "w") as f:
    json.dump(record, f)
print(f"rank {rank}: done")
