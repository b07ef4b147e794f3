"""Gradient buckets (tfdist.data_parallel.buckets): DDP's reverse-order buckets, equal results to the one-pack path, and
overlap with the backward read from TF's profiler trace. MultiWorkerMirroredStrategy and Horovod: 2-process runs
(tests/buckets_job.py)."""

from __future__ import annotations

import io
import json
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist._compat.tf_runtime import executed_partition_graphs, partition_devices
from benchmarks.ddp_trace import free_to_overlap, overlap_by_step, profile
from tfdist.data_parallel.buckets import plan_buckets
from tfdist.errors import ConfigError

HERE = os.path.dirname(__file__)


def test_buckets_follow_reverse_creation_order_and_close_at_the_cap():
    f32, f16 = tf.float32, tf.float16
    # 4-byte floats: 160, 1600, 160, 32 bytes; cap 100 B: a bucket closes once it holds >= 100 B.
    assert plan_buckets([40, 400, 40, 8], [f32] * 4, cap_bytes=100) == [[3, 2], [1], [0]]
    assert plan_buckets([40, 400, 40, 8], [f32] * 4, cap_bytes=10_000) == [[3, 2, 1, 0]]
    # one dtype per bucket (they are concatenated): float16 gradients gather apart from float32 ones
    assert plan_buckets([8, 8, 8, 8], [f32, f16, f32, f16], cap_bytes=10_000) == [[3, 1], [2, 0]]


def _data(n=256, shape=(8, 8, 1), seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, *shape)).astype("float32")
    return x, (x.reshape(n, -1)[:, :8].sum(1) > 0).astype("int32")


def _fit(strategy, epochs=2, shape=(8, 8, 1), batch_size=64):
    with strategy.scope():
        model = tfdist.models.cnn(input_shape=shape, num_classes=2)
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="sparse_categorical_crossentropy")
    x, y = _data(shape=shape)
    model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0, shuffle=False)
    return model


def test_bucketed_training_equals_the_one_pack_path():
    stock = _fit(tfdist.MirroredStrategy())
    strategy = tfdist.MirroredStrategy(bucket_cap_mb=0.002)  # ~2 KB: the 8x8 CNN's 8 gradients in 4 buckets
    bucketed = _fit(strategy)
    assert len(strategy.gradient_path.buckets) >= 3
    assert strategy.gradient_path.buckets[0][0] == len(stock.trainable_weights) - 1  # the last layer's first
    # 16 SGD+momentum steps of 4 replicas: each bucket is its own ring all-reduce, so an element may be summed
    # in another order than inside the one pack; equal to float32 rounding.
    for a, b in zip(stock.get_weights(), bucketed.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-6)
    assert strategy.gradient_path.wire_bytes == strategy.gradient_path.gradient_bytes  # no hook: every byte


def test_bucket_options_are_checked():
    with pytest.raises(ConfigError, match="bucket_cap_mb must be a number of MB > 0"):
        tfdist.MirroredStrategy(bucket_cap_mb=0)
    with pytest.raises(ConfigError, match="bucket_cap_mb=1.0 needs zero_stage=0"):
        tfdist.MirroredStrategy(bucket_cap_mb=1.0, zero_stage=1)


def _profiled_steps(strategy):
    """(steps 1-3 of the profiler trace: per step, per device, its backward ops and gradient collectives; per device,
    whether a gradient collective is free to run during the backward, from the graphs TF executed)."""
    with strategy.scope():
        model = tfdist.models.cnn()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="sparse_categorical_crossentropy")
    x, y = _data(512, (28, 28, 1))

    def fit(callbacks=()):
        return model.fit(x, y, batch_size=128, epochs=1, verbose=0, callbacks=list(callbacks))

    partitions = executed_partition_graphs(fit)  # TF's placement of every executed node
    return (overlap_by_step(profile(fit), partition_devices(partitions), model.optimizer.name),
            free_to_overlap(partitions, model.optimizer.name))


def test_bucket_all_reduces_are_free_to_run_during_the_backward_and_one_pack_never_is():
    # Buckets of 0.1 MB: the logits' and dense1's gradients (first out of the backward) can be all-reduced while
    # conv2's and conv1's gradients are still being computed; whether they are in a given step depends on the
    # scheduling of a shared machine (`tfdist bench ddp` measures it), so the graphs TF ran say it.
    steps, free = _profiled_steps(tfdist.MirroredStrategy(bucket_cap_mb=0.1))
    assert len(steps) >= 3
    assert len(free) == 4 and all(free.values()), free
    # One pack after the whole backward: on every device its collective starts after the device's last
    # backward op (the pack's concat needs every gradient) - nothing overlaps, in the graphs or in the trace.
    stock, free = _profiled_steps(tfdist.MirroredStrategy())
    assert len(free) == 4 and not any(free.values()), free
    assert stock and not [d for step in stock for d in step.values() if d.overlaps or d.hidden_ms > 0]


def _launch(backend: str, out) -> dict:
    from tfdist.cluster.launcher import launch

    log = io.StringIO()
    rc = launch([sys.executable, os.path.join(HERE, "buckets_job.py"), str(out), backend], 2, backend=backend,
                out=log, timeout_s=300, env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert rc == 0, log.getvalue()[-4000:]
    ranks = []
    for r in range(2):
        with open(f"{out}.{r}") as f:
            ranks.append(json.load(f))
    return ranks


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["tf", "horovod"])
def test_two_processes_bucketed_and_fp16_equal_the_plain_path_and_buckets_overlap(backend, tmp_path):
    if backend == "horovod":
        pytest.importorskip("horovod.tensorflow")
    result, other = _launch(backend, tmp_path / "out.json")
    assert result["buckets"] >= 3
    plain, bucketed, fp16 = (np.array(result[k]) for k in ("plain", "bucketed", "fp16"))
    np.testing.assert_allclose(bucketed, plain, rtol=0, atol=2e-6)
    # float16 on the wire: not equal, close (16 steps of SGD with momentum 0.9 amplify the rounding; 0.015 seen)
    assert 0 < np.abs(fp16 - plain).max() < 0.05
    assert result["fp16_wire_bytes"] * 2 == result["fp16_gradient_bytes"]
    for key in ("plain", "bucketed", "fp16"):
        assert result[key] == other[key], f"ranks differ after training ({key})"
    # Uneven data (6 and 4 batches per rank, 'stop', 2 epochs): 8 steps on both ranks, agreed inside the first
    # bucket's all-reduce for every step but each epoch's first (tfdist.data_parallel.uneven).
    for r in (result, other):
        assert r["uneven"]["steps"] == 8 and r["uneven"]["fused"] == 6, r["uneven"]
    assert result["uneven"]["weights"] == other["uneven"]["weights"]
    if backend == "horovod":
        return  # TF's profiler records no event for Horovod's ops inside a tf.function (only eager ones)
    # From the graphs TF ran, on both ranks: with one pack no gradient collective is free to run during its device's
    # backward; with buckets one is, on every device. Whether it then does in a given step depends on how the
    # threads are scheduled on a shared machine (`tfdist bench ddp` measures how much is hidden), so rank 0's
    # profiler trace (steps 1-3) is only required to show the plain path never overlapping.
    for r in (result, other):
        assert r["plain_free"] and not any(r["plain_free"].values()), r["plain_free"]
        assert r["bucketed_free"] and all(r["bucketed_free"].values()), r["bucketed_free"]
    assert len(result["plain_overlaps"]) == len(result["bucketed_overlaps"]) == 3, result["plain_overlaps"]
    assert not any(any(step) for step in result["plain_overlaps"])


# -- strategy.no_sync(): k micro-steps accumulate locally, then one all-reduce of the sum --------------------------
def _custom_loop(micro: int, steps: int = 3, first_sync: bool = False):
    """`steps` updates of Adam on 64 examples each, as `micro` micro-batches of 64/micro (no_sync for all but the
    last). Returns the weights, the optimizer's step count, and the op types of the no_sync step's graph."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(64 * steps, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")
    strategy = tfdist.MirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((8,)),
            keras.layers.Dense(16, activation="tanh", kernel_initializer=keras.initializers.GlorotUniform(1)),
            keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(2))])
        optimizer = keras.optimizers.Adam(0.01)
        optimizer.build(model.trainable_variables)

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            per_example = tf.square(model(x) - y)[:, 0]
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=64)  # the big batch's mean
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def train_step(x, y, sync):
        with strategy.no_sync(enabled=not sync):
            strategy.run(replica_step, args=(x, y))

    data = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(64 // micro))
    kinds = {}
    for i, (bx, by) in enumerate(data):
        sync = (i + 1) % micro == 0 or (first_sync and i == 0)
        train_step(bx, by, sync)
        kinds.setdefault(sync, (bx, by))
    ops = set()
    if False in kinds:
        graph = train_step.get_concrete_function(*kinds[False], False).graph.as_graph_def()
        ops = {n.op for n in graph.node} | {n.op for f in graph.library.function for n in f.node_def}
    return model.get_weights(), int(optimizer.iterations.numpy()), ops


def test_no_sync_accumulation_equals_the_large_batch_step():
    big, big_steps, _ = _custom_loop(micro=1)
    small, small_steps, no_sync_ops = _custom_loop(micro=4)
    assert big_steps == small_steps == 3  # micro-steps under no_sync count no optimizer step (Adam's bias terms)
    for a, b in zip(big, small):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-6)
    assert no_sync_ops and not {op for op in no_sync_ops if op.startswith("Collective")}, sorted(no_sync_ops)


def test_no_sync_after_a_synced_first_step_is_a_config_error():
    # Raised while the step is traced: AutoGraph re-raises it, still a ConfigError, its message ending in ours.
    with pytest.raises(ConfigError, match="ConfigError: no_sync: optimizer .* already applied gradients outside "
                                        "no_sync before its first no_sync step"):
        _custom_loop(micro=4, first_sync=True)
