"""ModelParallelStrategy with the mesh's model axis across processes (issue 14: "across workers, TF collective groups").

One real launch per configuration (2 processes x 1 logical CPU: mesh 1 x 2; 2 x 2: mesh 1 x 4; one row spanning the
processes; tests/tensor_parallel_model_procs_job.py) checks `fit` of the MLP (SGD and Adam) and the Transformer block
(Adam), and the MLP with SGD + clipnorm, + global_clipnorm and + use_ema, against one device on the same batches,
replicated variables bit-identical on both processes, each process's shards (1/T of the logical shape, on its own
devices), the exchanges of a traced step (Megatron's pairing rule), evaluate/predict, and the chief's `.keras` file
in plain Keras. A third launch (4 processes x 1 device, mesh 2 x 2: two rows of two processes) checks the reduction
over rows, with clipping too. Meshes that do not fit are refused before
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
from tfdist.errors import ConfigError

from tp_models import assert_equals_one_device

JOB = os.path.join(os.path.dirname(__file__), "tensor_parallel_model_procs_job.py")
TASK = "/job:worker/replica:0/task:{}/device:CPU:{}"
TAGS = ("mlp-sgd", "mlp-adam", "transformer-adam")

def run_job(out, devices_per_worker: int, plain_keras):
    log = io.StringIO()
    rc = launch([sys.executable, JOB, str(out)], 2, devices_per_worker=devices_per_worker, out=log, timeout_s=300,
                env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert rc == 0, log.getvalue()[-4000:]
    records = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    return records, plain_keras(out / "mlp.keras")


@pytest.fixture(scope="module", params=[1, 2], ids=["2x1-mesh1x2", "2x2-mesh1x4"])
def job(request, tmp_path_factory, plain_keras):
    m = request.param
    return m, *run_job(tmp_path_factory.mktemp(f"tp_model_procs_{m}"), m, plain_keras)


def arrays(weights: dict) -> dict:
    return {path: np.asarray(value, "float64") for path, value in weights.items()}


@pytest.mark.slow
def test_fit_with_the_model_axis_across_processes_equals_one_device(job):
    _, records, _ = job
    for tag in TAGS:
        got, ref = arrays(records[0][tag]["weights"]), arrays(records[0][tag]["reference"])
        other = arrays(records[1][tag]["weights"])
        assert_equals_one_device(tag, got, ref, other)
        np.testing.assert_allclose(records[0][tag]["loss"], records[0][tag]["ref_loss"], rtol=1e-5)
        assert records[0][tag]["loss"] == records[1][tag]["loss"], tag
    # Training moved the weights (the comparison above is not of two untrained models).
    assert not np.allclose(arrays(records[0]["mlp-adam"]["weights"])["up1/kernel"],
                           arrays(records[0]["mlp-sgd"]["weights"])["up1/kernel"])


@pytest.mark.slow
def test_get_weights_gives_the_logical_weights_in_keras_order_on_every_process(job):
    _, records, _ = job
    for tag in ("mlp-sgd", "mlp-adam"):
        paths = records[0][tag]["ref_paths"]
        for record in records:
            got = record[tag]["get_weights"]
            assert len(got) == len(paths), tag
            for path, value in zip(paths, got):
                np.testing.assert_array_equal(np.asarray(value), np.asarray(record[tag]["weights"][path]),
                                              err_msg=f"{tag} {path}")


@pytest.mark.slow
@pytest.mark.parametrize("tag", ["mlp-sgd-clipnorm", "mlp-sgd-globalclipnorm", "mlp-sgd-ema"])
def test_clipping_and_ema_across_the_row_equal_one_device(job, tag):
    """clipnorm (0.02) and global_clipnorm (0.05) clip all 12 steps (below every step's norms on one device):
    the squares of each process's shards are summed over the row's processes, replicated variables counted
    once. Before, 1 x 2 clipped each process's shards by their own norms and 1 x 4 refused both."""
    _, records, _ = job
    got, ref = arrays(records[0][tag]["weights"]), arrays(records[0][tag]["reference"])
    other = arrays(records[1][tag]["weights"])
    assert_equals_one_device(tag, got, ref, other)
    np.testing.assert_allclose(records[0][tag]["loss"], records[0][tag]["ref_loss"], rtol=1e-5)
    assert records[0][tag]["loss"] == records[1][tag]["loss"], tag
    if "unclipped" in records[0][tag]:  # the clipping changed the result (the check above is not of a no-op)
        unclipped = arrays(records[0][tag]["unclipped"])
        assert max(np.abs(ref[k] - unclipped[k]).max() / np.abs(ref[k]).max() for k in ref) > 0.05


@pytest.mark.slow
def test_clipnorm_with_gradient_accumulation_across_the_row_is_refused_naming_both(job):
    _, records, _ = job
    for record in records:  # every process refuses alike (no process left waiting in a collective)
        message = record["accumulation_refused"]
        assert message and "clipnorm=0.02" in message and "gradient_accumulation_steps=2" in message


@pytest.mark.slow
def test_replicated_variables_and_their_optimizer_state_are_bit_identical_on_every_process(job):
    _, records, _ = job
    for tag in TAGS:
        mine, other = records[0][tag]["replicated"], records[1][tag]["replicated"]
        assert set(mine) == set(other) and ("head/kernel" in mine or "out/kernel" in mine), tag
        for path in mine:
            np.testing.assert_array_equal(np.asarray(mine[path]), np.asarray(other[path]), err_msg=f"{tag} {path}")
        slots = records[0][tag]["replicated_slots"]
        assert len(slots) == len(records[1][tag]["replicated_slots"])
        for a, b in zip(slots, records[1][tag]["replicated_slots"]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=tag)


@pytest.mark.slow
def test_each_process_holds_only_its_own_shards_on_its_own_devices(job):
    m, records, _ = job
    t = 2 * m
    for rank, record in enumerate(records):
        assert record["num_replicas"] == 1  # one mesh row: every process of it reads the same batch
        assert record["mesh_rows"] == [[TASK.format(rank, i) for i in range(m)]]
        for tag in TAGS:
            shards, logical = record[tag]["shards"], record[tag]["logical_shapes"]
            assert set(shards) <= set(logical) and len(shards) >= 4, tag  # (a row layer's bias stays whole)
            for role, entries in shards.items():
                assert len(entries) == m, (tag, role)  # this process's m shards, not all t
                for i, (path, shape, where) in enumerate(entries):
                    assert path.endswith(f"_shard_{rank * m + i}"), (tag, path)
                    assert where == [TASK.format(rank, i)], (tag, role, where)
                    full = logical[role]
                    split = [d for d, (a, b) in enumerate(zip(full, shape)) if a != b]
                    assert len(split) == 1 and shape[split[0]] * t == full[split[0]], (tag, role, shape, full)


@pytest.mark.slow
def test_a_traced_step_exchanges_once_forward_and_once_backward_per_pair(job):
    _, records, _ = job
    for record in records:
        # MLP: two column/row pairs (the first one's input is the data: no backward sum); the Transformer block:
        # the heads (their output projection sums) and the feed-forward pair. No gather, no scatter: each
        # column-parallel output is read as shards, so it is never all-gathered across the processes.
        assert record["mlp-sgd"]["counts"] == {"tp_all_reduce": 2 + 1, "tp_all_gather": 0, "tp_scatter": 0}
        assert record["transformer-adam"]["counts"] == {"tp_all_reduce": 2 + 1, "tp_all_gather": 0,
                                                        "tp_scatter": 0}


@pytest.mark.slow
def test_evaluate_and_predict_match_one_device_on_every_process(job):
    _, records, _ = job
    for tag in TAGS:
        ref = records[0][tag]["ref_evaluate"]
        assert records[0][tag]["evaluate"] == records[1][tag]["evaluate"], tag
        np.testing.assert_allclose(records[0][tag]["evaluate"], ref, rtol=1e-5)
        for record in records:  # every process of the row computes the whole batch
            np.testing.assert_allclose(record[tag]["predict"], records[0][tag]["ref_predict"], atol=1e-5, err_msg=tag)


@pytest.mark.slow
def test_the_saved_keras_file_is_logical_and_loads_in_plain_keras(job):
    _, records, plain = job
    trained = arrays(records[0]["mlp-adam"]["weights"])
    loaded = arrays(plain["weights"])
    assert set(loaded) == set(trained)
    for path in trained:
        np.testing.assert_array_equal(loaded[path], trained[path], err_msg=path)
    for path, value in trained.items():  # Adam state: one momentum and velocity of the logical shape
        name = path.replace("/", "_")
        assert [list(value.shape)] * 2 == [s for p, s in plain["slots"].items()
                                           if p.split("/")[-1] in (f"{name}_momentum", f"{name}_velocity")], path
    assert plain["iterations"] == 12  # 3 epochs x 4 batches
    assert [r["mlp-adam"]["wrote_keras"] for r in records] == [True, False]


# --- meshes and options the model axis across processes refuses (no launch needed) -------------------------------
def tf_config(n: int, index: int) -> str:
    return json.dumps({"cluster": {"worker": [f"localhost:{12000 + i}" for i in range(n)]},
                       "task": {"type": "worker", "index": index}})


@pytest.mark.parametrize("shape, devices, local, options, message", [
    ((1, 4), [TASK.format(0, 0), TASK.format(1, 0), TASK.format(0, 1), TASK.format(1, 1)], "2", {},
     "not contiguous per process"),
    ((1, 3), [TASK.format(0, 0), TASK.format(0, 1), TASK.format(1, 0)], None, {}, "split unevenly"),
    ((1, 4), [TASK.format(1, 0), TASK.format(1, 1), TASK.format(0, 0), TASK.format(0, 1)], "2", {}, "rank order"),
    ((1, 4), [TASK.format(0, 0), TASK.format(0, 1), TASK.format(1, 0), TASK.format(1, 1)], "2", {"zero_stage": 1},
     "zero_stage=1 with the model axis across processes"),
    ((2, 2), [TASK.format(0, 0), TASK.format(1, 0), TASK.format(0, 1), TASK.format(1, 1)], "2", {},
     r"mesh row 0 .* straddles processes \[0, 1\], but 2 rows over 2 processes give each row 1"),
])
def test_rows_across_processes_that_do_not_fit_are_config_errors(monkeypatch, shape, devices, local, options, message):
    monkeypatch.setenv("TF_CONFIG", tf_config(2, 0))
    if local is None:
        monkeypatch.delenv("TFDIST_LOCAL_DEVICES", raising=False)
    else:
        monkeypatch.setenv("TFDIST_LOCAL_DEVICES", local)
    layout_map = tfdist.LayoutMap(tfdist.DeviceMesh(shape, ("batch", "model"), devices))
    with pytest.raises(ConfigError, match=message):
        tfdist.ModelParallelStrategy(layout_map, batch_dim_name="batch", **options)


def test_a_pipeline_mesh_whose_row_spans_processes_is_a_config_error(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", tf_config(2, 0))
    monkeypatch.setenv("TFDIST_LOCAL_DEVICES", "2")
    mesh = tfdist.DeviceMesh((1, 2, 2), ("batch", "stage", "model"),
                             [TASK.format(0, 0), TASK.format(0, 1), TASK.format(1, 0), TASK.format(1, 1)])
    with pytest.raises(ConfigError, match="'stage' axis .* whose rows span processes"):
        tfdist.ModelParallelStrategy(tfdist.LayoutMap(mesh), batch_dim_name="batch")


@pytest.mark.slow
def test_two_rows_each_across_two_processes_reduce_over_the_rows(tmp_path, plain_keras):
    # 4 processes x 1 device, mesh 2 x 2: row 0 is processes 0-1, row 1 processes 2-3. Each row reads its half of
    # every global batch; shard k's gradient is summed over the rows by the processes at place k of each row.
    log = io.StringIO()
    rc = launch([sys.executable, JOB, str(tmp_path), "2", "mlp-sgd,mlp-adam,transformer-adam,mlp-sgd-clipnorm,"
                 "mlp-sgd-globalclipnorm"], 4,
                devices_per_worker=1, out=log, timeout_s=400, env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert rc == 0, log.getvalue()[-4000:]
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)]
    first = arrays(records[0]["mlp-sgd"]["weights"])
    loaded = arrays(plain_keras(tmp_path / "mlp.keras")["weights"])
    trained = arrays(records[0]["mlp-adam"]["weights"])
    assert set(loaded) == set(trained)
    for path in trained:  # saved by every process (each row gathers its shards), written by the chief
        np.testing.assert_array_equal(loaded[path], trained[path], err_msg=path)
    assert [r["mlp-adam"]["wrote_keras"] for r in records] == [True, False, False, False]
    for tag in ("mlp-sgd-clipnorm", "mlp-sgd-globalclipnorm"):  # norms over the row's processes, summed rows
        for record in records[1:]:
            assert_equals_one_device(tag, arrays(records[0][tag]["weights"]), arrays(records[0][tag]["reference"]),
                                     arrays(record[tag]["weights"]))
    for rank, record in enumerate(records):
        assert record["num_replicas"] == 2 and record["mesh_rows"] == [[TASK.format(rank, 0)]]
        for tag in ("mlp-sgd", "mlp-adam", "transformer-adam"):
            got, ref = arrays(record[tag]["weights"]), arrays(records[0][tag]["reference"])
            for path in ref:
                diff = float(np.max(np.abs(got[path] - ref[path])))
                if tag == "mlp-sgd":
                    assert diff <= 1e-5, (rank, path, diff)
                elif path != "mha/key/bias":  # see test_fit_with_the_model_axis_across_processes_equals_one_device
                    assert diff <= 1e-4 * max(float(np.max(np.abs(ref[path]))), 1e-3), (rank, tag, path, diff)
            assert record[tag]["evaluate"] == records[0][tag]["evaluate"], tag
            np.testing.assert_allclose(record[tag]["evaluate"], records[0][tag]["ref_evaluate"], rtol=1e-5)
            shards = record[tag]["shards"]
            assert all(where == [TASK.format(rank, 0)] and path.endswith(f"_shard_{rank % 2}")
                       for entries in shards.values() for path, _, where in entries), (rank, tag)
        for path in first:
            np.testing.assert_array_equal(arrays(record["mlp-sgd"]["weights"])[path], first[path], err_msg=path)
        assert record["mlp-sgd"]["counts"] == {"tp_all_reduce": 3, "tp_all_gather": 0, "tp_scatter": 0}
