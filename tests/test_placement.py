"""LayerPlacementStrategy: plans, balancing, bad input, and where TF actually ran each op."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.errors import ConfigError
from tfdist.pipeline import describe_model, make_plan
from tfdist.pipeline.balance import block_partition

# --- models ---------------------------------------------------------------------------------


def small_cnn(seed: int = 1) -> keras.Model:
    return tfdist.models.cnn((12, 12, 1), 10, filters=(4, 8), dense_units=16, seed=seed)


def branchy(seed: int = 2) -> keras.Model:
    """Functional model with two parallel branches and a skip connection across them."""
    init = lambda i: keras.initializers.GlorotUniform(seed=seed + i)  # noqa: E731
    x = keras.Input((12,), name="x")
    stem = keras.layers.Dense(16, activation="tanh", kernel_initializer=init(0), name="stem")(x)
    left = keras.layers.Dense(16, activation="tanh", kernel_initializer=init(1), name="left")(stem)
    right = keras.layers.Dense(16, activation="relu", kernel_initializer=init(2), name="right")(stem)
    merged = keras.layers.Add(name="merge")([left, right, stem])            # skip from stem
    deep = keras.layers.Dense(16, activation="tanh", kernel_initializer=init(3), name="deep")(merged)
    cat = keras.layers.Concatenate(name="cat")([deep, stem])                  # long skip
    out = keras.layers.Dense(3, activation="softmax", kernel_initializer=init(4), name="out")(cat)
    return keras.Model(x, out, name="branchy")


def data(kind: str, n: int = 64):
    rng = np.random.default_rng(0)
    if kind == "cnn":
        return rng.random((n, 12, 12, 1), dtype=np.float32), rng.integers(0, 10, n)
    return rng.standard_normal((n, 12)).astype("float32"), rng.integers(0, 3, n)


def cpus(n: int) -> list[str]:
    return [f"/cpu:{i}" for i in range(n)]


def compiled(build, strategy=None, optimizer=None):
    def make():
        model = build()
        model.compile(optimizer=optimizer() if optimizer else keras.optimizers.SGD(0.1),
                      loss="sparse_categorical_crossentropy")
        return model

    if strategy is None:
        return make()
    with strategy.scope():
        return make()


# --- balancing ------------------------------------------------------------------------------


def _brute_force(costs, k):
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), k - 1):
        bounds = (0, *cuts, len(costs))
        worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


def test_block_partition_is_optimal_against_brute_force():
    rng = np.random.default_rng(0)
    assert block_partition([1, 1, 1, 1, 4], 2) == [4, 1]
    assert block_partition([3, 1, 1, 1], 3) == [1, 1, 2]
    assert block_partition([5], 1) == [1]
    for _ in range(200):
        n = int(rng.integers(1, 9))
        k = int(rng.integers(1, n + 1))
        costs = [float(c) for c in rng.integers(0, 20, n)]
        sizes = block_partition(costs, k)
        assert len(sizes) == k and sum(sizes) == n and min(sizes) >= 1
        bounds = np.cumsum([0, *sizes])
        worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        assert worst == _brute_force(costs, k)


def test_plan_costs_and_table():
    model = small_cnn()
    infos = describe_model(model)
    by_name = {i.name: i for i in infos}
    # conv1: 3x3 kernel, 1 -> 4 channels, 12x12 outputs: 2*9*1*4*144 FLOPs; output 12*12*4 floats.
    assert by_name["conv1"].flops == 2 * 9 * 1 * 4 * 144
    assert by_name["conv1"].activation_bytes == 12 * 12 * 4 * 4
    assert by_name["dense1"].params == 72 * 16 + 16
    assert [i.name for i in infos] == ["conv1", "pool1", "conv2", "pool2", "flatten", "dense1", "logits"]
    plan = make_plan(infos, "auto", [cpus(2)], balance="params")
    totals = plan.stage_totals()
    assert sum(t["params"] for t in totals) == model.count_params()
    assert max(t["params"] for t in totals) == min(
        max(sum(i.params for i in infos[:c]), sum(i.params for i in infos[c:])) for c in range(1, len(infos)))
    flops_plan = make_plan(infos, "auto", [cpus(2)], balance="flops")
    assert flops_plan.stage_of != plan.stage_of  # convolutions dominate FLOPs, dense layers params
    text = str(plan)
    for name in by_name:
        assert name in text
    assert "stage 1 on CPU:1" in text and "params" in text


def test_training_backward_needs_no_input_gradient_before_the_first_weights():
    from tfdist.pipeline.balance import needs_input_gradients

    mlp = keras.Sequential([keras.Input((6, 2)), keras.layers.Flatten(name="flat"),
                            keras.layers.Dense(8, name="a"), keras.layers.Dense(8, name="b"),
                            keras.layers.Dense(3, name="c")])
    assert needs_input_gradients(tfdist.pipeline.layer_graph(mlp)) == [False, False, True, True]
    graph = tfdist.pipeline.layer_graph(branchy())
    flags = dict(zip([layer.name for layer, *_ in graph], needs_input_gradients(graph)))
    assert flags == {"stem": False, "left": True, "right": True, "merge": True, "deep": True, "cat": True,
                     "out": True}


def test_time_balance_picks_the_brute_force_split_of_measured_forward_backward_costs():
    # balance="time" measures each layer's forward + the backward training runs (input gradient
    # only where needed), at the micro-batch size, and splits where brute force on those costs does.
    def mlp():
        # Wide enough that every layer stays well above the harness overhead on a busy machine.
        layers = [keras.Input((64,))] + [keras.layers.Dense(w, name=f"d{i}") for i, w in enumerate((512, 32, 512, 32, 8))]
        return keras.Sequential(layers)

    for stages in (2, 3):
        strategy = tfdist.LayerPlacementStrategy(cpus(stages), balance="time", micro_batches=2)
        model = compiled(mlp, strategy)
        model.fit(np.zeros((16, 64), "float32"), np.zeros(16, "int64"), batch_size=16, epochs=1, verbose=0)
        plan = strategy.placement_plan()
        assert strategy._measure_batch == 8  # 16 samples / 2 micro-batches
        costs = [info.seconds for info in plan.layers]
        assert all(c is not None and c >= 0 for c in costs) and sum(costs) > 0
        best = min(itertools.combinations(range(1, len(costs)), stages - 1),
                   key=lambda cuts: max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, len(costs)))))
        bounds = list(zip((0, *best), (*best, len(costs))))
        got = max(sum(costs[a:b]) for a, b in bounds)
        chosen = [plan.stage_of[info.name] for info in plan.layers]
        chosen_bounds = [(chosen.index(k), len(chosen) - chosen[::-1].index(k)) for k in range(stages)]
        assert max(sum(costs[a:b]) for a, b in chosen_bounds) == pytest.approx(got)
        assert "ms fwd+bwd" in str(plan)


def test_manual_placements_agree():
    infos = describe_model(small_cnn())
    grid = [cpus(3)]
    splits = make_plan(infos, ["conv2", "dense1"], grid).stage_of
    named = make_plan(infos, {"conv2": 1, "dense1": 2}, grid).stage_of
    grouped = make_plan(infos, {0: ["conv1", "pool1"], 1: ["conv2", "pool2", "flatten"],
                                2: ["dense1", "logits"]}, grid).stage_of
    assert splits == named == grouped
    assert [splits[n] for n in ["conv1", "pool1", "conv2", "pool2", "flatten", "dense1", "logits"]] == \
        [0, 0, 1, 1, 1, 2, 2]


@pytest.mark.parametrize("placement, devices, message", [
    ({"nope": 1}, 2, "no such layer"),
    (["conv2", "conv2"], 3, "twice"),
    ({0: ["conv1"], 1: ["conv1"]}, 2, "assigns layer 'conv1' twice"),
    ({"conv1": 5}, 2, "stages are 0..1"),
    (["conv1"], 2, "stage 0 empty"),
    ({"dense1": 0, "conv1": 1}, 2, "data-flow order"),
    ("auto", 8, "only 7 layers"),
])
def test_bad_placements_raise_config_error(placement, devices, message):
    infos = describe_model(small_cnn())
    with pytest.raises(ConfigError, match=message):
        make_plan(infos, placement, [[f"/cpu:{i % 4}" for i in range(devices)]])


def test_cycle_between_stages_is_refused():
    infos = describe_model(branchy())
    # stem/left on 0, right on 1, merge (reads left, right) back on 0: 0 -> 1 -> 0.
    with pytest.raises(ConfigError, match="would need a cycle"):
        make_plan(infos, {"stem": 0, "left": 0, "right": 1, "merge": 0, "deep": 1}, [cpus(2)])


def test_bad_strategy_arguments():
    with pytest.raises(ConfigError, match="no device '/cpu:9'"):
        tfdist.LayerPlacementStrategy(["/cpu:0", "/cpu:9"])
    with pytest.raises(ConfigError, match="data_parallel=2 does not divide"):
        tfdist.LayerPlacementStrategy(cpus(3), data_parallel=2)
    with pytest.raises(ConfigError, match="balance"):
        tfdist.LayerPlacementStrategy(cpus(2), balance="memory")
    with pytest.raises(ConfigError, match="micro_batches"):
        tfdist.LayerPlacementStrategy(cpus(2), micro_batches=0)
    strategy = tfdist.LayerPlacementStrategy(cpus(2), micro_batches=8)
    model = compiled(small_cnn, strategy)
    x, y = data("cnn")
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(60)
    with pytest.raises(ConfigError, match="micro_batches=8 does not divide the batch"):
        model.fit(batches, epochs=1, verbose=0)
    with pytest.raises(ConfigError, match="a batch of 12 gives 12 samples"):
        model.predict(tf.data.Dataset.from_tensor_slices(x).batch(12, drop_remainder=True), verbose=0)
    from tfdist.pipeline.microbatches import split_batch

    with pytest.raises(ConfigError, match="does not divide the per-replica batch of 12"):
        split_batch(tf.zeros((12, 3)), 8)
    with pytest.raises(ConfigError, match="4 stages but the model has only 1 layers"):
        big = tfdist.LayerPlacementStrategy(cpus(4))
        tiny = compiled(lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]), big)
        big.place(tiny)


# --- where TF ran the ops -------------------------------------------------------------------

_SEND_RECV = re.compile(r"/_\d+$")


def _layer_of(node: str, names: set[str]) -> str | None:
    for part in node.split("/"):
        base = re.sub(r"(_\d+)+$", "", part)
        base = base[: -len("_backward")] if base.endswith("_backward") else base
        if base in names:
            return base
    return None


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_forward_backward_and_updates_run_on_stage_devices(micro_batches):
    # TF's run metadata lists every function instantiated while it collects, in this process: in a long session
    # other tests' functions showed up (a 4-replica "cnn_1" step on CPU:2). The check runs in a fresh process.
    if os.environ.get("TFDIST_ISOLATED_TEST") != "1":
        test_id = f"{os.path.abspath(__file__)}::test_forward_backward_and_updates_run_on_stage_devices[{micro_batches}]"
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_id],
                              env={**os.environ, "TFDIST_ISOLATED_TEST": "1"}, capture_output=True, text=True,
                              timeout=600, check=False)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
        return
    strategy = tfdist.LayerPlacementStrategy(cpus(2), placement=["pool2"], micro_batches=micro_batches)
    model = compiled(small_cnn, strategy, optimizer=lambda: keras.optimizers.Adam(0.01))
    x, y = data("cnn")
    # TF's own record of the partition graphs it executed (after placement) on the first step.
    executed = tfdist.pipeline.executed_devices(
        lambda: model.fit(x, y, batch_size=32, epochs=1, steps_per_epoch=1, verbose=0))
    plan = strategy.placement_plan()
    names = set(plan.stage_of)
    seen = {"forward": set(), "backward": set()}
    for node, devices in executed.items():
        layer = _layer_of(node, names)
        if layer is None or _SEND_RECV.search(node) or node.startswith("ConstantFolding/"):
            continue
        expected = f"CPU:{plan.stage_of[layer]}"
        assert {d[-5:] for d in devices} == {expected}, (node, devices)
        seen["backward" if "gradient_tape" in node or "_backward" in node else "forward"].add(layer)
    assert seen["forward"] == names
    assert seen["backward"] >= {"conv1", "pool1", "conv2", "pool2", "dense1", "logits"}
    # Optimizer update blocks (one per variable) each run on one device: 4 variables per stage.
    # (Reads of the optimizer's shared scalars, iteration and learning rate, run where those
    # live, on stage 0, and are sent over: ReadVariableOps are left out.)
    updates: dict[str, set[str]] = {}
    for node, devices in executed.items():
        match = re.search(r"/adam(?:_\d+)?/(update_0(?:_\d+)?)/", node)
        if match and not _SEND_RECV.search(node) and not node.endswith("ReadVariableOp"):
            updates.setdefault(match.group(1), set()).update(d[-5:] for d in devices)
    assert all(len(d) == 1 for d in updates.values()), updates
    per_device = [sum(d == {f"CPU:{k}"} for d in updates.values()) for k in range(2)]
    assert per_device == [4, 4]
    # Variables and Adam slots sit on their layer's stage device.
    for layer in model.layers:
        for v in layer.variables:
            assert [c.device[-5:] for c in v.value.values] == [f"CPU:{plan.stage_of[layer.name]}"]
    slots = [v for v in model.optimizer.variables if "momentum" in v.path or "velocity" in v.path]
    assert len(slots) == 16
    for v in slots:
        layer = re.search(r"cnn_(\w+?)_(kernel|bias)", v.path).group(1)
        assert [c.device[-5:] for c in v.value.values] == [f"CPU:{plan.stage_of[layer]}"]


def test_placement_plan_before_training_and_cli_registry():
    strategy = tfdist.strategies.make_strategy("placement", replicas=2)
    assert isinstance(strategy, tfdist.LayerPlacementStrategy) and strategy.num_stages == 2
    with pytest.raises(ConfigError, match="no model has been placed"):
        strategy.placement_plan()
    model = compiled(branchy, strategy)
    plan = strategy.placement_plan(model)
    assert plan is strategy.placement_plan() and plan.num_stages == 2
    assert set(plan.stage_of) == {"stem", "left", "right", "merge", "deep", "cat", "out"}
