"""The migration guide's side-by-side scripts (docs/examples): a Horovod custom loop and the same training
under `tfdist.HorovodStrategy` + `fit` reach the same weights, each run as the guide says."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "docs", "examples")
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}  # PYTHONPATH: conftest's (this clone, tests/site)


def run_two_horovod_ranks(script: str, out: str) -> str:
    cmd = [sys.executable, "-m", "tfdist", "launch", "--backend", "horovod", "-n", "2", "--",
           sys.executable, os.path.join(EXAMPLES, script), out]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_horovod_loop_and_tfdist_fit_train_to_the_same_weights(tmp_path):
    before, after = str(tmp_path / "before.npz"), str(tmp_path / "after.npz")
    assert "last loss" in run_two_horovod_ranks("horovod_before.py", before)
    assert "last loss" in run_two_horovod_ranks("horovod_after.py", after)
    a, b = np.load(before), np.load(after)
    assert len(a.files) == len(b.files) == 8  # the CNN's four kernels and four biases
    initial = __import__("tfdist").models.cnn(filters=(8, 16), dense_units=32).get_weights()
    for key, start in zip(a.files, initial):
        assert not np.allclose(a[key], start), f"{key}: training did not move it"
        # the same 64 samples per step; only the summation order of the mean differs
        np.testing.assert_allclose(b[key], a[key], rtol=0, atol=1e-6, err_msg=key)
