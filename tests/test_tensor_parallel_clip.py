"""Clipping on ModelParallelStrategy by the norms one device takes: `clipnorm` by each logical variable's norm
(a split variable's shards sit on several devices, in several ZeRO groups: the norm is sqrt of the sum of its
shards' squared norms), `global_clipnorm` by the norm over every group, also at zero_stage=3 and with
`gradient_accumulation_steps`. Checked against one device with the global batch."""

from __future__ import annotations

import io
import os
import sys

import keras
import numpy as np
import pytest

from tfdist.cluster.launcher import launch
from test_tensor_parallel_zero import assert_close, fit, logical_weights, strategy_for

# 0.02 (clipnorm) and 0.05 (global) are below the gradients' norms: the clipping changes every step.
CLIPNORM_SGD = lambda: keras.optimizers.SGD(0.1, momentum=0.9, clipnorm=0.02)  # noqa: E731
GLOBAL_ADAM = lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.05)  # noqa: E731
GLOBAL_SGD_ACCUMULATED = lambda: keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=0.05,  # noqa: E731
                                                      gradient_accumulation_steps=2)
_ONE: dict = {}


def one_device(name: str, optimizer) -> dict[str, np.ndarray]:
    """The MLP's logical weights after 20 steps on one device (cached)."""
    if name not in _ONE:
        _ONE[name] = logical_weights(fit(None, optimizer))
    return _ONE[name]


def clipping_mattered(one: dict, optimizer_without_clipping) -> None:
    unclipped = logical_weights(fit(None, optimizer_without_clipping))
    assert max(np.abs(one[k] - unclipped[k]).max() / np.abs(one[k]).max() for k in one) > 0.05


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_clipnorm_on_split_variables_takes_the_logical_variables_norm(stage):
    """Before: each shard clipped by its own norm (0.50 relative off one device at every stage)."""
    one = one_device("clipnorm_sgd", CLIPNORM_SGD)
    assert_close(one, logical_weights(fit(strategy_for((2, 2), zero_stage=stage), CLIPNORM_SGD)), 1e-5)
    if stage == 0:
        clipping_mattered(one, lambda: keras.optimizers.SGD(0.1, momentum=0.9))


@pytest.mark.parametrize("stage", [1, 3])
def test_clipnorm_with_gradient_accumulation_clips_the_accumulated_mean_by_the_logical_norm(stage):
    optimizer = lambda: keras.optimizers.SGD(0.1, momentum=0.9, clipnorm=0.02,  # noqa: E731
                                             gradient_accumulation_steps=2)
    one = one_device("clipnorm_sgd_accumulated", optimizer)
    assert_close(one, logical_weights(fit(strategy_for((2, 2), zero_stage=stage), optimizer)), 1e-5)


def test_global_clipnorm_at_stage_3_takes_the_norm_over_every_group():
    """Refused before (each group's Zero3Engine would have taken its own norm)."""
    one = one_device("global_adam", GLOBAL_ADAM)
    assert_close(one, logical_weights(fit(strategy_for((2, 2), zero_stage=3), GLOBAL_ADAM)), 1e-4)
    clipping_mattered(one, lambda: keras.optimizers.Adam(0.01))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_global_clipnorm_with_gradient_accumulation_clips_the_accumulated_mean(stage):
    """Refused before at stages 1/2 (the norm was taken per micro-step); Keras clips the accumulated mean on the
    update step, and so does every group here (the norm over every group of the mean it is about to apply)."""
    one = one_device("global_sgd_accumulated", GLOBAL_SGD_ACCUMULATED)
    assert_close(one, logical_weights(fit(strategy_for((2, 2), zero_stage=stage), GLOBAL_SGD_ACCUMULATED)), 1e-5)
    if stage == 1:
        clipping_mattered(one, lambda: keras.optimizers.SGD(0.1, momentum=0.9, gradient_accumulation_steps=2))


def test_clipnorm_on_a_2x2x2_mesh_with_pipeline_stages_equals_one_device(python):
    """Rank-3 mesh (batch, stage, model), 2 micro-batches: a split variable's shards sit in the groups of its
    stage; clipnorm by the logical variables' norms at zero_stage 0, 2 and 3 (20 SGD steps)."""
    out = python("""
        import numpy as np, keras, tfdist
        tfdist.devices.virtual_cpus(8)
        import sys; sys.path.insert(0, "tests")
        from test_tensor_parallel import mlp_layout
        from test_tensor_parallel_zero import fit, logical_weights
        mesh = tfdist.DeviceMesh((2, 2, 2), ("batch", "stage", "model"), [f"/cpu:{i}" for i in range(8)])
        sgd = lambda: keras.optimizers.SGD(0.1, momentum=0.9, clipnorm=0.02)
        one = logical_weights(fit(None, sgd))
        for stage in (0, 2, 3):
            strategy = tfdist.ModelParallelStrategy(mlp_layout(mesh), zero_stage=stage, placement=["up2"],
                                                    micro_batches=2)
            got = logical_weights(fit(strategy, sgd))
            print("RESULT", stage, max(float(np.abs(one[k] - got[k]).max() / max(np.abs(one[k]).max(), 1e-3))
                                       for k in one))
    """)
    results = [line.split() for line in out.stdout.splitlines() if line.startswith("RESULT")]
    assert [r[1] for r in results] == ["0", "2", "3"]
    assert all(float(r[2]) <= 1e-5 for r in results), results


ROW_ACROSS_PROCESSES = """
import sys
import tfdist
mesh = tfdist.DeviceMesh((1, 4), ("batch", "model"), tfdist.cluster.list_devices())  # one row over 2 processes
from tp_models import mlp, mlp_layout
strategy = tfdist.ModelParallelStrategy(mlp_layout(mesh), batch_dim_name="batch", timeout_s=60)
import keras
import numpy as np
for clip in ({"clipnorm": 0.02}, {"global_clipnorm": 0.05}):
    with strategy.scope():
        model = mlp(11)
        model.compile(optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=2, **clip),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    try:
        model.fit(np.zeros((16, 12), "float32"), np.zeros(16, "int32"), batch_size=16, verbose=0)
    except tfdist.errors.ConfigError as error:
        print("REFUSED", error, flush=True)
"""


@pytest.mark.slow
def test_norm_clipping_with_accumulation_and_rows_across_processes_is_refused():
    """Each process holds only its own shards; with gradient_accumulation_steps Keras' own path clips, by this
    process's shards' norms only, so both norms are refused there (without accumulation they are exact:
    tests/test_tensor_parallel_model_procs.py)."""
    log = io.StringIO()
    rc = launch([sys.executable, "-c", ROW_ACROSS_PROCESSES], 2, devices_per_worker=2, out=log, timeout_s=300,
                env={"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": os.pathsep.join(
                    [os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])})
    refused = [line for line in log.getvalue().splitlines() if "REFUSED" in line]
    assert rc == 0 and len(refused) == 4, log.getvalue()[-4000:]  # two optimizers on each of the two processes
    assert sum("REFUSED clipnorm=0.02 with the model axis across processes" in line for line in refused) == 2, refused
    assert sum("REFUSED global_clipnorm=0.05 with the model axis across processes" in line for line in refused) == 2
    assert all("gradient_accumulation_steps=2" in line for line in refused), refused
