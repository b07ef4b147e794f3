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


IN_PROCESS = ("stock", "tfdist", "zero1", "zero2", "zero3", "placement", "tensor-parallel")
HOROVOD = ("horovod", "horovod-zero2", "horovod-zero3")


def _results(text: str) -> dict:
    """{kind: result} from the chief's `RESULT KIND {json}` lines (under the launcher: `[0] RESULT ...`)."""
    found = {}
    for line in text.splitlines():
        if "RESULT " in line:
            kind, payload = line.split("RESULT ", 1)[1].split(" ", 1)
            found[kind] = json.loads(payload)
    return found


def _launched(kinds, out) -> dict:
    log = io.StringIO()
    backend = "horovod" if kinds[0].startswith("horovod") else "tf"
    rc = launch([sys.executable, JOB, ",".join(kinds), str(out)], 2, backend=backend, out=log, timeout_s=300,
                env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert rc == 0, log.getvalue()[-4000:]
    return _results(log.getvalue())


@pytest.fixture(scope="module")
def in_process(tmp_path_factory) -> dict:
    """Every in-process kind, one after another in one process (TensorFlow started once)."""
    out = tmp_path_factory.mktemp("ctl")
    proc = subprocess.run([sys.executable, JOB, ",".join(IN_PROCESS), str(out)], capture_output=True, text=True,
                          timeout=600, check=False, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _results(proc.stdout)


@pytest.fixture(scope="module")
def stock(in_process):
    return in_process["stock"]


@pytest.fixture(scope="module")
def horovod_gloo(tmp_path_factory) -> dict:
    """The Horovod kinds in one launch of 2 ranks (one HorovodStrategy after another)."""
    pytest.importorskip("horovod.tensorflow", reason="Horovod is built by `make test` (make horovod)")
    return _launched(HOROVOD, tmp_path_factory.mktemp("ctl_hvd"))


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
@pytest.mark.parametrize("kind", IN_PROCESS[1:])
def test_custom_loop_in_one_process(kind, in_process, stock):
    _assert_like_stock(in_process[kind], stock)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["multiworker", "multiworker-zero2"])
def test_custom_loop_on_two_processes(kind, stock, tmp_path):
    _assert_like_stock(_launched([kind], tmp_path)[kind], stock)


@pytest.mark.slow
@pytest.mark.parametrize("kind", HOROVOD)
def test_custom_loop_on_two_horovod_ranks(kind, horovod_gloo, stock):
    _assert_like_stock(horovod_gloo[kind], stock)


@pytest.mark.slow
def test_custom_loop_under_mpirun(stock, tmp_path):
    """Horovod's MPI controller has no rendezvous store: every rank's checkpoint.save() is agreed on over MPI
    (stages 2 and 3 in one run)."""
    pytest.importorskip("horovod.tensorflow", reason="Horovod is built by `make test` (make horovod)")
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("OpenMPI's mpirun is installed by `make test` (apt openmpi-bin)")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "OMPI_ALLOW_RUN_AS_ROOT": "1", "PYTHONFAULTHANDLER": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}  # PYTHONPATH: conftest's (this clone, tests/site)
    for var in ("HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT", "HOROVOD_RANK",
                "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        env.pop(var, None)
    kinds = ["horovod-zero2", "horovod-zero3"]
    proc = subprocess.run([mpirun, "-np", "2", "--oversubscribe", sys.executable, JOB, ",".join(kinds),
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = _results(proc.stdout)
    for kind in kinds:
        _assert_like_stock(results[kind], stock)
