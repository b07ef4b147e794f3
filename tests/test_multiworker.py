"""tfdist.MultiWorkerMirroredStrategy with real processes on loopback: Keras 3 fit across N workers x M devices.

One job per topology checks several things at once (process start-up costs ~5 s): weights equal to a
single device, identical weights on every worker, disjoint data shards, an uneven last batch, evaluate,
predict, and chief-only checkpoints.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tfdist.cluster.launcher import launch

pytestmark = pytest.mark.slow

JOB = textwrap.dedent('''
    import contextlib, os, sys
    import numpy as np
    out, mode = sys.argv[1], sys.argv[2]
    import tfdist
    # The strategy comes first: collectives must be configured before TensorFlow initialises.
    if mode == "single":
        strategy = None
    elif mode == "local2":
        strategy = tfdist.MultiWorkerMirroredStrategy(local_devices=2)
    else:  # TF_CONFIG and TFDIST_LOCAL_DEVICES come from `tfdist launch`
        strategy = tfdist.MultiWorkerMirroredStrategy(timeout_s=60)
    import keras
    import tensorflow as tf

    rank = tfdist.cluster.rank(strategy)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1)) + 0.1).astype("float32")

    def sharded(ds):
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
        return ds.with_options(options)

    # 100 samples, global batch 16: the last batch holds 4, split evenly over 1, 2 or 4 replicas.
    train = sharded(tf.data.Dataset.from_tensor_slices((x, y)).batch(16))
    scope = strategy.scope() if strategy else contextlib.nullcontext()
    with scope:
        model = keras.Sequential([
            keras.Input((8,)),
            keras.layers.Dense(16, activation="tanh", kernel_initializer=keras.initializers.GlorotUniform(1)),
            keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(2)),
        ])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    ckpt = tfdist.training.ModelCheckpoint(os.path.join(out, f"ckpt-{mode}-rank{rank}.keras"), strategy=strategy)
    boards = [tfdist.training.TensorBoard(os.path.join(out, f"tb-{mode}"), strategy=strategy)]
    if mode == "2x1":  # every worker its own directory; the profile from the chief only
        boards.append(tfdist.training.TensorBoard(os.path.join(out, "tb-per-worker"), per_worker=True,
                                                  strategy=strategy, profile_batch=(2, 3)))
    history = model.fit(train, epochs=3, verbose=0, callbacks=[ckpt, *boards])
    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    evaluation = model.evaluate(train, verbose=0)
    prediction = model.predict(sharded(tf.data.Dataset.from_tensor_slices(x).batch(16)), verbose=0)

    # Which samples does each worker read? 102 ids in global batches of 16: the last batch (6) is uneven.
    ids, totals = [], []
    if strategy is not None:
        dist = strategy.experimental_distribute_dataset(sharded(tf.data.Dataset.range(102).batch(16)))

        @tf.function
        def count(batch):  # a collective per step: workers with different step counts would hang here
            ctx = lambda b: tf.distribute.get_replica_context().all_reduce("SUM", tf.size(b, tf.int64))
            return strategy.run(ctx, args=(batch,))

        for batch in dist:
            totals.append(int(strategy.experimental_local_results(count(batch))[0]))
            ids += [int(i) for part in strategy.experimental_local_results(batch) for i in part.numpy()]
        # fit on the uneven dataset too: it must finish, not hang
        uneven = sharded(tf.data.Dataset.from_tensor_slices((np.ones((102, 8), "float32"),
                                                             np.ones((102, 1), "float32"))).batch(16))
        model.fit(uneven, epochs=1, verbose=0)
    np.savez(os.path.join(out, f"{mode}-rank{rank}.npz"), weights=weights, loss=history.history["loss"],
             evaluation=evaluation, prediction=prediction, ids=np.array(ids, "int64"), totals=totals,
             replicas=strategy.num_replicas_in_sync if strategy else 1)
    print("JOB DONE", mode, rank, flush=True)
''')


def _launch(script: str, n: int, devices: int, *args: str) -> str:
    out = io.StringIO()
    rc = launch([sys.executable, script, *args], n, devices_per_worker=devices, out=out, timeout_s=240,
                env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert rc == 0, out.getvalue()[-4000:]
    return out.getvalue()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Runs every topology once: single device, 1 worker x 2 devices, 2 x 1, 2 x 2."""
    out = tmp_path_factory.mktemp("mw")
    script = out / "job.py"
    script.write_text(JOB)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("TF_CONFIG", None)
    local = [subprocess.Popen([sys.executable, str(script), str(out), mode], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for mode in ("single", "local2")]
    for p in local:
        text, _ = p.communicate(timeout=240)
        assert p.returncode == 0, text[-4000:]
    logs = {"2x1": _launch(str(script), 2, 1, str(out), "2x1"), "2x2": _launch(str(script), 2, 2, str(out), "2x2")}
    data = {f.stem: dict(np.load(f)) for f in out.glob("*.npz")}
    return out, data, logs


def test_every_topology_matches_a_single_device(results):
    _, data, _ = results
    reference = data["single-rank0"]["weights"]
    expected_replicas = {"local2-rank0": 2, "2x1-rank0": 2, "2x1-rank1": 2, "2x2-rank0": 4, "2x2-rank1": 4}
    for name, replicas in expected_replicas.items():
        assert int(data[name]["replicas"]) == replicas, name
        delta = np.abs(data[name]["weights"] - reference).max()
        print(f"\n{name}: {replicas} replicas, max |w - w_single| = {delta:.2e}")
        assert delta <= 1e-5, name
        np.testing.assert_allclose(data[name]["loss"], data["single-rank0"]["loss"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(data[name]["evaluation"], data["single-rank0"]["evaluation"], rtol=1e-5)
    assert not np.allclose(reference, 0)


def test_all_workers_end_with_identical_weights(results):
    _, data, _ = results
    for topo in ("2x1", "2x2"):
        np.testing.assert_array_equal(data[f"{topo}-rank0"]["weights"], data[f"{topo}-rank1"]["weights"])
        # predict gathers every worker's share back into the full, ordered result on each worker
        assert data[f"{topo}-rank0"]["prediction"].shape == (100, 1)


def test_workers_read_disjoint_shards_with_an_uneven_last_batch(results):
    _, data, _ = results
    for topo in ("2x1", "2x2", "local2"):
        ranks = [v for k, v in data.items() if k.startswith(topo)]
        all_ids = np.concatenate([r["ids"] for r in ranks])
        assert sorted(all_ids.tolist()) == list(range(102)), topo  # every sample once, none twice
        if len(ranks) == 2:
            assert not set(ranks[0]["ids"].tolist()) & set(ranks[1]["ids"].tolist())
            assert len(ranks[0]["ids"]) and len(ranks[1]["ids"])
        assert ranks[0]["totals"].tolist() == [16] * 6 + [6], topo  # the global batches, last one uneven


def test_only_the_chief_writes_checkpoints(results):
    import keras

    out, data, logs = results
    written = sorted(p.name for p in out.glob("ckpt-*.keras"))
    assert written == ["ckpt-2x1-rank0.keras", "ckpt-2x2-rank0.keras", "ckpt-local2-rank0.keras",
                       "ckpt-single-rank0.keras"]
    restored = keras.models.load_model(out / "ckpt-2x2-rank0.keras")
    flat = np.concatenate([w.ravel() for w in restored.get_weights()])
    np.testing.assert_array_equal(flat, data["2x2-rank0"]["weights"])
    assert "[0] JOB DONE 2x2 0" in logs["2x2"] and "[1] JOB DONE 2x2 1" in logs["2x2"]


def _epoch_losses(events_file) -> list[float]:
    import tensorflow as tf
    from tensorflow.core.util import event_pb2

    losses = []
    for record in tf.data.TFRecordDataset(str(events_file)):
        event = event_pb2.Event.FromString(record.numpy())
        losses += [float(tf.make_ndarray(v.tensor)) for v in event.summary.value if v.tag == "epoch_loss"]
    return losses


def test_tensorboard_the_chief_writes_the_job_and_per_worker_logs_profile_the_chief_only(results):
    out, data, _ = results
    for mode in ("single", "local2", "2x1", "2x2"):
        written = sorted((out / f"tb-{mode}").rglob("events.out.tfevents.*"))
        train = [f for f in written if f.parent.name == "train"]
        assert len(train) == 1, f"{mode}: {written}"  # one writer: the chief
        np.testing.assert_allclose(_epoch_losses(train[0]), data[f"{mode}-rank0"]["loss"], rtol=1e-6)
    per_worker = out / "tb-per-worker"
    assert sorted(p.name for p in per_worker.iterdir()) == ["worker_0", "worker_1"]
    for rank in (0, 1):
        train = list((per_worker / f"worker_{rank}" / "train").glob("events.out.tfevents.*"))
        assert len(train) == 1 and _epoch_losses(train[0]) == pytest.approx(data["2x1-rank0"]["loss"], rel=1e-6)
    assert list((per_worker / "worker_0").rglob("*.xplane.pb")), "the chief's profile is missing"
    assert not list((per_worker / "worker_1").rglob("*.xplane.pb"))
