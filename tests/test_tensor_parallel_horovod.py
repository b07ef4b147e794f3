"""ModelParallelStrategy across Horovod ranks (issue 14: "Horovod process sets, the 'batch' axis across processes").

Real launches through tfdist's launcher in its Horovod mode (Gloo rendezvous, HOROVOD_RANK/SIZE, no TF_CONFIG;
tests/tensor_parallel_horovod_job.py, where the strategy picks Horovod itself, backend="auto"):
- 2 ranks x 2 devices, mesh 2 x 2: the batch axis across the ranks, each rank one whole row; gradients through one
  grouped hvd.allreduce per device;
- 2 ranks x 1 device, mesh 1 x 2 (and 2 ranks x 2, mesh 1 x 4): one row over both ranks (the model axis across
  them); the split layers' sums are hvd.allreduce in the row's process set (here every rank: Horovod's global set);
- 4 ranks x 1 device, mesh 2 x 2: two rows of two ranks; each row's sums in its own process set ({0, 1}, {2, 3}),
  the rows' gradients in the set of the ranks at the same place ({0, 2}, {1, 3}), added as dynamic process sets;
- 2 ranks x 1 device, mesh 1 x 2, under mpirun (Horovod's MPI controller).
Each checks `fit` of the MLP (SGD <= 1e-5, Adam <= 1e-4 relative) and the Transformer block (Adam) against one
device on the same batches, every rank bit-identical, replicated variables and their optimizer state bit-identical,
the collective ops of a traced step (Horovod's, no TF collective), evaluate, predict, and the chief's `.keras` in
plain Keras.
"""

from __future__ import annotations

import io
import json
import os
import sys

import numpy as np
import pytest
from tp_models import assert_equals_one_device, run_under_mpirun

from tfdist.errors import ConfigError

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "tensor_parallel_horovod_job.py")
TAGS = ("mlp-sgd", "mlp-adam", "transformer-adam")
CLIP_TAGS = ("mlp-sgd-clipnorm", "mlp-sgd-globalclipnorm", "mlp-sgd-ema")
LOCAL = "/job:localhost/replica:0/task:0/device:CPU:{}"
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ["PYTHONPATH"]])}


def run_job(out, ranks: int, devices: int, rows: int, plain_keras, tags=TAGS):
    from tfdist.cluster.launcher import launch

    log = io.StringIO()
    rc = launch([sys.executable, JOB, str(out), str(rows), ",".join(tags)], ranks, backend="horovod",
                devices_per_worker=devices, env=ENV, out=log, timeout_s=400)
    assert rc == 0, log.getvalue()[-4000:]
    records = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(ranks)]
    return records, plain_keras(out / "mlp.keras")


_LAUNCHED: dict = {}


def launched(rows: int, devices: int, tmp_path_factory, plain_keras):
    """One launch on 2 ranks per mesh, shared by every test that reads it: a mesh with the model axis across the
    ranks (one row) also runs the clipping and EMA tags."""
    if (rows, devices) not in _LAUNCHED:
        tags = TAGS + CLIP_TAGS if rows == 1 else TAGS
        _LAUNCHED[rows, devices] = run_job(tmp_path_factory.mktemp(f"tp_hvd_{rows}x{devices}"), 2, devices, rows,
                                           plain_keras, tags)
    return _LAUNCHED[rows, devices]


@pytest.fixture(scope="module", params=[(2, 2), (1, 1), (1, 2)],
                ids=["2x2-mesh2x2-batch", "2x1-mesh1x2-model", "2x2-mesh1x4-model"])
def job(request, tmp_path_factory, plain_keras):
    rows, devices = request.param
    return (rows, devices), *launched(rows, devices, tmp_path_factory, plain_keras)


def arrays(weights: dict) -> dict:
    return {path: np.asarray(value, "float64") for path, value in weights.items()}


def check_fit(records: list, tags=TAGS) -> None:
    """Every rank's logical weights equal one device's and each other's bit for bit; replicated variables and
    their optimizer slots bit-identical; History losses and evaluate global and equal on every rank."""
    for tag in tags:
        ref = arrays(records[0][tag]["reference"])
        for record in records[1:]:
            assert_equals_one_device(tag, arrays(records[0][tag]["weights"]), ref, arrays(record[tag]["weights"]))
            assert record[tag]["loss"] == records[0][tag]["loss"], tag
            assert record[tag]["evaluate"] == records[0][tag]["evaluate"], tag
            mine, other = records[0][tag]["replicated"], record[tag]["replicated"]
            assert set(mine) == set(other) and ("head/kernel" in mine or "out/kernel" in mine), tag
            for path in mine:
                np.testing.assert_array_equal(np.asarray(mine[path]), np.asarray(other[path]), err_msg=f"{tag} {path}")
            assert len(records[0][tag]["replicated_slots"]) == len(record[tag]["replicated_slots"]) > 0
            for a, b in zip(records[0][tag]["replicated_slots"], record[tag]["replicated_slots"]):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=tag)
        np.testing.assert_allclose(records[0][tag]["loss"], records[0][tag]["ref_loss"], rtol=1e-5)
        np.testing.assert_allclose(records[0][tag]["evaluate"], records[0][tag]["ref_evaluate"], rtol=1e-5)
    # Training moved the weights (the comparison above is not of two untrained models).
    assert not np.allclose(arrays(records[0]["mlp-adam"]["weights"])["up1/kernel"],
                           arrays(records[0]["mlp-sgd"]["weights"])["up1/kernel"])


def check_keras_file(records: list, plain: dict) -> None:
    trained, loaded = arrays(records[0]["mlp-adam"]["weights"]), arrays(plain["weights"])
    assert set(loaded) == set(trained)
    for path in trained:
        np.testing.assert_array_equal(loaded[path], trained[path], err_msg=path)
    assert plain["iterations"] == 12  # 3 epochs x 4 batches
    assert [r["mlp-adam"]["wrote_keras"] for r in records] == [True] + [False] * (len(records) - 1)


@pytest.mark.slow
def test_fit_over_horovod_ranks_equals_one_device_and_ranks_stay_bit_identical(job):
    _, records, _ = job
    assert [r["backend"] for r in records] == ["horovod", "horovod"]  # "auto" under the Horovod launcher
    check_fit(records)
    assert [(r["comm_pair_sum"], r["comm_world_sum"]) for r in records] == [(3.0, 2.0)] * 2  # tfdist.comm after it


@pytest.mark.slow
def test_each_rank_holds_its_rows_or_its_part_of_the_row(job):
    (rows, m), records, _ = job
    for rank, record in enumerate(records):
        assert record["mesh_rows"] == [[f"/device:CPU:{k}" for k in range(m)]]
        # the batch axis across the ranks: a whole row (every shard) on this rank's devices, half of every batch;
        # one row over both ranks: this rank's m shards only, every rank reading the whole batch
        assert record["num_replicas"] == rows
        first = 0 if rows == 2 else rank * m
        for tag in TAGS:
            for role, entries in record[tag]["shards"].items():
                expected = [(f"_shard_{first + k}", [LOCAL.format(k)]) for k in range(m)]
                assert [(path[path.rindex("_shard_"):], where) for path, _, where in entries] == expected, (tag, role)


@pytest.mark.slow
def test_predict_gives_each_row_its_part_of_every_batch(job):
    (rows, _), records, _ = job
    batch = {"mlp": 16, "transformer": 8}
    for tag in TAGS:
        full = np.asarray(records[0][tag]["ref_predict"])
        b = batch[tag.split("-")[0]]
        for rank, record in enumerate(records):  # rows across the ranks: rank r's rows; one row: the whole batch
            mine = [i for i in range(len(full)) if rows == 1 or (i % b) // (b // 2) == rank]
            np.testing.assert_allclose(record[tag]["predict"], full[mine], atol=1e-5, err_msg=tag)


@pytest.mark.slow
def test_a_traced_step_moves_bytes_with_horovod_only(job):
    (rows, _), records, _ = job
    for record in records:
        for tag in ("mlp-sgd", "transformer-adam"):
            ops = record[tag]["ops"]
            assert ops["CollectiveReduceV2"] == ops["CollectiveGatherV2"] == 0, (tag, ops)
            if rows == 2:  # the split layers' sums inside the rank; gradients: one grouped all-reduce per device
                assert ops["HorovodGroupedAllreduce"] == 2 and ops["HorovodAllreduce"] == 0, (tag, ops)
            else:  # Megatron's pairing across the ranks: 2 sums forward + 1 backward, no gather; no gradient sum
                assert ops["HorovodAllreduce"] == 3 and ops["HorovodAllgather"] == 0, (tag, ops)
                assert ops["HorovodGroupedAllreduce"] == 0, (tag, ops)
            assert record[tag]["counts"] == {"tp_all_reduce": 3, "tp_all_gather": 0, "tp_scatter": 0}, tag


@pytest.mark.slow
def test_the_chiefs_keras_file_loads_in_plain_keras(job):
    _, records, plain = job
    check_keras_file(records, plain)


@pytest.mark.slow
def test_two_rows_of_two_ranks_use_a_process_set_per_row_and_per_place(tmp_path, plain_keras):
    records, plain = run_job(tmp_path, 4, 1, 2, plain_keras)
    check_fit(records)
    check_keras_file(records, plain)
    for rank, record in enumerate(records):
        assert record["num_replicas"] == 2 and record["mesh_rows"] == [["/device:CPU:0"]]
        assert all(path.endswith(f"_shard_{rank % 2}") for entries in record["mlp-sgd"]["shards"].values()
                   for path, _, _ in entries)
        # 3 row sums in the row's set, 1 grouped gradient sum in the place's set, nothing through TF collectives
        for tag in ("mlp-sgd", "transformer-adam"):
            assert record[tag]["ops"] == {"HorovodAllreduce": 3, "HorovodGroupedAllreduce": 1, "HorovodAllgather": 0,
                                          "CollectiveReduceV2": 0, "CollectiveGatherV2": 0}, tag
        # tfdist.comm afterwards: its group [0, 1] is row 0's process set, shared (Horovod refuses a duplicate)
        assert record.get("comm_pair_sum") == (3.0 if rank < 2 else None) and record["comm_world_sum"] == 4.0


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2], ids=["2x1-mesh1x2", "2x2-mesh1x4"])
def test_clipping_and_ema_with_a_row_across_ranks_equal_one_device(devices, tmp_path_factory, plain_keras):
    """clipnorm / global_clipnorm (clipping all 12 steps) with the model axis across the ranks: each rank's shards'
    squares summed over the row's process set, replicated variables once; and Keras' EMA."""
    records, _ = launched(1, devices, tmp_path_factory, plain_keras)
    for tag in CLIP_TAGS:
        assert_equals_one_device(tag, arrays(records[0][tag]["weights"]), arrays(records[0][tag]["reference"]),
                                 arrays(records[1][tag]["weights"]))
        assert records[0][tag]["loss"] == records[1][tag]["loss"], tag
        np.testing.assert_allclose(records[0][tag]["loss"], records[0][tag]["ref_loss"], rtol=1e-5)


@pytest.mark.slow
def test_one_row_over_two_ranks_under_mpirun(tmp_path):
    # Horovod's MPI controller: mpirun sets OMPI_COMM_WORLD_RANK/SIZE (no HOROVOD_* variables); same checks.
    proc = run_under_mpirun(JOB, [str(tmp_path), "1", "mlp-sgd,mlp-adam"], {**os.environ, **ENV}, local_devices=1)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [r["backend"] for r in records] == ["horovod", "horovod"]
    check_fit(records, ("mlp-sgd", "mlp-adam"))
    for rank, record in enumerate(records):
        assert record["num_replicas"] == 1
        assert all(path.endswith(f"_shard_{rank}") for entries in record["mlp-sgd"]["shards"].values()
                   for path, _, _ in entries)
        assert record["mlp-sgd"]["ops"]["HorovodAllreduce"] == 3 and record["mlp-sgd"]["ops"]["CollectiveReduceV2"] == 0


# --- choosing the backend (no launch) -------------------------------------------------------------------------
def test_a_bad_backend_is_a_config_error_naming_it():
    import tfdist

    layout_map = tfdist.LayoutMap(tfdist.DeviceMesh((1, 1), ("batch", "model"), ["/cpu:0"]))
    with pytest.raises(ConfigError, match="backend must be one of .*'auto', 'tf', 'horovod'.* got 'nccl'"):
        tfdist.ModelParallelStrategy(layout_map, backend="nccl")


@pytest.mark.parametrize("env, expected", [
    ({}, "tf"),
    ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}, "horovod"),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, "horovod"),
    ({"TFDIST_RANK": "1", "TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1", "b:2"]},
                                                   "task": {"type": "worker", "index": 1}})}, "tf"),
])
def test_auto_picks_horovod_under_a_horovod_or_mpi_launcher(env, expected):
    from tfdist.tensor_parallel.horovod_processes import choose_backend

    assert choose_backend("auto", env) == expected
    assert choose_backend("tf", env) == "tf" and choose_backend("horovod", env) == "horovod"


def test_list_devices_names_horovod_ranks_as_tasks():
    import tfdist

    env = {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "TFDIST_LOCAL_DEVICES": "2"}
    assert tfdist.cluster.list_devices(environ=env) == [
        f"/job:worker/replica:0/task:{t}/device:CPU:{i}" for t in range(2) for i in range(2)]
    assert tfdist.cluster.list_devices(environ={"HOROVOD_RANK": "0", "HOROVOD_SIZE": "1",
                                                "TFDIST_LOCAL_DEVICES": "2"}) == ["/device:CPU:0", "/device:CPU:1"]

