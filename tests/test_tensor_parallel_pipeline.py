"""Data x tensor x pipeline (issue 14): a rank-3 mesh (batch, stage, model) whose stages are tensor-parallel groups.

In process (4 logical CPUs): the mesh's groups, bad input, and a 1x2x2 MLP against one device. In one subprocess
on 8 logical CPUs at 2x2x2: an MLP (SGD and Adam), a Transformer block (Adam) and the example CNN against one
device, every variable's and slot's devices read from the variables, evaluate/predict, a `.keras` file loaded in
plain Keras and a tf.train.Checkpoint restored there.
"""

from __future__ import annotations

import json
import os
import re
import tempfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist._compat import keras_model
from tfdist.errors import ConfigError
from tfdist.tensor_parallel import collective_counts
from test_tensor_parallel import cnn_layout, data, mlp, mlp_layout, sgd_step, transformer_block, transformer_layout

HERE = os.path.dirname(os.path.abspath(__file__))
AXES = ("batch", "stage", "model")


def mesh_of(shape, count: int | None = None) -> tfdist.DeviceMesh:
    return tfdist.DeviceMesh(shape, AXES, [f"/cpu:{i}" for i in range(count or int(np.prod(shape)))])


def fit(strategy, build, optimizer, x, y, batch_size=16, loss=None) -> keras.Model:
    with strategy.scope():
        model = build()
        model.compile(optimizer=optimizer(),
                      loss=loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    return model


def max_differences(reference: keras.Model, split: keras.Model) -> dict[str, tuple[float, float]]:
    """Per logical weight path: (max |difference|, max |reference|); split weights read through the layers
    (Keras' own variable objects: the logical views over the shards)."""
    ref = {w.path: w.numpy() for w in reference.weights}
    return {w.path: (float(np.abs(ref[w.path] - w.numpy()).max()), float(np.abs(ref[w.path]).max()))
            for w in _logical_weights(split)}


def _logical_weights(model) -> list:
    out, seen = [], set()
    for layer in keras_model.all_layers(model):
        for name in ("kernel", "bias", "gamma", "beta", "embeddings"):
            w = getattr(layer, name, None)
            if isinstance(w, keras.Variable) and id(w) not in seen:
                seen.add(id(w))
                out.append(w)
    return out


def placements(strategy, model) -> list[tuple[str, list[str], list[str]]]:
    """(variable path, devices its copies live on, the devices they should live on) for every trainable variable
    and every optimizer slot: shard k on group[k] of its layer's stage, replicated variables on group[0]."""
    plan = strategy.placement_plan(model)
    groups = strategy.stage_groups
    shard_of = {id(v): k for split in plan.layers for shards in split.shards.values() for k, v in enumerate(shards)}
    stage_of = {}
    for layer in model.layers:
        for inner in [layer, *keras_model.all_layers(layer)]:
            for v in inner.trainable_variables:
                stage_of.setdefault(id(v), plan.stages.stage_of.get(layer.name))
    out = []
    for v in model.trainable_variables:
        stage, k = stage_of[id(v)], shard_of.get(id(v), 0)
        out.append((v.path, [c.device for c in v.value.values], [row[stage][k] for row in groups]))
    reference = {id(v.value): expected for v, (_, _, expected) in zip(model.trainable_variables, out)}
    for slot in model.optimizer.variables:
        of = strategy.extended.slot_reference(slot.value)
        if of is not None:
            out.append((slot.path, [c.device for c in slot.value.values], reference[id(of)]))
    return out


def _short(device: str) -> str:
    spec = tf.DeviceSpec.from_string(device)
    return f"{spec.device_type}:{spec.device_index}"


# --- in process (4 logical CPUs) -----------------------------------------------------------------------------
def test_rank3_mesh_groups_rows_and_stages():
    mesh = tfdist.DeviceMesh((1, 2, 2), AXES, [f"/cpu:{i}" for i in range(4)])
    assert mesh.stage_groups("batch", "stage") == [[["/device:CPU:0", "/device:CPU:1"],
                                                    ["/device:CPU:2", "/device:CPU:3"]]]
    assert mesh.grid("batch") == [["/device:CPU:0", "/device:CPU:1", "/device:CPU:2", "/device:CPU:3"]]
    # the axes may come in any order: the groups follow the names
    other = tfdist.DeviceMesh((2, 1, 2), ("stage", "batch", "model"), [f"/cpu:{i}" for i in range(4)])
    assert other.stage_groups("batch", "stage") == [[["/device:CPU:0", "/device:CPU:1"],
                                                     ["/device:CPU:2", "/device:CPU:3"]]]
    with pytest.raises(ConfigError, match="rank 4 are not supported"):
        tfdist.DeviceMesh((1, 1, 2, 2), ("a", "b", "c", "d"), [f"/cpu:{i}" for i in range(4)])


def test_bad_stage_configurations_name_the_parameter_and_the_fix():
    mesh = mesh_of((1, 2, 2))
    with pytest.raises(ConfigError, match="stage_dim_name='pipe' is not an axis"):
        tfdist.ModelParallelStrategy(mlp_layout(mesh), stage_dim_name="pipe")
    with pytest.raises(ConfigError, match=r"placement=\['up2'\] / micro_batches=1 need pipeline stages.*no stage axis"):
        tfdist.ModelParallelStrategy(mlp_layout(tfdist.DeviceMesh((1, 2), ("batch", "model"), ["/cpu:0", "/cpu:1"])),
                                     placement=["up2"])
    with pytest.raises(ConfigError, match="micro_batches must be a whole number"):
        tfdist.ModelParallelStrategy(mlp_layout(mesh), micro_batches=0)

    def shard(placement, layout=None, **kwargs):
        layout_map = mlp_layout(mesh)
        for key, value in (layout or {}).items():
            layout_map[key] = value
        strategy = tfdist.ModelParallelStrategy(layout_map, placement=placement, **kwargs)
        with strategy.scope():
            model = mlp()
        return strategy.placement_plan(model)

    # two split points make three stages, the mesh's stage axis has two
    with pytest.raises(ConfigError, match=r"placement lists 2 split layer name\(s\), i.e. 3 stages, but the mesh's "
                                          r"'stage' axis has size 2; give 1 split point"):
        shard(["down1", "up2"])
    # stage assignments that leave a stage of the mesh without layers
    with pytest.raises(ConfigError, match=r"placement=\{0: \['up1'\]\}: stage\(s\) \[1\] have no layers.*'stage' "
                                          r"axis, 2 in all"):
        shard({0: ["up1"]})
    with pytest.raises(ConfigError, match=r"stage 2; stages are 0..1"):
        shard({"up1": 0, "up2": 2})
    with pytest.raises(ConfigError, match="placement names layer 'nope'"):
        shard(["nope"])
    with pytest.raises(ConfigError, match=r"'down1' \(stage 0\) reads the output of 'up1' \(stage 1\)"):
        shard({"up1": 1, "down1": 0})
    with pytest.raises(ConfigError, match=r"over the axis 'stage'.*model axis 'model' only"):
        shard(["up2"], {"head/kernel": ("stage", None)})
    # a batch the replicas x micro-batches do not divide
    strategy = tfdist.ModelParallelStrategy(mlp_layout(mesh), placement=["up2"], micro_batches=3)
    with pytest.raises(ConfigError, match="micro_batches=3 does not divide the batch"):
        strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(np.ones((16, 12))).batch(16))


def test_mlp_on_one_row_of_two_stages_of_two_equals_one_device():
    x, y = data()
    sgd = lambda: keras.optimizers.SGD(0.1)
    reference = fit(tf.distribute.get_strategy(), mlp, sgd, x, y)
    strategy = tfdist.ModelParallelStrategy(mlp_layout(mesh_of((1, 2, 2))), placement=["up2"], micro_batches=2)
    split = fit(strategy, mlp, sgd, x, y)
    for path, (diff, _) in max_differences(reference, split).items():
        assert diff < 1e-5, path
    for path, devices, expected in placements(strategy, split):
        assert [_short(d) for d in devices] == [_short(d) for d in expected], path
    plan = strategy.placement_plan(split)
    assert plan.stages.stage_of == {"up1": 0, "down1": 0, "up2": 1, "down2": 1, "head": 1}
    assert {s.name: s.kind for s in plan.layers} == {"up1": "column", "down1": "row", "up2": "column",
                                                     "down2": "row"}
    np.testing.assert_allclose(split.predict(x, batch_size=16, verbose=0),
                               reference.predict(x, batch_size=16, verbose=0), atol=1e-5)
    # bytes read from the devices the variables live on: each of the 4 devices holds well under half the model
    report = strategy.memory_report(split)
    assert report.mesh_shape == (1, 2, 2) and len(report.rows) == 4
    assert all(0 < row.params for row in report.rows) and report.ratio("params") < 0.35
    assert sum(row.params for row in report.rows) == report.replicated.params


def test_one_stage_or_one_device_per_stage_and_an_uneven_last_batch_equal_one_device():
    x, y = data(58)  # batches of 16, the last of 10: 5 per row, padded to 2 micro-batches of 3

    def fit_dataset(strategy, layout_map=None):
        with strategy.scope():
            model = mlp()
            model.compile(optimizer=keras.optimizers.SGD(0.1),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=2, verbose=0)
        return model

    reference = fit_dataset(tf.distribute.get_strategy())
    for shape, layout, placement in (((2, 1, 2), mlp_layout, "auto"),             # data x tensor, one stage
                                     ((2, 2, 1), tfdist.LayoutMap, ["up2"]),      # data x pipeline, nothing split
                                     ((1, 2, 2), mlp_layout, {0: ["up1"], 1: ["up2"]})):
        strategy = tfdist.ModelParallelStrategy(layout(mesh_of(shape)), placement=placement, micro_batches=2)
        split = fit_dataset(strategy)
        for path, (diff, _) in max_differences(reference, split).items():
            assert diff < 1e-5, (shape, path)


def test_each_layers_forward_and_backward_run_on_its_stage_group_and_pairs_stay_paired():
    strategy = tfdist.ModelParallelStrategy(mlp_layout(mesh_of((1, 2, 2))), placement=["up2"])
    with strategy.scope():
        model = mlp()
    x, y = data(16)
    graph = sgd_step(strategy, model).get_concrete_function(tf.constant(x), tf.constant(y)).graph
    # two column/row pairs, one in each stage: still one all-reduce each (plus the data input's), no gathers
    assert collective_counts(graph) == {"tp_all_reduce": 3, "tp_all_gather": 0, "tp_scatter": 0}
    group = {"up1": {0, 1}, "down1": {0, 1}, "up2": {2, 3}, "down2": {2, 3}, "head": {2, 3}}
    layer_op = re.compile(r"(?:^|/)(up1|down1|up2|down2|head)(?:_\d+)?(?:_backward)?/")  # forward and backward
    placed = {}
    for op in graph.get_operations():
        found = layer_op.search(op.name)
        if found and op.device:  # (variable reads carry no device: they run where their variable lives)
            placed[op.name] = (found.group(1), tf.DeviceSpec.from_string(op.device).device_index)
    assert len(placed) > 50 and {name for name, _ in placed.values()} == set(group)
    assert not {op: where for op, where in placed.items() if where[1] not in group[where[0]]}


def test_functional_ops_between_layers_are_placed_too():
    """`x + y` in a functional model is a Keras Operation (no weights, no variables) in the layer graph; stage
    plans count it with 0 parameters and run it on its stage (LayerPlacementStrategy alike)."""
    def residual():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((12,))
        h = keras.layers.Dense(12, activation="tanh", name="inner")(inputs)
        return keras.Model(inputs, keras.layers.Dense(5, name="head")(inputs + h))

    x, y = data(32)
    sgd = lambda: keras.optimizers.SGD(0.1)
    reference = fit(tf.distribute.get_strategy(), residual, sgd, x, y)
    strategy = tfdist.LayerPlacementStrategy(["/cpu:0", "/cpu:1"], placement=["head"], micro_batches=2)
    split = fit(strategy, residual, sgd, x, y)
    for a, b in zip(reference.weights, split.weights):
        assert np.abs(a.numpy() - b.numpy()).max() < 1e-5, a.path
    plan = strategy.placement_plan(split)
    added = next(info for info in plan.layers if info.name not in ("inner", "head"))
    assert added.params == 0 and plan.stage_of[added.name] == 0


# --- 2 x 2 x 2 on 8 logical CPUs (one subprocess) ------------------------------------------------------------
JOB = """
import json, sys
import tfdist
tfdist.devices.virtual_cpus(8)
sys.path.insert(0, sys.argv[1])
from test_tensor_parallel_pipeline import job
print("RESULT " + json.dumps(job()))
"""


def job() -> dict:
    """The 2x2x2 checks (runs in a process with 8 logical CPUs); returns what the tests assert on."""
    out: dict = {}
    default = tf.distribute.get_strategy()
    mesh = mesh_of((2, 2, 2))
    x, y = data()
    for name, optimizer in (("mlp_sgd", lambda: keras.optimizers.SGD(0.1)),
                            ("mlp_adam", lambda: keras.optimizers.Adam(0.01))):
        reference = fit(default, mlp, optimizer, x, y)
        strategy = tfdist.ModelParallelStrategy(mlp_layout(mesh), placement=["up2"], micro_batches=2)
        split = fit(strategy, mlp, optimizer, x, y)
        out[name] = max_differences(reference, split)
        out[name + "_placement"] = placements(strategy, split)
    # evaluate / predict, and a .keras file loaded in plain Keras (last: the Adam model)
    out["evaluate"] = [reference.evaluate(x, y, batch_size=16, verbose=0),
                       split.evaluate(x, y, batch_size=16, verbose=0)]
    predicted = split.predict(x, batch_size=16, verbose=0)
    out["predict"] = float(np.abs(predicted - reference.predict(x, batch_size=16, verbose=0)).max())
    path = os.path.join(tempfile.mkdtemp(), "model.keras")
    split.save(path)
    loaded = keras.saving.load_model(path)
    out["loaded"] = float(np.abs(loaded.predict(x, batch_size=16, verbose=0) - predicted).max())
    out["loaded_slots"] = float(max(np.abs(a.numpy() - b.numpy()).max() for a, b in
                                    zip(loaded.optimizer.variables[2:], reference.optimizer.variables[2:])))
    # a tf.train.Checkpoint restored into plain Keras (weights and Adam state), then one more epoch on both
    ckpt = tf.train.Checkpoint(model=split, optimizer=split.optimizer).save(os.path.join(tempfile.mkdtemp(), "c"))
    plain = mlp()
    plain.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    plain.optimizer.build(plain.trainable_variables)
    tf.train.Checkpoint(model=plain, optimizer=plain.optimizer).restore(ckpt).assert_existing_objects_matched()
    for model in (split, plain):
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    out["checkpoint"] = max_differences(plain, split)

    rng = np.random.RandomState(2)
    xt, yt = rng.rand(32, 6, 16).astype("float32"), rng.randint(0, 3, size=32)
    adam = lambda: keras.optimizers.Adam(0.01)
    reference = fit(default, transformer_block, adam, xt, yt, batch_size=8)
    strategy = tfdist.ModelParallelStrategy(transformer_layout(mesh), placement=["ff_up"], micro_batches=2)
    split = fit(strategy, transformer_block, adam, xt, yt, batch_size=8)
    out["transformer"] = max_differences(reference, split)
    out["transformer_placement"] = placements(strategy, split)
    out["transformer_stages"] = strategy.placement_plan(split).stages.stage_of

    rng = np.random.RandomState(4)
    xc, yc = rng.rand(32, 8, 8, 1).astype("float32"), rng.randint(0, 10, size=32)

    def cnn():
        return tfdist.models.cnn(input_shape=(8, 8, 1), filters=(8, 8), dense_units=16)

    sgd = lambda: keras.optimizers.SGD(0.1)
    reference = fit(default, cnn, sgd, xc, yc, batch_size=8, loss="sparse_categorical_crossentropy")
    strategy = tfdist.ModelParallelStrategy(cnn_layout(mesh), placement=["flatten"], micro_batches=2)
    split = fit(strategy, cnn, sgd, xc, yc, batch_size=8, loss="sparse_categorical_crossentropy")
    out["cnn"] = max_differences(reference, split)
    out["cnn_placement"] = placements(strategy, split)
    out["cnn_kinds"] = {s.name: s.kind for s in strategy.placement_plan(split).layers}
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    from conftest import run_python

    proc = run_python(JOB, HERE, timeout=900)
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def _assert_placed(rows: list) -> None:
    assert rows
    for path, devices, expected in rows:
        assert [_short(d) for d in devices] == [_short(d) for d in expected], path


@pytest.mark.slow
def test_2x2x2_mlp_sgd_and_adam_equal_one_device(results):
    for path, (diff, _) in results["mlp_sgd"].items():
        assert diff < 1e-5, path
    for path, (diff, scale) in results["mlp_adam"].items():
        assert diff <= 1e-4 * max(scale, 1e-3), path
    assert len(results["mlp_sgd"]) == 10  # 5 Dense layers, kernel and bias each


@pytest.mark.slow
def test_2x2x2_variables_and_slots_live_on_their_stage_group(results):
    for key in ("mlp_sgd_placement", "mlp_adam_placement", "transformer_placement", "cnn_placement"):
        _assert_placed(results[key])
    adam = {path.split("/", 1)[-1] if "momentum" in path else path: devices
            for path, devices, _ in results["mlp_adam_placement"]}
    # shard k of stage 1's up2 on group (row, 1)'s k-th device in both rows; its Adam slots next to it
    assert [_short(d) for d in adam["up2/kernel_shard_1"]] == ["CPU:3", "CPU:7"]
    assert [_short(d) for d in adam["up2_kernel_shard_1_momentum"]] == ["CPU:3", "CPU:7"]
    assert [_short(d) for d in adam["head/kernel"]] == ["CPU:2", "CPU:6"]  # replicated: the group's first device
    assert [_short(d) for d in adam["up1/kernel_shard_0"]] == ["CPU:0", "CPU:4"]


@pytest.mark.slow
def test_2x2x2_evaluate_predict_keras_file_and_checkpoint(results):
    (ref_loss, split_loss) = results["evaluate"]
    assert abs(ref_loss - split_loss) <= 1e-4 * max(abs(ref_loss), 1.0)
    assert results["predict"] < 1e-4
    assert results["loaded"] < 1e-6          # the file holds the logical weights: plain Keras predicts the same
    assert results["loaded_slots"] < 1e-4    # and the optimizer's logical slots, like one device's
    for path, (diff, scale) in results["checkpoint"].items():  # restored in plain Keras, one more epoch each
        assert diff <= 1e-4 * max(scale, 1e-3), path


@pytest.mark.slow
def test_2x2x2_transformer_block_adam_equals_one_device(results):
    diffs = results["transformer"]
    assert any("query" in p for p in diffs) and any("ff_up" in p for p in diffs)
    for path, (diff, scale) in diffs.items():
        if path == "mha/key/bias":
            # its exact gradient is 0 (softmax ignores a shift shared by all keys): Adam divides rounding noise
            # by its own size, so on one device too it moves by ~1e-5 in directions the summation order decides
            continue
        assert diff <= 1e-4 * max(scale, 1e-3), path
    assert results["transformer_stages"]["mha"] == 0 and results["transformer_stages"]["ff_up"] == 1


@pytest.mark.slow
def test_2x2x2_example_cnn_equals_one_device(results):
    for path, (diff, _) in results["cnn"].items():
        assert diff < 1e-5, path
    assert results["cnn_kinds"] == {"conv1": "conv_column", "conv2": "conv_row", "dense1": "column",
                                    "logits": "row"}
