"""ZeRO stage 3 (fully sharded parameters) on MirroredStrategy: equal to stage 0, 1/N storage, full checkpoints."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.errors import ConfigError
from tfdist.zero.fsdp.param import FsdpParam

RNG = np.random.default_rng(3)
X = RNG.normal(size=(256, 8)).astype("float32")
Y = RNG.integers(0, 10, 256)
XI = RNG.normal(size=(256, 8, 8, 1)).astype("float32")


def mlp_with_state(dropout: float = 0.25):
    """BatchNorm (moving statistics), a frozen layer and Dropout: non-trainable variables of every kind."""
    keras.utils.set_random_seed(0)
    frozen = keras.layers.Dense(16, activation="relu", name="frozen")
    frozen.trainable = False
    return keras.Sequential([keras.Input((8,)), frozen, keras.layers.Dense(32, activation="relu"),
                             keras.layers.BatchNormalization(), keras.layers.Dropout(dropout),
                             keras.layers.Dense(10, activation="softmax")])


def tied():
    """One layer called twice (its weights shared by two places of the graph)."""
    keras.utils.set_random_seed(0)
    x = keras.Input((8,))
    shared = keras.layers.Dense(12, activation="tanh", name="shared")
    h = shared(keras.layers.Dense(12, name="inp")(x))
    h = shared(h)
    return keras.Model(x, keras.layers.Dense(10, activation="softmax")(h))


class TiedOutput(keras.layers.Layer):
    """Output projection tied to an input layer's kernel (tracked as a sublayer: its unit gathers it)."""

    def __init__(self, source, **kw):
        super().__init__(**kw)
        self.source = source
        self.bias = self.add_weight(shape=(8,), initializer="zeros", name="bias")

    def call(self, x):
        return keras.ops.matmul(x, keras.ops.transpose(self.source.kernel)) + self.bias


def tied_weights():
    keras.utils.set_random_seed(0)
    x = keras.Input((8,))
    embed = keras.layers.Dense(12, activation="tanh", name="embed")
    h = TiedOutput(embed, name="tied_out")(embed(x))
    return keras.Model(x, keras.layers.Dense(10, activation="softmax")(h))


def cnn():
    return tfdist.models.cnn((8, 8, 1), 10, filters=(4, 8), dense_units=16, seed=0)


MODELS = {"state": (mlp_with_state, X), "tied": (tied, X), "tied_weights": (tied_weights, X), "cnn": (cnn, XI)}


def make(stage: int, model_fn=mlp_with_state, replicas: int = 4, optimizer=lambda: keras.optimizers.Adam(1e-2),
         **options):
    strategy = tfdist.MirroredStrategy(tfdist.devices.virtual_cpus(4)[:replicas], zero_stage=stage, **options)
    with strategy.scope():
        model = model_fn()
        model.compile(optimizer=optimizer(), loss="sparse_categorical_crossentropy")
    return strategy, model


def fit(model, x=X, epochs: int = 5, **kw):
    return model.fit(x, Y, batch_size=64, epochs=epochs, shuffle=False, verbose=0, **kw).history["loss"]


def state(model) -> list[np.ndarray]:
    return [np.asarray(v.numpy()) for v in model.optimizer.variables]


def max_rel(a: list, b: list) -> float:
    assert len(a) == len(b)
    out = 0.0
    for x, y in zip(a, b):
        assert np.shape(x) == np.shape(y)
        out = max(out, float(np.max(np.abs(np.asarray(x) - np.asarray(y)), initial=0.0))
                  / max(float(np.max(np.abs(x), initial=0.0)), 1e-12))
    return out


@pytest.fixture(scope="module")
def runs():
    """Stage 0 and stage 3, each model, Adam, 20 steps on 4 replicas."""
    out = {}
    for name, (model_fn, x) in MODELS.items():
        for stage in (0, 3):
            strategy, model = make(stage, model_fn)
            out[name, stage] = (strategy, model, fit(model, x))
    return out


# --- equivalence ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(MODELS))
def test_stage3_equals_stage0_after_20_adam_steps(runs, name):
    _, ref, ref_loss = runs[name, 0]
    _, model, loss = runs[name, 3]
    assert model.optimizer.iterations.numpy() == ref.optimizer.iterations.numpy() == 20
    assert max_rel([np.array(ref_loss)], [np.array(loss)]) < 1e-4
    assert max_rel(ref.get_weights(), model.get_weights()) < 1e-4  # trainable and non-trainable
    assert max_rel(state(ref), state(model)) < 1e-4  # the full logical Adam state


@pytest.mark.parametrize("name", ["state", "cnn"])
def test_evaluate_and_predict_equal_stage0(runs, name):
    x = MODELS[name][1]
    _, ref, _ = runs[name, 0]
    _, model, _ = runs[name, 3]
    assert max_rel([ref.predict(x, batch_size=64, verbose=0)], [model.predict(x, batch_size=64, verbose=0)]) < 1e-4
    a, b = ref.evaluate(x, Y, batch_size=64, verbose=0), model.evaluate(x, Y, batch_size=64, verbose=0)
    assert abs(a - b) / abs(a) < 1e-4


# --- sharded storage, read from the variables ---------------------------------------------------------
@pytest.mark.parametrize("name", list(MODELS))
def test_each_replica_stores_a_quarter_of_the_parameters(runs, name):
    strategy, model, _ = runs[name, 3]
    devices = [tf.DeviceSpec.from_string(d).to_string() for d in strategy.extended.worker_devices]
    per_device = dict.fromkeys(devices, 0)
    total = 0
    for v in model.trainable_variables:
        param = v.value
        assert isinstance(param, FsdpParam)  # no replicated tf.Variable behind a trainable weight
        size = math.prod(v.shape)
        total += size
        assert [tf.DeviceSpec.from_string(c.device).to_string() for c in param.components] == devices
        for c in param.components:
            assert isinstance(c, tf.Variable) and tuple(c.shape) == (math.ceil(size / 4),)
            per_device[tf.DeviceSpec.from_string(c.device).to_string()] += int(c.shape[0])
    n_vars = len(model.trainable_variables)
    for elements in per_device.values():
        assert total / 4 <= elements < total / 4 + n_vars  # 1/N, plus < 1 padding element per variable
    report = strategy.memory_report(model)
    assert report.stage == 3 and report.num_params == total
    for row in report.rows:
        assert row.params == per_device[row.device] * 4
        assert row.optimizer_state >= 2 * row.params  # Adam's two slots of its own piece (+ scalars)
        assert row.optimizer_state <= 2 * row.params + 64
        assert row.gradients == row.params  # the reduce-scattered gradient piece
        assert row.shard_buffer == 0  # emptied after the step
    assert report.formula["params"] == pytest.approx(4 * total / 4)
    assert 0 < report.gathered_units <= 2 * max(4 * 4 * math.ceil(math.prod(v.shape) / 4)
                                                for v in model.trainable_variables) * 2


@pytest.mark.parametrize("name", ["state", "cnn"])
def test_offload_keeps_the_optimizer_shards_and_update_on_the_host_and_equals_stage0(runs, name):
    _, ref, ref_loss = runs[name, 0]
    model_fn, x = MODELS[name]
    strategy, model = make(3, model_fn, offload=True)
    loss = fit(model, x)
    assert max_rel([np.array(ref_loss)], [np.array(loss)]) < 1e-4
    assert max_rel(ref.get_weights(), model.get_weights()) < 1e-4
    assert max_rel(state(ref), state(model)) < 1e-4
    canon = lambda d: tf.DeviceSpec.from_string(d).to_string()  # noqa: E731
    engine = tfdist.zero.engine_of(model)
    host, devices = canon(engine.config.host_device), [canon(d) for d in strategy.extended.worker_devices]
    assert all(canon(v.value.device) == host for name in engine.state.names for v in engine.state.slots[name])
    assert all(canon(s.value.device) == host for s in engine.shard_params)  # where the update reads and writes
    for v in model.trainable_variables:  # the parameters stay cut across the replicas' devices
        assert [canon(c.device) for c in v.value.components] == devices
    # On this CPU-only machine the host is CPU:0, replica 0's device too: its row holds every replica's Adam shards.
    rows = {row.device: row for row in strategy.memory_report(model).rows}
    params = sum(row.params for row in rows.values())
    assert rows[host].optimizer_state >= 2 * params
    assert all(row.optimizer_state <= 64 for d, row in rows.items() if d != host)  # mirrored scalars only


def test_non_trainable_variables_stay_replicated(runs):
    _, model, _ = runs["state", 3]
    for v in model.non_trainable_variables:
        assert not isinstance(v.value, FsdpParam)


# --- checkpoints ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(runs, tmp_path_factory):
    d = tmp_path_factory.mktemp("zero3_ckpt")
    _, model, _ = runs["cnn", 3]
    model.save(d / "model.keras")
    return {"dir": d, "keras": str(d / "model.keras"), "state": state(model), "weights": model.get_weights()}


@pytest.mark.parametrize("replicas, stage", [(2, 3), (4, 3), (4, 0), (2, 2), (1, 1)])
def test_keras_file_of_stage3_loads_at_any_stage_and_world_size(saved, replicas, stage):
    strategy = tfdist.MirroredStrategy(tfdist.devices.virtual_cpus(4)[:replicas], zero_stage=stage)
    with strategy.scope():
        model = keras.models.load_model(saved["keras"])
    assert max_rel(saved["state"], state(model)) == 0.0
    assert max_rel(saved["weights"], model.get_weights()) == 0.0
    if stage == 3:
        assert all(isinstance(v.value, FsdpParam) for v in model.trainable_variables)
        assert len(model.trainable_variables[0].value.components) == replicas


def test_continued_training_after_load_at_2_replicas_matches(saved):
    ref_strategy = tfdist.MirroredStrategy(tfdist.devices.virtual_cpus(4), zero_stage=0)
    with ref_strategy.scope():
        ref = keras.models.load_model(saved["keras"])
    fit(ref, XI, epochs=1)
    strategy = tfdist.MirroredStrategy(tfdist.devices.virtual_cpus(4)[:2], zero_stage=3)
    with strategy.scope():
        model = keras.models.load_model(saved["keras"])
    fit(model, XI, epochs=1)
    assert max_rel(ref.get_weights(), model.get_weights()) < 1e-4
    assert max_rel(state(ref), state(model)) < 1e-4


def test_plain_keras_loads_the_stage3_file_without_tfdist(saved, python):
    np.savez(saved["dir"] / "state.npz", *saved["state"])
    np.savez(saved["dir"] / "weights.npz", *saved["weights"])
    out = python(f"""
        import sys, numpy as np, keras
        model = keras.models.load_model({saved['keras']!r})
        for name, got in (("state", [np.asarray(v.numpy()) for v in model.optimizer.variables]),
                          ("weights", model.get_weights())):
            ref = np.load({str(saved['dir'])!r} + f"/{{name}}.npz")
            assert len(got) == len(ref.files), (name, len(got), len(ref.files))
            for i, g in enumerate(got):
                np.testing.assert_array_equal(g, ref[f"arr_{{i}}"])
        assert not any(m.startswith("tfdist") for m in sys.modules)
        print("plain-keras-ok", type(model.optimizer).__name__)
    """)
    assert "plain-keras-ok Adam" in out.stdout


def test_save_model_model_checkpoint_and_backup_and_restore(tmp_path):
    _, model = make(3, cnn)
    callbacks = [keras.callbacks.ModelCheckpoint(str(tmp_path / "ep{epoch}.keras")),
                 keras.callbacks.BackupAndRestore(str(tmp_path / "backup"), delete_checkpoint=False)]
    fit(model, XI, epochs=2, callbacks=callbacks)
    expected_state, expected_weights = state(model), model.get_weights()
    assert tfdist.training.save_model(model, tmp_path / "final.keras")
    plain = keras.models.load_model(tmp_path / "final.keras")
    assert max_rel(expected_weights, plain.get_weights()) == 0.0
    checkpointed = keras.models.load_model(tmp_path / "ep2.keras")
    assert max_rel(expected_state, state(checkpointed)) == 0.0

    _, resumed = make(3, cnn, replicas=2)  # resumes from the backup: the 2 epochs done are skipped
    resumed.fit(XI, Y, batch_size=64, epochs=2, shuffle=False, verbose=0,
                callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))])
    assert max_rel(expected_state, state(resumed)) == 0.0
    assert max_rel(expected_weights, resumed.get_weights()) == 0.0


def _custom_loop(stage: int, steps: int, ckpt_dir, restore: str | None = None, build_first: bool = True):
    """TF's custom-training-loop tutorial pattern: strategy.run of a tape step, tf.train.Checkpoint."""
    strategy = tfdist.MirroredStrategy(tfdist.devices.virtual_cpus(4), zero_stage=stage)
    with strategy.scope():
        model = mlp_with_state(dropout=0.0)  # Keras checkpoints do not hold the dropout seed's state
        optimizer = keras.optimizers.Adam(1e-2)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(reduction="none")
        checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    if build_first:  # stage 3 shards the parameters when the optimizer is built: before the first step
        with strategy.scope():
            optimizer.build(model.trainable_variables)
    if restore:
        checkpoint.read(restore).assert_consumed()
    data = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((X, Y)).batch(64))

    @tf.function
    def step(x, y):
        def replica(x, y):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_fn(y, model(x, training=True)), global_batch_size=64)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.reduce("SUM", strategy.run(replica, args=(x, y)), axis=None)

    for _ in range(steps // 4):
        for x, y in data:
            step(x, y)
    return model, optimizer, checkpoint.write(str(ckpt_dir / f"s{stage}"))


def test_tf_train_checkpoint_in_a_custom_training_loop(tmp_path):
    ref4, _, _ = _custom_loop(0, 4, tmp_path / "a")
    ref, ref_opt, _ = _custom_loop(0, 8, tmp_path)
    model, optimizer, prefix = _custom_loop(3, 4, tmp_path)
    assert all(isinstance(v.value, FsdpParam) for v in model.trainable_variables)
    assert max_rel(ref4.get_weights(), model.get_weights()) < 1e-4
    resumed, resumed_opt, _ = _custom_loop(3, 4, tmp_path / "b", restore=prefix)  # 4 + 4 steps
    assert int(resumed_opt.iterations.numpy()) == int(ref_opt.iterations.numpy()) == 8
    assert max_rel(ref.get_weights(), resumed.get_weights()) < 1e-4
    assert max_rel([np.asarray(v.numpy()) for v in ref_opt.variables],
                   [np.asarray(v.numpy()) for v in resumed_opt.variables]) < 1e-4


def test_custom_loop_without_building_the_optimizer_first_trains_alike(tmp_path):
    # The strategy builds an optimizer still unbuilt at the first strategy.run before the step's forward,
    # so the parameters are cut before the model reads them (tests/test_custom_loop.py has the stock side).
    built, built_opt, _ = _custom_loop(3, 4, tmp_path / "a")
    lazy, lazy_opt, _ = _custom_loop(3, 4, tmp_path / "b", build_first=False)
    assert all(isinstance(v.value, FsdpParam) for v in lazy.trainable_variables)
    assert int(lazy_opt.iterations.numpy()) == int(built_opt.iterations.numpy()) == 4
    assert max_rel(built.get_weights(), lazy.get_weights()) < 1e-6


def test_checkpoint_of_another_shape_is_refused(tmp_path):
    _, small = make(3, lambda: keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(10)]))
    fit(small, epochs=1)
    prefix = tf.train.Checkpoint(model=small).write(str(tmp_path / "small"))
    _, other = make(3, lambda: keras.Sequential([keras.Input((8,)), keras.layers.Dense(6), keras.layers.Dense(10)]))
    other.optimizer.build(other.trainable_variables)
    with pytest.raises(ConfigError, match=r"shape \(8, 4\).*shape \(8, 6\).*different model"):
        tf.train.Checkpoint(model=other).read(prefix)
    with pytest.raises(ConfigError, match="different model"):
        other.trainable_variables[0].value.assign(np.zeros((8, 4), "float32"))


# --- bad input --------------------------------------------------------------------------------------------
def test_refuses_an_optimizer_that_is_not_elementwise():
    _, model = make(3, optimizer=lambda: keras.optimizers.Lamb())
    with pytest.raises(ConfigError, match="ZeRO stage 3 cannot shard optimizer Lamb.*trust ratio"):
        fit(model, epochs=1)


def test_a_weight_read_outside_its_layers_call_is_named():
    def model_fn():
        x = keras.Input((8,))
        dense = keras.layers.Dense(8, name="dense_owner")
        # A Lambda does not track the layer whose weight it reads: nothing gathers that weight for it.
        h = keras.layers.Lambda(lambda t: keras.ops.matmul(t, dense.kernel), name="reader")(dense(x))
        return keras.Model(x, keras.layers.Dense(10, activation="softmax")(h))

    _, model = make(3, model_fn)
    with pytest.raises(ConfigError, match=r"weight '[^']*dense_owner/kernel' of layer 'dense_owner' was read outside "
                                          r"its layer's call"):
        fit(model, epochs=1)


def regularized():
    init = keras.initializers.GlorotUniform
    return keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16, activation="tanh", kernel_initializer=init(1),
                           kernel_regularizer=keras.regularizers.L2(0.01),
                           bias_regularizer=keras.regularizers.L1(0.01), name="l2_l1"),
        keras.layers.Dense(10, activation="softmax", kernel_initializer=init(2),
                           kernel_regularizer=keras.regularizers.L1L2(l1=0.005, l2=0.02), name="l1l2"),
    ])


class Spread(keras.regularizers.Regularizer):
    """A user's own regularizer that reads the whole weight (its columns' variance), not a sum over elements."""

    def __call__(self, x):
        return 0.1 * keras.ops.var(keras.ops.sum(x, axis=0))

    def get_config(self):
        return {}


def whole_weight_regularized():
    init = keras.initializers.GlorotUniform
    return keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16, activation="tanh", kernel_initializer=init(1),
                           kernel_regularizer=keras.regularizers.OrthogonalRegularizer(0.05), name="orthogonal"),
        keras.layers.Dense(10, activation="softmax", kernel_initializer=init(2), kernel_regularizer=Spread(),
                           bias_regularizer=keras.regularizers.L2(0.01), name="spread"),
    ])


@pytest.mark.parametrize("model_fn", [regularized, whole_weight_regularized], ids=["per-piece", "whole-weight"])
def test_weight_regularizers_train_at_stage3_as_at_stage0(model_fn):
    """L1, L2 and L1L2: each replica adds the penalty of its own piece. OrthogonalRegularizer and a user's own read
    the whole weight: each replica takes them on the weight its unit gathers, and the gradient of its own piece
    only. Either way the loss Keras reports, the weights and the Adam state equal stage 0's (which reads whole
    weights), and model.losses outside a step is the whole weights' penalty."""
    (_, ref), (_, model) = make(0, model_fn), make(3, model_fn)
    ref_loss, loss = fit(ref), fit(model)
    assert max_rel([np.array(ref_loss)], [np.array(loss)]) < 1e-5
    assert max_rel(ref.get_weights(), model.get_weights()) < 1e-5
    assert max_rel(state(ref), state(model)) < 1e-5
    assert max_rel([np.array([float(t) for t in ref.losses])], [np.array([float(t) for t in model.losses])]) < 1e-5
    assert [layer.get_config() for layer in model.layers] == [layer.get_config() for layer in ref.layers]


def test_constraints_are_refused():
    _, model = make(3, lambda: keras.Sequential([keras.Input((8,)), keras.layers.Dense(10, name="d",
                                                                                         kernel_constraint="non_neg")]))
    with pytest.raises(ConfigError, match="constraint"):
        fit(model, epochs=1)


@pytest.mark.parametrize("kwargs, words", [({"zero_stage": 0, "offload": True}, "zero_stage=1, 2 or 3"),
                                           ({"zero_stage": 4}, r"\{0, 1, 2\}.*and 3")])
def test_bad_stage3_arguments(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        tfdist.MirroredStrategy(**kwargs)


def test_model_created_outside_the_scope_is_refused():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(10)])
    strategy = tfdist.MirroredStrategy(zero_stage=3)
    with strategy.scope():
        optimizer = keras.optimizers.Adam()
        with pytest.raises(ConfigError, match="created inside the strategy's scope"):
            optimizer.build(model.trainable_variables)


# --- the wrap policy ------------------------------------------------------------------------------------
def blocks():
    """Two residual-free blocks (nested models) of two Dense layers each, then a head."""
    keras.utils.set_random_seed(0)

    def block(name):
        return keras.Sequential([keras.Input((16,)), keras.layers.Dense(16, activation="relu", name=f"{name}_a"),
                                 keras.layers.Dense(16, activation="relu", name=f"{name}_b")], name=name)

    x = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu", name="stem")(x)
    h = block("block2")(block("block1")(h))
    return keras.Model(x, keras.layers.Dense(10, activation="softmax", name="head")(h), name="blocks")


@pytest.mark.parametrize("unit_bytes, units", [(None, ["stem", "block1_a", "block1_b", "block2_a", "block2_b", "head"]),
                                               (4 * 2 * (16 * 16 + 16), ["stem", "block1", "block2", "head"]),
                                               (2**20, ["blocks"])])
def test_fsdp_unit_bytes_groups_layers_into_units_and_still_equals_stage0(unit_bytes, units):
    _, ref = make(0, blocks)
    ref_loss = fit(ref)
    strategy, model = make(3, blocks)
    tfdist.zero.configure_stage3(strategy, unit_bytes=unit_bytes)
    loss = fit(model)
    assert [u.layer.name for u in tfdist.zero.engine_of(model).units] == units
    assert max_rel([np.array(ref_loss)], [np.array(loss)]) < 1e-4
    assert max_rel(ref.get_weights(), model.get_weights()) < 1e-4


@pytest.mark.parametrize("options", [{"prefetch": True}, {"reshard_after_forward": False}])
def test_prefetch_and_keeping_gathered_weights_give_the_same_numbers(options):
    _, ref = make(3, blocks)
    ref_loss = fit(ref, epochs=2)
    strategy, model = make(3, blocks)
    tfdist.zero.configure_stage3(strategy, **options)
    assert max_rel([np.array(ref_loss)], [np.array(fit(model, epochs=2))]) < 1e-6
    assert max_rel(ref.get_weights(), model.get_weights()) < 1e-6


@pytest.mark.parametrize("bad", [0, -4096, 1.5, "1MB", True])
def test_fsdp_unit_bytes_must_be_a_positive_int(bad):
    strategy = tfdist.MirroredStrategy(zero_stage=3)
    with pytest.raises(ConfigError, match="fsdp_unit_bytes must be a positive number of bytes"):
        tfdist.zero.configure_stage3(strategy, unit_bytes=bad)


def test_fsdp_unit_bytes_needs_stage3():
    with pytest.raises(ConfigError, match="needs zero_stage=3"):
        tfdist.zero.configure_stage3(tfdist.MirroredStrategy(zero_stage=2), unit_bytes=4096)


# --- memory during a step, from TF's allocator --------------------------------------------------------------
@pytest.mark.slow
def test_step_peak_stays_within_formula_plus_units_and_far_below_stage0(python):
    import json
    import pathlib

    job = pathlib.Path(__file__).with_name("zero3_peak_job.py")
    runs = {}
    for key, args in ((0, "'0'"), (3, "'3'"), ("keep", "'3', 'keep'")):
        out = python(f"import runpy, sys; sys.argv = ['job', {args}]; runpy.run_path({str(job)!r}, "
                     "run_name='__main__')")
        runs[key] = json.loads(out.stdout.strip().splitlines()[-1])
    s0, s3, keep = runs[0], runs[3], runs["keep"]
    n, psi = 4, s3["num_params"]
    assert abs(s3["loss"] - s0["loss"]) / abs(s0["loss"]) < 1e-4
    # Between steps the process holds 4 replicas x (4 + 8) Psi / N: parameters and Adam state pieces (and
    # whatever else TF keeps in blocks >= 256 KiB: 2 MiB of slack); stage 0 holds 4 x 12 Psi.
    assert s3["held"] <= n * 12 * psi / n * 1.05 + 2 * 2**20
    assert s3["held"] < s0["held"] / 3.5, (s3, s0)
    # During a step, per replica: the formula (16 Psi / N), the two largest units' gathered parameters,
    # and the update's two flat buffers (gradient shard and the parameter shard update_step writes,
    # 4 Psi / N each, as at stages 1/2); activations are below the allocator's 256 KiB counting size.
    bound = n * (s3["formula"] + sum(s3["largest_units"]) + 2 * 4 * psi / n)
    assert s3["peak"] <= bound, (s3, bound)
    assert s3["peak"] < 0.35 * s0["peak"], (s3, s0)
    # reshard_after_forward=False: same numbers, the gathered parameters of every unit held from the
    # forward to the backward: a higher peak (at most all units gathered, i.e. 4 Psi per replica more).
    assert abs(keep["loss"] - s3["loss"]) / abs(s3["loss"]) < 1e-6 and keep["held"] <= s3["held"] * 1.05
    assert s3["peak"] < keep["peak"] <= s3["peak"] + n * 4 * psi * 1.05, (s3, keep)


# --- more layer kinds and modes ---------------------------------------------------------------------------
def embedding():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6,), dtype="int32"), keras.layers.Embedding(50, 8),
                             keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(10, activation="softmax")])


def test_embedding_sparse_gradients_equal_stage0():
    # Keras applies Adam to IndexedSlices (one slice per lookup) differently from their dense sum; every stage hands
    # its update the slices of its shard or piece, so stock Keras at stage 0 is the reference (tokens repeat).
    ids = RNG.integers(0, 50, (256, 6)).astype("int32")
    _, ref = make(0, embedding)
    losses = fit(ref, ids)
    for stage in (1, 2, 3):
        _, model = make(stage, embedding)
        assert max_rel([np.array(losses)], [np.array(fit(model, ids))]) < 1e-6, stage
        assert max_rel(ref.get_weights(), model.get_weights()) < 1e-6, stage


def test_run_eagerly_equals_stage0():
    _, ref = make(0, lambda: mlp_with_state(dropout=0.0))
    strategy, model = make(3, lambda: mlp_with_state(dropout=0.0))
    with strategy.scope():
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy",
                      run_eagerly=True)
    fit(ref, epochs=1)
    fit(model, epochs=1)
    assert max_rel(ref.get_weights(), model.get_weights()) < 1e-4


def test_stage3_formula_and_report_text(runs):
    psi, n = 1_000_000, 4
    f = tfdist.zero.zero_formula(psi, n, 3)
    assert f["params"] == 4 * psi / n and f["gradients"] == 4 * psi / n and f["total"] == 16 * psi / n
    strategy, model, _ = runs["cnn", 3]
    text = str(strategy.memory_report(model))
    assert text.startswith("ZeRO stage 3, 4 replicas") and "gathered parameters (the two largest units)" in text


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_trains_at_stage3_as_at_stage0(policy):
    """Keras casts a layer's float32 weights to the compute dtype inside its call; stage 3 gathers them for the
    forward and again for the backward's recompute, which runs outside the call and must cast them alike. Under
    mixed_float16 Keras' compile adds its LossScaleOptimizer."""
    keras.mixed_precision.set_global_policy(policy)
    try:
        (_, ref), (_, model) = make(0, lambda: mlp_with_state(0.0)), make(3, lambda: mlp_with_state(0.0))
        ref_loss, loss = fit(ref, epochs=3), fit(model, epochs=3)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert {w.dtype for w in model.weights} == {"float32"}  # variables stay float32; only the compute is 16-bit
    assert type(model.optimizer).__name__ == type(ref.optimizer).__name__
    assert np.all(np.isfinite(loss)) and loss[-1] < loss[0]
    assert max_rel(ref.get_weights(), model.get_weights()) < 1e-5  # as in float32: same casts, same sums
    assert max_rel([np.array(ref_loss)], [np.array(loss)]) < 1e-5
