"""ZeRO stage 3 across processes: 2 workers x 2 devices (tfdist.MultiWorkerMirroredStrategy) and 2 Horovod
ranks x 2 devices, real processes on loopback.

Three cluster start-ups in all (MWMS stage 0, MWMS stage 3, Horovod stages 0 and 3), each running
tests/zero3_procs_job.py, which trains a model with a layer called twice and one with BatchNorm for 20
Adam steps and records what the tests below compare: stage 3 equals stage 0 (weights, moving statistics,
Adam state, within 1e-4 relative), every replica holds 1/N of each parameter (shapes and devices read from
the variables), tfdist's ModelCheckpoint / save_model / BackupAndRestore write and restore the full
logical model, and the .keras files load in plain Keras with identical weights.
"""

from __future__ import annotations

import io
import json
import math
import os
import sys

import numpy as np
import pytest

from tfdist.cluster.launcher import launch
from tfdist.errors import ConfigError

JOB = os.path.join(os.path.dirname(__file__), "zero3_procs_job.py")
N = 4  # 2 processes x 2 devices
KINDS = ("tied", "bn")
PARAMS = {"tied": [(8, 16), (16,), (16, 16), (16,), (16, 1), (1,)],
          "bn": [(8, 16), (16,), (16,), (16,), (16, 1), (1,)]}  # trainable variables, in order
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}

def _launch(out, backend: str, *stages: int) -> str:
    log = io.StringIO()
    rc = launch([sys.executable, JOB, backend, str(out), *map(str, stages)], 2, devices_per_worker=2, out=log,
                timeout_s=480, backend="horovod" if backend == "hvd" else "tf", env=ENV)
    assert rc == 0, log.getvalue()[-4000:]
    return log.getvalue()


@pytest.fixture(scope="module", params=["mw", "hvd"])
def job(request, tmp_path_factory):
    backend = request.param
    out = tmp_path_factory.mktemp(f"zero3_{backend}")
    if backend == "mw":  # one stage per process: collectives are configured once, at start-up
        logs = _launch(out, "mw", 0) + _launch(out, "mw", 3)
    else:
        logs = _launch(out, "hvd", 0, 3)
    records = {(s, r): json.loads((out / f"{backend}-s{s}-rank{r}.json").read_text()) for s in (0, 3) for r in (0, 1)}
    return backend, out, records, logs


def flat(ws) -> np.ndarray:
    return np.concatenate([np.asarray(w, "float64") for w in ws])


def rel(a, b) -> float:
    a, b = flat(a), flat(b)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12))


@pytest.mark.slow
def test_stage3_equals_stage0_within_1e4(job):
    backend, _, records, _ = job
    for kind in KINDS:
        for r in (0, 1):  # per process: BatchNorm's moving statistics are per worker, as at stage 0
            s0, s3 = records[0, r][kind], records[3, r][kind]
            for key in ("w20", "w30", "slots", "slots30"):
                diff = rel(s3[key], s0[key])
                print(f"\n{backend} {kind} rank {r} {key}: stage 3 vs stage 0 max relative difference {diff:.2e}")
                assert diff <= 1e-4, (backend, kind, r, key)
            assert s3["iterations"] == s0["iterations"] == 20
            np.testing.assert_allclose(s3["loss"], s0["loss"], rtol=1e-5)
        assert not np.allclose(flat(records[3, 0][kind]["w20"]), flat(records[3, 0][kind]["w30"]))  # it trains
    assert records[3, 0]["bn"]["non_trainable"] == ["bn/moving_mean", "bn/moving_variance"]


@pytest.mark.slow
def test_an_embedding_with_adam_at_stage3_equals_stage0(job):
    """Lookups repeating within and across processes (the job's `lookups`): stage 3 hands Adam the slices of each
    piece, as stage 0 (stock's all-gathered slices) does."""
    backend, _, records, _ = job
    for r in (0, 1):
        np.testing.assert_allclose(flat(records[3, r]["lookups"]), flat(records[0, 0]["lookups"]), rtol=1e-6,
                                   atol=1e-6, err_msg=f"{backend} rank {r}")


@pytest.mark.slow
def test_trainable_weights_are_identical_on_both_processes(job):
    _, _, records, _ = job
    for kind in KINDS:
        a, b = records[3, 0][kind], records[3, 1][kind]
        trainable = [i for i in range(len(a["w20"])) if not (kind == "bn" and i in (4, 5))]  # moving stats
        for i in trainable:
            assert a["w20"][i] == b["w20"][i] and a["w30"][i] == b["w30"][i], (kind, i)
        assert a["slots"] == b["slots"]  # every process reads the same full Adam state


@pytest.mark.slow
def test_each_replica_holds_one_nth_of_every_parameter(job):
    backend, _, records, _ = job
    for kind in KINDS:
        for r in (0, 1):
            rec = records[3, r][kind]
            assert rec["replicas"] == N and rec["shard_ids"] == [2 * r, 2 * r + 1]
            shapes = PARAMS[kind]
            assert [p["size"] for p in rec["params"]] == [math.prod(s) for s in shapes]
            per_replica = 0
            for p in rec["params"]:
                k = math.ceil(p["size"] / N)
                assert p["pieces"] == [[k], [k]], (kind, p)  # read from the piece variables
                assert p["devices"] == rec["local_devices"], (kind, p)  # one piece on each local device
                per_replica += k
            total = sum(math.prod(s) for s in shapes)
            assert total / N <= per_replica < total / N + len(shapes)  # 1/N, plus < 1 element of padding a variable
            assert rec["slot_shapes"] == [[per_replica]] * 4  # Adam m and v: one shard per local replica
            memory = rec["memory"]  # strategy.memory_report: this process's two replicas
            assert memory["replicas"] == N and len(memory["rows"]) == 2, memory
            states = [row["optimizer_state"] for row in memory["rows"]]
            assert all(row["params"] == 4 * per_replica for row in memory["rows"]), memory
            if backend == "hvd":  # offload=True: both replicas' Adam shards on the host, CPU:0 (replica 0's too)
                assert rec["slot_devices"] == [rec["host_device"]] * 4, rec["slot_devices"]
                assert states[0] >= 16 * per_replica and states[1] <= 64, states
            else:
                assert all(8 * per_replica <= s for s in states), states
            if backend == "mw":
                assert all(d.startswith(f"/job:worker/replica:0/task:{r}/") for d in rec["local_devices"])


@pytest.mark.slow
def test_resume_from_backup_and_stage0_file_are_exact(job):
    _, _, records, logs = job
    for kind in KINDS:
        for r in (0, 1):
            rec = records[3, r][kind]
            # BackupAndRestore: resume == uninterrupted. The backup is the chief's, and BatchNorm's moving
            # statistics are per worker (at stage 0 too), so worker 1 resumes with worker 0's.
            own = [i for i in range(len(rec["w30"])) if not (kind == "bn" and r == 1 and i in (4, 5))]
            assert [rec["w30_resumed"][i] for i in own] == [rec["w30"][i] for i in own], kind
            assert rec["slots30_resumed"] == rec["slots30"], kind
            # the stage-0 .keras file (the chief's: its moving statistics too) scattered into the pieces exactly
            assert flat(rec["w20_loaded_from_stage0"]).tolist() == flat(records[0, 0][kind]["w20"]).tolist()
    assert "resuming at epoch 3" in logs


@pytest.mark.slow
def test_keras_files_hold_the_full_model_and_load_in_plain_keras(job, plain_keras):
    backend, out, records, _ = job
    for kind in KINDS:
        rec = records[3, 0][kind]
        for suffix in ("", "-saved"):  # tfdist.training.ModelCheckpoint (after epoch 2), save_model
            loaded = plain_keras(out / f"{backend}-{kind}-s3{suffix}.keras")
            weights = [np.ravel(w) for w in loaded["weight_list"]]
            slots = [np.ravel(v) for v in loaded["slot_values"].values()]
            assert flat(weights).tolist() == flat(rec["w20"]).tolist(), (kind, suffix)
            assert flat(slots).tolist() == flat(rec["slots"]).tolist(), (kind, suffix)
    assert not list(out.glob("*rank1*.keras"))


@pytest.mark.slow
def test_a_rank0_only_save_fails_clearly_under_horovod(job):
    backend, _, records, _ = job
    if backend != "hvd":
        pytest.skip("TF's collectives gather on read and time out clearly instead (test_zero_multiworker)")
    message = records[3, 0]["tied"]["rank0_only_save"]
    assert "every rank must take part" in message and "save_model" in message, message
    assert "rank(s) [1] did not make this read within 5 s" in message, message


@pytest.mark.parametrize("kwargs, message", [
    ({"zero_stage": 2, "fsdp_unit_bytes": 1024}, "needs zero_stage=3"),
    ({"zero_stage": 3, "fsdp_unit_bytes": 0}, "fsdp_unit_bytes must be a positive number"),
    ({"zero_stage": 3, "reshard_after_forward": "no"}, "reshard_after_forward must be True or False"),
    ({"zero_stage": 0, "offload": True}, "needs zero_stage=1, 2 or 3"),
])
def test_stage3_options_are_checked_before_anything_starts(kwargs, message):
    import tfdist  # checked before TensorFlow's runtime, the cluster or Horovod are touched

    for cls in (tfdist.MultiWorkerMirroredStrategy, tfdist.HorovodStrategy):
        with pytest.raises(ConfigError, match=message):
            cls(**kwargs)
