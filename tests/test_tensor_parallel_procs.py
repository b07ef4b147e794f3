"""ModelParallelStrategy with the mesh's batch axis across processes (two workers x 2 devices).

One real launch (2 processes x 2 logical CPUs on loopback, global mesh 2 x 2: "batch" across the processes, "model"
inside each; tests/tensor_parallel_procs_job.py) checks `fit` of the MLP (SGD and Adam; Adam with Keras' EMA, SGD
with global_clipnorm), the Transformer block (Adam) and the example CNN against one device on the same global
batches, identical workers, evaluate/predict, the chief's `.keras` file in plain Keras, and where the shards live.
The same launch checks ZeRO stage 3 over the batch axis across the processes (MLP and Transformer block, Adam, 20
steps) against stage 0 and one device, the parameter pieces each process holds and the chief's `.keras` file, and
clipping by the logical norms. A second (2 processes x 4 devices, mesh 4 x 2: two rows per process) checks the
local-then-global sum and ZeRO stages 1 and 2 against stage 0 and one device. The bad meshes are refused before
anything starts, so those tests need no launch.
"""

from __future__ import annotations

import io
import json
import os
import sys

import numpy as np
import pytest

import tfdist
from tfdist.cluster.launcher import launch
from tfdist.errors import ConfigError, InitOrderError

from tp_models import assert_equals_one_device

JOB = os.path.join(os.path.dirname(__file__), "tensor_parallel_procs_job.py")
TASK = "/job:worker/replica:0/task:{}/device:CPU:{}"
TAGS = ("mlp-sgd", "mlp-adam", "transformer-adam", "cnn-sgd", "mlp-adam-ema", "mlp-sgd-clip")  # the job's stage 0 runs
ROW_TAGS = ("mlp-sgd", "mlp-adam", "mlp-adam-zero1", "mlp-adam-zero2",  # 2 processes x 4 devices, mesh 4 x 2
            "mlp-adam20-zero3")
ZERO3_MODELS = ("mlp", "transformer")  # 2 processes x 2 devices, mesh 2 x 2, Adam, 20 steps: stage 0 and stage 3

# clipnorm on split variables at stages 0, 2 and 3 and global_clipnorm at stage 3, 20 SGD steps
CLIP_TAGS = ("mlp-sgd20-clipnorm", "mlp-sgd20-clipnorm-zero2", "mlp-sgd20-clipnorm-zero3", "mlp-sgd20-clip-zero3")


@pytest.fixture(scope="module")
def mesh_2x2(tmp_path_factory):
    """2 processes x 2 devices, mesh 2 x 2 (one row per process): one launch for every run on this mesh, the
    stage-0 runs, ZeRO-3 (the MLP and the Transformer block with Adam for 20 steps at zero_stage=0 and 3, each
    ZeRO-3 model saved by `tfdist.training.save_model` on both processes) and the clipping runs."""
    out = tmp_path_factory.mktemp("tp_procs")
    tags = [*TAGS, *(f"{m}-adam20{z}" for m in ZERO3_MODELS for z in ("", "-zero3")), *CLIP_TAGS]
    log = io.StringIO()
    rc = launch([sys.executable, JOB, str(out), "2", ",".join(tags)], 2, devices_per_worker=2, out=log,
                timeout_s=600, env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert rc == 0, log.getvalue()[-4000:]
    return out, [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def job(mesh_2x2, plain_keras):
    out, records = mesh_2x2
    return records, by_slot_name(plain_keras(out / "mlp.keras"))


def arrays(weights: dict) -> dict:
    return {path: np.asarray(value, "float64") for path, value in weights.items()}


@pytest.mark.slow
def test_fit_across_two_processes_equals_one_device_and_workers_stay_identical(job):
    records, _ = job
    for tag in TAGS:
        got, ref = arrays(records[0][tag]["weights"]), arrays(records[0][tag]["reference"])
        other = arrays(records[1][tag]["weights"])
        assert_equals_one_device(tag, got, ref, other)
        np.testing.assert_allclose(records[0][tag]["loss"], records[0][tag]["ref_loss"], rtol=1e-5)
        assert records[0][tag]["loss"] == records[1][tag]["loss"], tag  # History: global losses on every worker
    # Training moved the weights (the comparison above is not of two untrained models).
    mlp = arrays(records[0]["mlp-adam"]["weights"])
    assert not np.allclose(mlp["up1/kernel"], arrays(records[0]["mlp-sgd"]["weights"])["up1/kernel"])
    slots = [np.asarray(s) for s in records[0]["mlp-adam"]["slots"]]
    for a, b in zip(slots, records[1]["mlp-adam"]["slots"]):
        np.testing.assert_array_equal(a, np.asarray(b))  # Adam state identical on both workers


@pytest.mark.slow
def test_evaluate_is_global_and_predict_gives_each_worker_its_half_of_every_batch(job):
    records, _ = job
    batch = {"mlp": 16, "transformer": 8, "cnn": 8}
    for tag in TAGS:
        e0, e1, ref = records[0][tag]["evaluate"], records[1][tag]["evaluate"], records[0][tag]["ref_evaluate"]
        assert e0 == e1, tag
        np.testing.assert_allclose(e0, ref, rtol=1e-5)
        full = np.asarray(records[0][tag]["ref_predict"])
        b = batch[tag.split("-")[0]]
        for rank in (0, 1):
            rows = [i for i in range(len(full)) if (i % b) // (b // 2) == rank]
            np.testing.assert_allclose(records[rank][tag]["predict"], full[rows], atol=1e-5, err_msg=tag)


@pytest.mark.slow
def test_the_chiefs_keras_file_loads_in_plain_keras_with_the_trained_weights(job):
    records, plain = job
    trained = arrays(records[0]["mlp-adam"]["weights"])
    loaded = arrays(plain["weights"])
    assert set(loaded) == set(trained)
    for path in trained:
        np.testing.assert_array_equal(loaded[path], trained[path], err_msg=path)
    # Adam state in the file is the logical one plain Keras has: one momentum and velocity per logical variable.
    for path, value in trained.items():
        name = path.replace("/", "_")
        assert [list(value.shape)] * 2 == [s for p, s in plain["slots"].items()
                                           if p.split("/")[-1] in (f"{name}_momentum", f"{name}_velocity")], path
    assert plain["iterations"] == 8  # 2 epochs x 4 global batches
    assert [r["mlp-adam"]["wrote_keras"] for r in records] == [True, False]  # save_model on both, the chief wrote


def by_slot_name(plain: dict) -> dict:
    """A plain-Keras record (the `plain_keras` fixture) with its optimizer's slot values keyed by the slot's name."""
    return {**plain, "slot_values": {p.split("/")[-1]: v for p, v in plain["slot_values"].items()}}


@pytest.fixture(scope="module")
def zero3_job(mesh_2x2, plain_keras):
    out, records = mesh_2x2
    return records, {m: by_slot_name(plain_keras(out / f"{m}-zero3.keras")) for m in ZERO3_MODELS}


@pytest.mark.slow
def test_clipping_across_two_processes_equals_one_device_and_processes_stay_identical(mesh_2x2):
    """Clipping by the norms one device takes (tests/test_tensor_parallel_clip.py in one process), across 2 processes
    x 2 devices with the batch axis across the processes."""
    _, records = mesh_2x2
    for tag in CLIP_TAGS:
        got = {k: np.asarray(v, "float32") for k, v in records[0][tag]["weights"].items()}
        other = {k: np.asarray(v, "float32") for k, v in records[1][tag]["weights"].items()}
        ref = {k: np.asarray(v, "float32") for k, v in records[0][tag]["reference"].items()}
        assert_equals_one_device(tag.replace("sgd20", "sgd"), got, ref, other)


@pytest.mark.slow
def test_zero3_across_processes_equals_stage_0_and_one_device_with_identical_processes(zero3_job):
    """ZeRO-3 over the batch axis across processes (each process's row keeps piece r of every variable, the units
    all-gather and reduce-scatter with TF collectives across the processes) trains as stage 0 and one device."""
    records, _ = zero3_job
    for model in ZERO3_MODELS:
        tag, stage0 = f"{model}-adam20-zero3", f"{model}-adam20"
        got, ref = arrays(records[0][tag]["weights"]), arrays(records[0][tag]["reference"])
        zero = arrays(records[0][stage0]["weights"])
        assert set(got) == set(ref) == set(zero), tag
        for path in got:
            np.testing.assert_array_equal(got[path], arrays(records[1][tag]["weights"])[path], err_msg=f"{tag} {path}")
            if path == "mha/key/bias":  # rounding noise turned into +-lr steps by Adam (see the stage-0 test)
                continue
            scale = max(float(np.max(np.abs(ref[path]))), 1e-3)
            assert float(np.max(np.abs(got[path] - zero[path]))) <= 1e-4 * scale, (tag, path)
            assert float(np.max(np.abs(got[path] - ref[path]))) <= 1e-4 * scale, (tag, path)
        assert records[0][tag]["loss"] == records[1][tag]["loss"], tag
        assert len(records[0][tag]["loss"]) == 5  # 5 epochs x 4 global batches: 20 steps
        np.testing.assert_allclose(records[0][tag]["loss"], records[0][tag]["ref_loss"], rtol=1e-5)
        assert records[0][tag]["evaluate"] == records[1][tag]["evaluate"], tag
        np.testing.assert_allclose(records[0][tag]["evaluate"], records[0][tag]["ref_evaluate"], rtol=1e-4)
        assert records[0][tag]["slots"] == records[1][tag]["slots"], tag  # gathered Adam state, both processes
        assert records[0][tag]["loss"][-1] < records[0][tag]["loss"][0], tag  # it trained


@pytest.mark.slow
def test_zero3_across_processes_keeps_half_of_every_parameter_on_each_process(zero3_job):
    """Each variable (a shard of a split layer on its model position, or a replicated one on the row's first device)
    is one piece per process: ceil(size / 2) elements, on this process's device of that model position."""
    records, _ = zero3_job
    for model in ZERO3_MODELS:
        for rank, record in enumerate(records):
            params = record[f"{model}-adam20-zero3"]["params"]
            assert params, model
            total, held = 0, 0
            for name, param in params.items():
                size = int(np.prod(param["shape"]))
                [[shape, device]] = param["pieces"]  # one piece here: the other process holds the other half
                assert shape == [-(-size // 2)], (model, name, param)
                position = int(name.rsplit("_shard_", 1)[1]) if "_shard_" in name else 0
                assert device == TASK.format(rank, position), (model, name, device)
                total, held = total + size, held + shape[0]
            assert held / total == pytest.approx(0.5, abs=0.01), (model, held, total)


@pytest.mark.slow
def test_zero3_across_processes_the_chiefs_keras_file_holds_the_logical_model_and_adam_state(zero3_job):
    records, plain = zero3_job
    for model in ZERO3_MODELS:
        tag = f"{model}-adam20-zero3"
        assert [r[tag]["wrote_keras"] for r in records] == [True, False]  # save_model on both, the chief wrote
        trained, loaded = arrays(records[0][tag]["weights"]), arrays(plain[model]["weights"])
        assert set(loaded) == set(trained), model
        for path in trained:
            np.testing.assert_array_equal(loaded[path], trained[path], err_msg=f"{model} {path}")
        # The file's Adam state is the logical one (one momentum and velocity per logical variable), equal to one
        # device's Adam state after the same 20 steps.
        state, ref = arrays(plain[model]["slot_values"]), arrays(records[0][tag]["ref_slots"])
        assert set(state) == set(ref), model
        assert plain[model]["iterations"] == 20
        for name, value in ref.items():
            if name.startswith("mha_key_bias"):
                continue
            assert state[name].shape == value.shape, (model, name)
            scale = max(float(np.max(np.abs(value))), 1e-3)
            assert float(np.max(np.abs(state[name] - value))) <= 1e-4 * scale, (model, name)


@pytest.mark.slow
def test_each_process_holds_one_row_and_its_shards_on_its_own_devices(job):
    records, _ = job
    for rank in (0, 1):
        record = records[rank]
        assert record["num_replicas"] == 2  # the mesh's 2 rows, one per process
        assert record["local_devices"] == [TASK.format(rank, 0)]
        assert record["mesh_rows"] == [[TASK.format(rank, 0), TASK.format(rank, 1)]]
        shards = record["mlp-adam"]["shards"]
        assert shards["up1/kernel"] == [[[12, 16], [TASK.format(rank, 0)]], [[12, 16], [TASK.format(rank, 1)]]]
        assert shards["down1/kernel"] == [[[16, 16], [TASK.format(rank, 0)]], [[16, 16], [TASK.format(rank, 1)]]]
        assert shards["up2/bias"] == [[[16], [TASK.format(rank, 0)]], [[16], [TASK.format(rank, 1)]]]


@pytest.fixture(scope="module")
def rows_job(tmp_path_factory, plain_keras):
    """2 processes x 4 devices, mesh 4 x 2: each process holds two rows. The MLP with SGD and Adam at stage 0, Adam
    at zero_stage 1 and 2 (each column's state in 4 pieces, two of them in each process), and Adam at zero_stage 3
    for 20 steps (parameters in 4 pieces too), whose chief's `.keras` file is loaded in plain Keras."""
    out = tmp_path_factory.mktemp("tp_rows")
    log = io.StringIO()
    rc = launch([sys.executable, JOB, str(out), "4", ",".join(ROW_TAGS)], 2, devices_per_worker=4, out=log,
                timeout_s=300, env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert rc == 0, log.getvalue()[-4000:]
    records = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    return records, by_slot_name(plain_keras(out / "mlp-zero3.keras"))


@pytest.mark.slow
def test_two_rows_per_process_sum_locally_then_across_processes(rows_job):
    # A gradient is summed over the process's two rows first, then across the processes.
    records, _ = rows_job
    for rank, record in enumerate(records):
        assert record["num_replicas"] == 4
        assert record["mesh_rows"] == [[TASK.format(rank, 0), TASK.format(rank, 1)],
                                       [TASK.format(rank, 2), TASK.format(rank, 3)]]
        got, ref = arrays(record["mlp-sgd"]["weights"]), arrays(records[0]["mlp-sgd"]["reference"])
        for path in ref:
            assert float(np.max(np.abs(got[path] - ref[path]))) <= 1e-5, path
            np.testing.assert_array_equal(got[path], arrays(records[0]["mlp-sgd"]["weights"])[path])
        assert record["mlp-sgd"]["evaluate"] == records[0]["mlp-sgd"]["evaluate"]


@pytest.mark.slow
def test_zero_with_two_rows_per_process_equals_stage_0_and_one_device_on_both_processes(rows_job):
    """ZeRO's per-column groups span both local rows and the other process's: stage 1 (R = 4: stage 0's all-reduce,
    then each row slices its piece) and stage 2 (all-to-all reduce-scatter) give stage 0's weights, identical on
    both processes, each piece on this process's own devices. Stage 2 runs on a mesh whose local rows go against
    device order (TF ranks a group's members by device index: a piece's index must follow that rank)."""
    records, _ = rows_job
    for rank, record in enumerate(records):
        assert record["mlp-adam-zero1"]["mesh_rows"] == record["mesh_rows"]
        assert record["mlp-adam-zero2"]["mesh_rows"] == [[TASK.format(rank, 2), TASK.format(rank, 3)],
                                                         [TASK.format(rank, 0), TASK.format(rank, 1)]]
    zero = arrays(records[0]["mlp-adam"]["weights"])
    for tag in ("mlp-adam-zero1", "mlp-adam-zero2"):
        got, ref = arrays(records[0][tag]["weights"]), arrays(records[0][tag]["reference"])
        assert set(got) == set(zero) == set(ref), tag
        for path in got:
            np.testing.assert_array_equal(got[path], arrays(records[1][tag]["weights"])[path], err_msg=f"{tag} {path}")
            scale = max(float(np.max(np.abs(zero[path]))), 1e-3)
            assert float(np.max(np.abs(got[path] - zero[path]))) <= 1e-4 * scale, (tag, path)
            assert float(np.max(np.abs(got[path] - ref[path]))) <= 1e-4 * scale, (tag, path)
        assert records[0][tag]["loss"] == records[1][tag]["loss"], tag
        np.testing.assert_allclose(records[0][tag]["loss"], records[0]["mlp-adam"]["loss"], rtol=1e-5)
        for rank, record in enumerate(records):
            # two groups (model positions), each with this process's two rows' copies; Adam's two slots per group
            # cut into 4 pieces (1109 and 992 elements), two of each here, on this process's devices
            assert [len(g) for g in record[tag]["groups"]] == [2, 2], tag
            pieces = record[tag]["pieces"]
            assert sorted(p[0][0] for p in pieces) == [248] * 4 + [278] * 4, (tag, pieces)
            assert {p[1] for p in pieces} == {TASK.format(rank, i) for i in range(4)}, (tag, pieces)
    assert not np.allclose(zero["up1/kernel"], arrays(records[0]["mlp-sgd"]["weights"])["up1/kernel"])  # trained


@pytest.mark.slow
def test_zero3_with_two_rows_per_process_equals_one_device_with_a_quarter_of_every_parameter_per_row(rows_job):
    """ZeRO-3 with two rows per process (on a mesh whose rows run against device order, as ZeRO-2's above): each
    column's group is both processes' two rows, each row keeps piece r of every variable of its column (r: TF's rank
    of its device in the group), the units all-gather and reduce-scatter across the processes."""
    records, plain = rows_job
    tag = "mlp-adam20-zero3"
    got, ref = arrays(records[0][tag]["weights"]), arrays(records[0][tag]["reference"])
    assert set(got) == set(ref)
    for path in got:
        np.testing.assert_array_equal(got[path], arrays(records[1][tag]["weights"])[path], err_msg=path)
        assert float(np.max(np.abs(got[path] - ref[path]))) <= 1e-4 * max(float(np.max(np.abs(ref[path]))), 1e-3), path
    np.testing.assert_allclose(records[0][tag]["loss"], records[0][tag]["ref_loss"], rtol=1e-5)
    assert records[0][tag]["loss"][-1] < records[0][tag]["loss"][0]
    for rank, record in enumerate(records):
        for name, param in record[tag]["params"].items():
            size, position = int(np.prod(param["shape"])), int(name.rsplit("_shard_", 1)[1]) if "_shard_" in name else 0
            assert [shape for shape, _ in param["pieces"]] == [[-(-size // 4)]] * 2, (name, param)
            assert {d for _, d in param["pieces"]} == {TASK.format(rank, position), TASK.format(rank, 2 + position)}
    assert [r[tag]["wrote_keras"] for r in records] == [True, False]
    loaded = arrays(plain["weights"])
    assert set(loaded) == set(got)
    for path in got:
        np.testing.assert_array_equal(loaded[path], got[path], err_msg=path)
    state, ref_state = arrays(plain["slot_values"]), arrays(records[0][tag]["ref_slots"])
    assert set(state) == set(ref_state)
    for name, value in ref_state.items():
        assert float(np.max(np.abs(state[name] - value))) <= 1e-4 * max(float(np.max(np.abs(value))), 1e-3), name


DIFFERENT_MODELS = """
import sys
import tfdist
mesh = tfdist.DeviceMesh((2, 2), ("batch", "model"), tfdist.cluster.list_devices())
layout_map = tfdist.LayoutMap(mesh)
layout_map["up/kernel"] = (None, "model")
strategy = tfdist.ModelParallelStrategy(layout_map, timeout_s=30)
import keras
with strategy.scope():  # process 1 builds a wider layer than process 0
    keras.Sequential([keras.Input((4,)), keras.layers.Dense(8 + 8 * tfdist.cluster.rank(strategy), name="up")])
"""


@pytest.mark.slow
def test_processes_that_build_different_models_get_a_config_error_not_a_hang():
    log = io.StringIO()
    rc = launch([sys.executable, "-c", DIFFERENT_MODELS], 2, devices_per_worker=2, out=log, timeout_s=120,
                env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    text = log.getvalue()
    assert rc != 0, text[-2000:]
    assert "ConfigError: ModelParallelStrategy: the processes are building different models" in text, text[-3000:]
    assert "process 0: shape (4, 8) float32; process 1: shape (4, 16) float32" in text, text[-3000:]


# --- naming a mesh across processes, and meshes that do not fit the job (no launch needed) -----------------------
def tf_config(n: int, index: int) -> str:
    return json.dumps({"cluster": {"worker": [f"localhost:{12000 + i}" for i in range(n)]},
                       "task": {"type": "worker", "index": index}})


def test_list_devices_names_every_process_device_in_rank_order():
    env = {"TF_CONFIG": tf_config(2, 1), "TFDIST_LOCAL_DEVICES": "2"}
    assert tfdist.cluster.list_devices(environ=env) == [TASK.format(0, 0), TASK.format(0, 1),
                                                         TASK.format(1, 0), TASK.format(1, 1)]
    assert tfdist.cluster.list_devices(environ={"TFDIST_LOCAL_DEVICES": "3"}) == [
        "/device:CPU:0", "/device:CPU:1", "/device:CPU:2"]  # no job: this process's own devices
    with pytest.raises(ConfigError, match="TFDIST_LOCAL_DEVICES is not set"):
        tfdist.cluster.list_devices(environ={"TF_CONFIG": tf_config(2, 0)})
    mesh = tfdist.DeviceMesh((2, 2), ("batch", "model"), tfdist.cluster.list_devices(environ=env))
    assert mesh.devices[1, 0] == TASK.format(1, 0)


@pytest.mark.parametrize("shape, devices, local, message", [
    ((2, 2), [TASK.format(0, 0), TASK.format(1, 0), TASK.format(0, 1), TASK.format(1, 1)], "2",
     "mesh row 0 .* straddles processes"),
    ((2, 1), [TASK.format(0, 0), TASK.format(1, 0)], "2", r"the mesh has 2 devices but the job has 2 processes x 2"),
    ((3, 1), [TASK.format(0, 0), TASK.format(0, 1), TASK.format(1, 0)], None, "same number of mesh rows"),
    ((2, 2), [TASK.format(0, 0), TASK.format(0, 1), TASK.format(2, 0), TASK.format(2, 1)], None,
     "not a task of this job"),
    ((2, 2), [TASK.format(1, 0), TASK.format(1, 1), TASK.format(0, 0), TASK.format(0, 1)], None, "rank order"),
    ((2, 1), [TASK.format(0, 0), TASK.format(1, 1)], None, "different local devices"),
])
def test_meshes_that_do_not_fit_the_job_are_config_errors(monkeypatch, shape, devices, local, message):
    monkeypatch.setenv("TF_CONFIG", tf_config(2, 0))
    if local is None:
        monkeypatch.delenv("TFDIST_LOCAL_DEVICES", raising=False)
    else:
        monkeypatch.setenv("TFDIST_LOCAL_DEVICES", local)
    layout_map = tfdist.LayoutMap(tfdist.DeviceMesh(shape, ("batch", "model"), devices))
    with pytest.raises(ConfigError, match=message):
        tfdist.ModelParallelStrategy(layout_map, batch_dim_name="batch")


def test_a_local_mesh_in_a_job_and_a_job_mesh_alone_are_config_errors(monkeypatch):
    local = tfdist.LayoutMap(tfdist.DeviceMesh((2, 2), ("batch", "model"), [f"/cpu:{i}" for i in range(4)]))
    monkeypatch.setenv("TF_CONFIG", tf_config(2, 1))
    with pytest.raises(ConfigError, match="each process would train alone.*list_devices"):
        tfdist.ModelParallelStrategy(local)
    monkeypatch.delenv("TF_CONFIG")
    remote = tfdist.LayoutMap(tfdist.DeviceMesh((2, 1), ("batch", "model"), [TASK.format(0, 0), TASK.format(1, 0)]))
    with pytest.raises(ConfigError, match="no TF_CONFIG of 2 or more workers.*tfdist launch"):
        tfdist.ModelParallelStrategy(remote)
    with pytest.raises(ConfigError, match="does not name a process's device"):
        tfdist.DeviceMesh((2, 1), ("batch", "model"), [TASK.format(0, 0), "/cpu:1"])


def test_a_mesh_across_processes_after_tensorflow_started_is_an_init_order_error(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", tf_config(2, 0))
    monkeypatch.setenv("TFDIST_LOCAL_DEVICES", "2")
    import tensorflow as tf

    tf.constant(0.0).numpy()  # this test session's TensorFlow runs (whichever tests ran before)
    layout_map = tfdist.LayoutMap(tfdist.DeviceMesh((2, 2), ("batch", "model"), tfdist.cluster.list_devices()))
    with pytest.raises(InitOrderError, match="before TensorFlow initialises"):
        tfdist.ModelParallelStrategy(layout_map)
