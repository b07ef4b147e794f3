"""TensorFlow's custom-training-loop tutorial on every tfdist strategy, against stock MirroredStrategy on the
same two replicas, with checkpoints that go from the custom loop into `fit` and back (tests/ctl_job.py)."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tfdist.cluster.launcher import launch

JOB = os.path.join(os.path.dirname(__file__), "ctl_job.py")
STEPS = 12  # 3 epochs of 4 global batches


def _result(text: str) -> dict:
    return json.loads(text.split("RESULT ", 1)[1].splitlines()[0])


def _in_process(kind: str, out) -> dict:
    proc = subprocess.run([sys.executable, JOB, kind, str(out)], capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _result(proc.stdout)


def _launched(kind: str, out) -> dict:
    log = io.StringIO()
    backend = "horovod" if kind.startswith("horovod") else "tf"
    rc = launch([sys.executable, JOB, kind, str(out)], 2, backend=backend, out=log, timeout_s=300,
                env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert rc == 0, log.getvalue()[-4000:]
    return _result(log.getvalue())  # the chief's "[0] RESULT {...}" line


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    return _in_process("stock", tmp_path_factory.mktemp("stock"))


def _assert_like_stock(got: dict, stock: dict) -> None:
    assert got["iterations"] == stock["iterations"] == STEPS
    assert got["losses"] == pytest.approx(stock["losses"], rel=1e-5)
    assert got["fit_loss"] == pytest.approx(stock["fit_loss"], rel=1e-5)
    for a, b in zip(got["weights"], stock["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    if got["slots"] is None:  # tensor parallelism: slots per shard; the weights above already depend on them
        return
    # Adam's moments survived both trips (full logical state, as plain Keras keeps it)
    assert len(got["slots"]) == len(stock["slots"])
    for a, b in zip(got["slots"], stock["slots"]):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-7)


@pytest.mark.slow
def test_stock_round_trip_through_fit_equals_three_uninterrupted_epochs(stock):
    # The reference itself: model and optimizer state cross CTL -> fit -> CTL without loss.
    for a, b in zip(stock["weights"], stock["uninterrupted"]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tfdist", "zero1", "zero2", "zero3", "placement", "tensor-parallel"])
def test_custom_loop_in_one_process(kind, stock, tmp_path):
    _assert_like_stock(_in_process(kind, tmp_path), stock)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["multiworker", "multiworker-zero2", "horovod", "horovod-zero2", "horovod-zero3"])
def test_custom_loop_on_two_processes(kind, stock, tmp_path):
    if kind.startswith("horovod"):
        pytest.importorskip("horovod.tensorflow", reason="Horovod is built by `make test` (make horovod)")
    _assert_like_stock(_launched(kind, tmp_path), stock)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["horovod-zero2", "horovod-zero3"])
def test_custom_loop_under_mpirun(kind, stock, tmp_path):
    """Horovod's MPI controller has no rendezvous store: every rank's checkpoint.save() is agreed on over MPI."""
    pytest.importorskip("horovod.tensorflow", reason="Horovod is built by `make test` (make horovod)")
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("OpenMPI's mpirun is installed by `make test` (apt openmpi-bin)")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "OMPI_ALLOW_RUN_AS_ROOT": "1", "PYTHONFAULTHANDLER": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "PYTHONPATH": os.path.dirname(os.path.dirname(JOB))}
    for var in ("HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT", "HOROVOD_RANK",
                "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        env.pop(var, None)
    proc = subprocess.run([mpirun, "-np", "2", "--oversubscribe", sys.executable, JOB, kind, str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _assert_like_stock(_result(proc.stdout), stock)
