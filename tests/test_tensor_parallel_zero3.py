"""ZeRO stage 3 over the batch axis of ModelParallelStrategy: every variable's R row copies become R pieces (piece r
on row r's copy's device), all-gathered per layer for its forward and again for its backward. Checked against
stage 0 and one device (Adam, 20 steps), with the pieces' devices and bytes read from the variables, `.keras` files
and tf.train.Checkpoints that hold the logical model and optimizer, and `memory_report`."""

from __future__ import annotations

import json
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.errors import ConfigError
from tfdist.zero.fsdp.mesh_engine import GroupedZero3Engine
from test_tensor_parallel import data, mlp, mlp_layout, transformer_block, transformer_layout
from test_tensor_parallel_zero import assert_close, fit, logical_optimizer_state, logical_weights, strategy_for

ADAM = lambda: keras.optimizers.Adam(0.01)  # noqa: E731
RNG = np.random.RandomState(2)
TRANSFORMER_XY = RNG.rand(32, 6, 16).astype("float32"), RNG.randint(0, 3, size=32)
MODELS = {"mlp": (mlp, mlp_layout, {}),  # 64 samples, batch 16, 5 epochs: 20 steps
          "transformer": (transformer_block, transformer_layout, {"xy": TRANSFORMER_XY, "batch_size": 8})}
_TRAINED: dict = {}


def trained(model: str, shape: tuple | None, stage: int = 0):
    """(strategy, model) after 20 Adam steps; shape None: one device. Cached: each configuration trains once."""
    key = (model, shape, stage)
    if key not in _TRAINED:
        model_fn, layout, run = MODELS[model]
        strategy = None if shape is None else strategy_for(shape, zero_stage=stage, layout=layout)
        _TRAINED[key] = strategy, fit(strategy, ADAM, model_fn=model_fn, **run)
    return _TRAINED[key]


def weights(model: str, shape: tuple | None, stage: int = 0, drop=()) -> dict[str, np.ndarray]:
    found = logical_weights(trained(model, shape, stage)[1])
    return {k: v for k, v in found.items() if k not in drop}


# --- bad input -----------------------------------------------------------------------------------------------
def test_unsupported_combinations_raise_config_errors_naming_zero_stage(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["localhost:1", "localhost:2"]},
                                                "task": {"type": "worker", "index": 0}}))
    # Across processes (tests/test_tensor_parallel_procs.py runs rows inside processes): rows that span processes
    # (the model axis across them) are refused before anything starts.
    devices = [f"/job:worker/replica:0/task:{t}/device:CPU:{i}" for t in range(2) for i in range(4)]
    monkeypatch.setenv("TFDIST_LOCAL_DEVICES", "4")
    mesh = tfdist.DeviceMesh((1, 8), ("batch", "model"), devices)
    with pytest.raises(ConfigError, match=r"zero_stage=3 with the model axis across processes"):
        tfdist.ModelParallelStrategy(mlp_layout(mesh), zero_stage=3)


# --- training equals stage 0 and one device -----------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(2, 2), (4, 1)], ids=["2x2", "4x1"])
def test_mlp_equals_stage_0_and_one_device_with_each_row_holding_one_piece(shape):
    strategy, model = trained("mlp", shape, 3)
    sharded = weights("mlp", shape, 3)
    assert_close(weights("mlp", shape, 0), sharded, 1e-4)
    assert_close(weights("mlp", None), sharded, 1e-4)
    start = logical_weights(mlp())
    assert max(np.abs(start[k] - sharded[k]).max() for k in start) > 1e-2  # 20 steps did train
    engine = tfdist.zero.engine_of(model)
    assert isinstance(engine, GroupedZero3Engine) and engine.stage == 3
    rows = shape[0]
    # every trainable variable's storage: R pieces, piece r on row r's device of its column (the row's first
    # device for replicated variables); nothing holds the whole variable
    for variable, param in zip(engine.variables, engine.params):
        assert variable.value is param and len(param.components) == rows
        k = int(variable.path.rsplit("_shard_", 1)[1]) if "_shard_" in variable.path else 0
        assert [_key(c.device) for c in param.components] == [_key(row[k]) for row in strategy.mesh_rows]
        assert [tuple(c.shape) for c in param.components] == [(-(-int(np.prod(variable.shape)) // rows),)] * rows
    # Adam's slots: one piece per row too, next to the parameter piece
    momentum = engine.engines[0].state.piece_variables("momentum", 1)[0]
    assert _key(momentum.value.device) == _key(engine.engines[0].params[0].components[1].device)
    assert tuple(momentum.shape) == tuple(engine.engines[0].params[0].components[1].shape)
    # evaluate and predict gather the pieces too
    x, y = data()
    _, reference = trained("mlp", shape, 0)
    assert model.evaluate(x, y, verbose=0) == pytest.approx(reference.evaluate(x, y, verbose=0), rel=1e-5)
    np.testing.assert_allclose(model.predict(x[:8], verbose=0), reference.predict(x[:8], verbose=0), atol=1e-5)


def test_weight_decay_ema_accumulation_and_clipnorm_on_the_pieces_equal_one_device():
    optimizer = lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1, use_ema=True, ema_overwrite_frequency=3,  # noqa
                                               gradient_accumulation_steps=2, clipnorm=1.0)
    assert_close(logical_weights(fit(None, optimizer)), logical_weights(fit(strategy_for(zero_stage=3), optimizer)),
                 1e-4)


def test_transformer_block_on_2x2_equals_stage_0_and_one_device():
    # The key projection's bias cannot change the softmax: its gradient is rounding noise that Adam scales up to
    # steps of ~lr (see test_tensor_parallel_zero); stage 3 sums that noise in another order (the recomputed
    # forward), so it is left out of both comparisons.
    drop = ("mha/key/bias",)
    sharded = weights("transformer", (2, 2), 3, drop=drop)
    assert_close(weights("transformer", (2, 2), 0, drop=drop), sharded, 1e-4)
    assert_close(weights("transformer", None, drop=drop), sharded, 1e-4)
    engine = tfdist.zero.engine_of(trained("transformer", (2, 2), 3)[1])
    # the attention is one unit (its query, key and value projections compute together); its weights sit in both
    # column groups, each gathered over its own two rows
    assert [u.name for u in engine.units] == ["mha", "ln1", "ff_up", "ff_down", "ln2", "out"]
    columns = [sorted(engine.units[0].params[j][0].path for j in group) for _, group in engine.units[0].groups]
    assert columns == [sorted([f"{name}_shard_{k}" for name in ("query/kernel", "query/bias", "key/kernel", "key/bias",
                                                                "value/kernel", "value/bias", "attention_output/kernel")]
                              + (["mha/attention_output/bias"] if k == 0 else [])) for k in (0, 1)]


def test_data_by_pipeline_by_model_2x2x2_on_8_devices_equals_stage_0_and_one_device(python):
    """Rank-3 mesh (batch, stage, model) = (2, 2, 2) with 2 micro-batches: each stage's variables are pieces over
    the two rows' devices of that stage's group, gathered per layer and per micro-batch."""
    out = python("""
        import numpy as np, keras, tfdist
        tfdist.devices.virtual_cpus(8)
        import sys; sys.path.insert(0, "tests")
        from test_tensor_parallel import mlp, mlp_layout
        from test_tensor_parallel_zero import fit, logical_weights
        mesh = tfdist.DeviceMesh((2, 2, 2), ("batch", "stage", "model"), [f"/cpu:{i}" for i in range(8)])
        adam = lambda: keras.optimizers.Adam(0.01)
        def run(stage):
            strategy = tfdist.ModelParallelStrategy(mlp_layout(mesh), zero_stage=stage, placement=["up2"],
                                                    micro_batches=2)
            return strategy, fit(strategy, adam)
        one = logical_weights(fit(None, adam))
        zero = logical_weights(run(0)[1])
        strategy, model = run(3)
        got = logical_weights(model)
        print("RESULT", max(float(np.abs(zero[k] - got[k]).max() / max(np.abs(zero[k]).max(), 1e-3)) for k in zero),
              max(float(np.abs(one[k] - got[k]).max() / max(np.abs(one[k]).max(), 1e-3)) for k in one))
        engine = tfdist.zero.engine_of(model)
        groups = sorted(tuple(int(d.rsplit(":", 1)[1]) for d in g) for g in engine.group_devices)
        print("GROUPS", groups, sorted({len(p.components) for p in engine.params}))
    """)
    result = next(line for line in out.stdout.splitlines() if line.startswith("RESULT")).split()
    assert float(result[1]) <= 1e-4 and float(result[2]) <= 1e-4, result
    # one group per (stage, model position): devices[row][stage][k] of both rows; two pieces per variable
    assert next(line for line in out.stdout.splitlines() if line.startswith("GROUPS")) == \
        "GROUPS [(0, 4), (1, 5), (2, 6), (3, 7)] [2]"


# --- the parameters' bytes and memory_report --------------------------------------------------------------------
@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_each_device_holds_one_rth_of_stage_0s_parameters_gradients_and_optimizer_state(model):
    zero_strategy, zero_model = trained(model, (2, 2), 0)
    strategy, sharded = trained(model, (2, 2), 3)
    before, after = zero_strategy.memory_report(zero_model), strategy.memory_report(sharded)
    assert after.zero_stage == 3 and "ZeRO stage 3" in str(after)
    padding = 4 * len(sharded.trainable_weights)  # < one element per variable and piece (R = 2, float32)
    for full, piece in zip(before.rows, after.rows):
        assert full.device == piece.device
        for what in ("params", "gradients"):
            assert 0 <= 2 * getattr(piece, what) - getattr(full, what) <= 2 * padding, (what, full, piece)
        # Adam's two slots per piece, and the optimizer's scalars (iterations, learning rate) on the first rows
        assert 0 <= 2 * piece.optimizer_state - full.optimizer_state <= 4 * padding + 64, (full, piece)
    assert after.replicated == before.replicated  # the logical model and state are unchanged
    # read from the variables themselves: the pieces on each device add up to its report
    held: dict[tuple, int] = {}
    for param in tfdist.zero.engine_of(sharded).params:
        for c in param.components:
            held[_key(c.device)] = held.get(_key(c.device), 0) + int(np.prod(c.shape)) * 4
    assert {_key(r.device): r.params for r in after.rows} == held


# --- checkpoints hold the logical model and optimizer -------------------------------------------------------------
def test_keras_file_and_tf_checkpoint_hold_the_logical_model_and_optimizer(tmp_path):
    _, zero = trained("mlp", (2, 2), 0)
    _, sharded = trained("mlp", (2, 2), 3)
    # .keras: loads in plain Keras, with Adam's state exactly as stage 0 saves it
    reference = logical_optimizer_state(zero, tmp_path, "zero")
    for ref, got in zip(reference, logical_optimizer_state(sharded, tmp_path, "sharded"), strict=True):
        assert ref.shape == got.shape and np.abs(ref - got).max() <= 1e-4 * max(np.abs(ref).max(), 1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain = keras.saving.load_model(str(tmp_path / "sharded.keras"))
    assert_close(logical_weights(sharded), logical_weights(plain), 0)
    # tf.train.Checkpoint: logical shapes, restored into plain Keras, stage 0 and stage 3, then trained alike
    path = tf.train.Checkpoint(model=sharded, optimizer=sharded.optimizer).save(str(tmp_path / "ckpt"))
    shapes = [shape for name, shape in tf.train.list_variables(path) if name.startswith("optimizer/_variables/")]
    assert shapes.count([12, 32]) == 2 and shapes.count([32, 16]) == 4

    def restored(stage):
        strategy = None if stage is None else strategy_for(zero_stage=stage)
        with strategy.scope() if strategy is not None else tf.distribute.get_strategy().scope():
            other = mlp()
            other.compile(optimizer=ADAM(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            other.optimizer.build(other.trainable_variables)
        tf.train.Checkpoint(model=other, optimizer=other.optimizer).restore(path).assert_existing_objects_matched()
        assert_close(logical_weights(sharded), logical_weights(other), 0)
        return other

    others = [restored(None), restored(0), restored(3)]
    x, y = data()
    for m in (*others, sharded):  # the shared model trains last: the other tests have read it already
        m.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    for other in others:
        assert_close(logical_weights(sharded), logical_weights(other), 1e-4)


def _key(device: str) -> tuple:
    """"/cpu:1" and "/job:localhost/replica:0/task:0/device:CPU:1" name one local device."""
    spec = tf.DeviceSpec.from_string(device)
    return spec.device_type.upper(), spec.device_index


# --- the FSDP options (tfdist.MirroredStrategy's names), per device group ------------------------------------------
def _zero3_strategy(**options) -> tfdist.ModelParallelStrategy:
    mesh = tfdist.DeviceMesh((2, 2), ("batch", "model"), [f"/cpu:{i}" for i in range(4)])
    return tfdist.ModelParallelStrategy(mlp_layout(mesh), batch_dim_name="batch", zero_stage=3, **options)


@pytest.mark.parametrize("options, units, gathers, prefetched", [
    ({}, ["up1", "down1", "up2", "down2", "head"], 10, 0),
    ({"fsdp_unit_bytes": 2**20}, None, 2, 0),         # None: the whole model (8.4 kB) is one unit
    ({"reshard_after_forward": False}, ["up1", "down1", "up2", "down2", "head"], 5, 0),   # no backward gathers
    # per row, every unit's gather but the first of the forward and of the backward: 2 x (10 - 2)
    ({"fsdp_prefetch": True}, ["up1", "down1", "up2", "down2", "head"], 10, 16)],
    ids=["default", "unit_bytes", "keep_gathered", "prefetch"])
def test_fsdp_options_equal_one_device_and_take_effect(monkeypatch, options, units, gathers, prefetched):
    """Each option trains as one device (Adam, 20 steps), and does what it says in the traced step: the units (one
    merged unit), the all-gather merge_calls of every unit (forward + backward, or forward only when the gathered
    weights are kept), and how many gathers wait for the previous unit's inputs instead of their own (prefetch)."""
    from tfdist.zero.fsdp.unit import FsdpUnit

    gathered, waits = [], []
    merge_gather, issue_after = FsdpUnit._merge_gather, FsdpUnit._issue_after

    def counted_gather(self, strategy, *local):  # the real all-gather, counted
        gathered.append(self.name)
        return merge_gather(self, strategy, *local)

    def recorded_issue_after(self, phase, mine):
        after = issue_after(self, phase, mine)
        waits.append(len(after) != len(mine) or any(a is not b for a, b in zip(after, mine)))
        return after

    monkeypatch.setattr(FsdpUnit, "_merge_gather", counted_gather)
    monkeypatch.setattr(FsdpUnit, "_issue_after", recorded_issue_after)
    model = fit(_zero3_strategy(**options), ADAM)
    assert_close(weights("mlp", None), logical_weights(model), 1e-4)
    assert [u.name for u in tfdist.zero.engine_of(model).units] == (units or [model.name])
    assert len(gathered) == gathers, gathered  # fit traces its step once (64 samples, batch 16)
    assert sum(waits) == prefetched, waits


@pytest.mark.parametrize("options, message", [
    ({"zero_stage": 2, "fsdp_unit_bytes": 1024}, r"fsdp_unit_bytes=1024 .* needs zero_stage=3"),
    ({"zero_stage": 3, "fsdp_unit_bytes": 0}, r"fsdp_unit_bytes must be a positive number of bytes"),
    ({"zero_stage": 3, "reshard_after_forward": "no"}, r"reshard_after_forward must be True or False, got 'no'"),
    ({"zero_stage": 3, "fsdp_prefetch": 1}, r"fsdp_prefetch must be True or False, got 1"),
    ({"zero_stage": 1, "reshard_after_forward": False}, r"reshard_after_forward=False is a ZeRO stage 3 option"),
    ({"zero_stage": 0, "fsdp_prefetch": True}, r"fsdp_prefetch=True is a ZeRO stage 3 option")])
def test_fsdp_options_are_validated_naming_the_parameter(options, message):
    mesh = tfdist.DeviceMesh((2, 2), ("batch", "model"), [f"/cpu:{i}" for i in range(4)])
    with pytest.raises(ConfigError, match=message):
        tfdist.ModelParallelStrategy(mlp_layout(mesh), batch_dim_name="batch", **options)


def test_one_unit_over_column_row_pairs_keeps_the_megatron_pairing():
    """Per layer, a unit boundary sits between a column and a row layer: the activation is gathered and scattered
    again. With `fsdp_unit_bytes` over the whole MLP (one unit), the traced step (both rows) keeps it split: no
    gather, no scatter; the 10 sums are stage 0's 6 plus the backward's recompute of the 4 forward sums."""
    from test_tensor_parallel import traced_step_counts

    counts = {}
    for unit_bytes in (None, 2**20):
        strategy = _zero3_strategy(fsdp_unit_bytes=unit_bytes)
        with strategy.scope():
            model = mlp()
        counts[unit_bytes] = traced_step_counts(strategy, model)
    assert counts[None] == {"tp_all_reduce": 10, "tp_all_gather": 4, "tp_scatter": 8}
    assert counts[2**20] == {"tp_all_reduce": 10, "tp_all_gather": 0, "tp_scatter": 0}


def test_l1_l2_and_l1l2_regularizers_on_split_weights_equal_one_device():
    """A column-split and a row-split Dense with L2, L1 and L1L2 penalties on a 2 x 2 mesh at zero_stage=3: each row
    adds the penalty of the pieces it holds of every shard, so the weights and the reported loss equal one device's
    (the penalties matter: without them the weights differ). Other regularizers stay refused."""
    rng = np.random.RandomState(0)
    x, y = rng.rand(16, 8).astype("float32"), rng.rand(16, 4).astype("float32")

    def run(strategy, regularized=True):
        penalty = (lambda r: r) if regularized else (lambda r: None)
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = keras.Sequential([
                keras.Input((8,)),
                keras.layers.Dense(16, activation="relu", kernel_regularizer=penalty(keras.regularizers.L2(0.01)),
                                   name="d1"),
                keras.layers.Dense(4, kernel_regularizer=penalty(keras.regularizers.L1(0.01)),
                                   bias_regularizer=penalty(keras.regularizers.L1L2(0.01, 0.02)), name="d2")])
            model.compile(keras.optimizers.Adam(0.01), "mse")
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return model.get_weights(), history.history["loss"]

    def mesh_strategy(**kwargs):
        mesh = tfdist.DeviceMesh((2, 2), ("batch", "model"), [f"/cpu:{i}" for i in range(4)])
        layout = tfdist.LayoutMap(mesh)
        layout["d1/kernel"], layout["d2/kernel"] = (None, "model"), ("model", None)
        return tfdist.ModelParallelStrategy(layout, batch_dim_name="batch", **kwargs)

    one = tf.distribute.OneDeviceStrategy("/cpu:0")
    (expected, expected_loss), (plain, _) = run(one), run(one, regularized=False)
    assert max(float(np.abs(a - b).max()) for a, b in zip(expected, plain)) > 1e-3
    got, loss = run(mesh_strategy(zero_stage=3))
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    with pytest.raises(ConfigError, match="only L1 or L2 or L1L2"):
        with mesh_strategy(zero_stage=3).scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(
                16, kernel_regularizer=keras.regularizers.OrthogonalRegularizer(0.01), name="d1")])
            model.compile("sgd", "mse")
        model.fit(x, y[:, :1].repeat(16, axis=1), batch_size=8, verbose=0)
