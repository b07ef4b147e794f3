"""ZeRO over ModelParallelStrategy's batch axis across Horovod ranks (each rank whole mesh rows).

Real launches through tfdist's launcher in its Horovod mode (Gloo; tests/tensor_parallel_zero_horovod_job.py): the
MLP with Adam, 12 steps, at zero_stage 0, 1, 2 and 3 and on one device, on
- 2 ranks x 2 devices, mesh 2 x 2 (one row per rank, the model axis inside it);
- 2 ranks x 4 devices, mesh 4 x 2 with each rank's rows listed against device order (row 0 of rank 0 on CPU:2,
  CPU:3): a group's copies are numbered by mesh row, not by device index;
- 2 ranks x 2 devices, mesh 2 x 2, under mpirun (Horovod's MPI controller), stages 2 and 3;
- 2 ranks x 2 devices, mesh 2 x 2, Adam with global_clipnorm and with clipnorm, stages 1-3, against one device.
Checked: every stage equal to one device within 1e-4 relative and to stage 0 bit for bit, ranks bit-identical
(weights and the gathered logical Adam state), each rank's optimizer state 1/R of stage 0's (R = mesh rows, read from
the engines' piece variables), each group's pieces numbered by global mesh row, and the chief's .keras of each stage
loading in plain Keras with the logical Adam state (equal to stage 0's file).
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
JOB = os.path.join(HERE, "tensor_parallel_zero_horovod_job.py")
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2",
       "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE, os.environ["PYTHONPATH"]])}
STAGES = (0, 1, 2, 3)


# Each group's norms are summed over the ranks (hvd.allreduce); these clips move one device's weights by 0.53
# (global_clipnorm) and 0.66 (clipnorm) relative, so an unclipped or per-rank-clipped update cannot pass.
CLIPS = {"global_clipnorm": {"global_clipnorm": 0.1}, "clipnorm": {"clipnorm": 0.05}}


def run_job(out, devices: int, rows: int, plain_keras, variants: dict | None = None):
    from tfdist.cluster.launcher import launch

    log = io.StringIO()
    rc = launch([sys.executable, JOB, str(out), str(rows), ",".join(map(str, STAGES)), json.dumps(variants or {})],
                2, backend="horovod", devices_per_worker=devices, env=ENV, out=log, timeout_s=400)
    assert rc == 0, log.getvalue()[-4000:]
    records = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    files = {}
    for stage in STAGES:
        plain = plain_keras(out / f"stage{stage}.keras")
        adam = {path.split("/", 1)[1]: value for path, value in plain["slot_values"].items() if plain["slots"][path]}
        files[stage] = {"weights": plain["weights"], "adam": adam, "iterations": plain["iterations"]}
    return records, files


_LAUNCHED: dict = {}


def launched(devices: int, rows: int, tmp_path_factory, plain_keras):
    """One launch on 2 ranks per mesh, shared by every test that reads it; the 2 x 2 mesh also runs the clipped
    Adam variants at stages 1-3."""
    if (devices, rows) not in _LAUNCHED:
        _LAUNCHED[devices, rows] = run_job(tmp_path_factory.mktemp(f"tp_zero_hvd_{rows}"), devices, rows, plain_keras,
                                           CLIPS if (devices, rows) == (2, 2) else None)
    return _LAUNCHED[devices, rows]


@pytest.fixture(scope="module", params=[(2, 2), (4, 4)], ids=["2x2-mesh2x2", "2x4-mesh4x2-rows-against-devices"])
def job(request, tmp_path_factory, plain_keras):
    devices, rows = request.param
    return rows, *launched(devices, rows, tmp_path_factory, plain_keras)


def arrays(values: dict) -> dict:
    return {path: np.asarray(value, "float64") for path, value in values.items()}


@pytest.mark.slow
def test_zero_over_horovod_equals_one_device_and_stage_0_and_ranks_stay_bit_identical(job):
    rows, records, _ = job
    assert [r["backend"] for r in records] == ["horovod", "horovod"]
    ref = arrays(records[0]["reference"])
    stage0 = records[0]["0"]
    for stage in map(str, STAGES):
        got, other = arrays(records[0][stage]["weights"]), arrays(records[1][stage]["weights"])
        assert_equals_one_device(f"zero{stage}-adam", got, ref, other)
        assert records[0][stage]["weights"] == stage0["weights"], stage  # the same sums in the same order
        # the logical Adam state, gathered on every rank: bit-identical across ranks and equal to stage 0's
        assert records[0][stage]["adam"] == records[1][stage]["adam"], stage
        assert records[0][stage]["adam"] == stage0["adam"], stage


@pytest.mark.slow
def test_each_rank_keeps_one_piece_per_row_numbered_by_mesh_row(job):
    rows, records, _ = job
    per = rows // 2
    for record in records:
        full = record["0"]["state_elements"]  # stage 0: every local row's copy of every slot
        assert full > 0
        for stage in map(str, STAGES[1:]):
            entry = record[stage]
            # 1/R of stage 0's per rank (R = rows); each group's flat pieces pad to a multiple of R
            assert full / rows <= entry["state_elements"] <= full / rows + 2 * rows * len(entry["groups"]), stage
            # group k: column k's copies of this rank's rows, in mesh-row order; its pieces: the global mesh rows
            assert entry["shard_ids"] == [[record["rank"] * per + i for i in range(per)]] * len(entry["groups"])
            columns = [[row[k] for row in record["mesh_rows"]] for k in range(len(record["mesh_rows"][0]))]
            for group in entry["groups"]:
                assert any(all(d.endswith(c) for d, c in zip(group, column)) for column in columns), (group, columns)
    if rows == 4:  # rows against device order: rank r's row 0 on CPU:2, CPU:3
        assert records[0]["mesh_rows"][0] == ["/device:CPU:2", "/device:CPU:3"]


@pytest.mark.slow
def test_the_chiefs_keras_files_load_in_plain_keras_with_the_logical_adam_state(job):
    _, records, files = job
    for stage in STAGES:
        assert [r[str(stage)]["wrote"] for r in records] == [True, False]
        plain = files[stage]
        assert plain["iterations"] == 12
        assert plain["weights"] == files[0]["weights"] and plain["adam"] == files[0]["adam"], stage
        # logical slots: one per unsplit variable, with its shape, close to one device's Adam state
        reference = arrays(records[0]["reference_adam"])
        assert set(plain["adam"]) == set(reference)
        for path, value in arrays(plain["adam"]).items():
            assert value.shape == reference[path].shape, path
            scale = max(float(np.max(np.abs(reference[path]))), 1e-6)
            assert float(np.max(np.abs(value - reference[path]))) <= 1e-3 * scale, (stage, path)
        trained = arrays(records[0][str(stage)]["weights"])
        for path, value in trained.items():
            layer, name = path.split("/")
            np.testing.assert_array_equal(arrays(plain["weights"])[f"{layer}/{name}"], value, err_msg=path)


def test_zero_with_rows_spanning_horovod_ranks_is_refused_naming_zero_stage():
    from tfdist.comm.tf_config import ClusterConfig
    from tfdist.tensor_parallel.processes import ProcessRows, check_process_options

    whole = ProcessRows(ClusterConfig({"worker": ["a", "b"]}, "worker", 0), 0, 2, [["/device:CPU:0"]], 0, 1)
    for stage in (1, 2, 3):
        check_process_options(whole, stage, None, "stage", "horovod")  # whole rows per rank: runs
    span = ProcessRows(ClusterConfig({"worker": ["a", "b"]}, "worker", 0), 0, 2, [["/device:CPU:0"]], 0, 1,
                       span_first=0, row_size=2, span_rows=1)
    with pytest.raises(ConfigError, match=r"zero_stage=2 with the model axis across processes.*zero_stage=0"):
        check_process_options(span, 2, None, "stage", "horovod")


@pytest.mark.slow
def test_zero_over_horovod_under_mpirun_equals_stage_0(tmp_path):
    # Horovod's MPI controller (OMPI_COMM_WORLD_RANK/SIZE, no HOROVOD_* variables): stages 2 and 3 on mesh 2 x 2.
    proc = run_under_mpirun(JOB, [str(tmp_path), "2", "0,2,3"], {**os.environ, **ENV}, local_devices=2)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [r["backend"] for r in records] == ["horovod", "horovod"]
    ref = arrays(records[0]["reference"])
    for stage in ("2", "3"):
        assert_equals_one_device(f"zero{stage}-adam", arrays(records[0][stage]["weights"]), ref,
                                 arrays(records[1][stage]["weights"]))
        assert records[0][stage]["weights"] == records[0]["0"]["weights"], stage
        assert records[0][stage]["adam"] == records[1][stage]["adam"] == records[0]["0"]["adam"], stage
        for record in records:  # half of stage 0's optimizer state per rank (+ < 1 element per flat slot of padding)
            full = record["0"]["state_elements"]
            assert full / 2 <= record[stage]["state_elements"] <= full / 2 + 2 * len(record[stage]["groups"]), stage


@pytest.mark.slow
@pytest.mark.parametrize("clip", sorted(CLIPS))
def test_zero_over_horovod_clips_the_summed_gradient_as_one_device(clip, tmp_path_factory, plain_keras):
    records, _ = launched(2, 2, tmp_path_factory, plain_keras)
    ref = arrays(records[0][f"reference:{clip}"])
    for stage in ("1", "2", "3"):
        got, other = records[0][f"{clip}:{stage}"], records[1][f"{clip}:{stage}"]
        assert_equals_one_device(f"zero{stage}-adam-{CLIPS[clip]}", arrays(got["weights"]), ref,
                                 arrays(other["weights"]))
        assert got["adam"] == other["adam"], stage
