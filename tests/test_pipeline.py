"""LayerPlacementStrategy trains like one device: stages, micro-batches, data x model, save/load."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import tfdist
from test_placement import branchy, compiled, cpus, data, small_cnn

BUILDERS = {"cnn": small_cnn, "branchy": branchy}


def _train(build, kind, strategy=None, epochs=2, batch=32, lr=0.1):
    keras.utils.set_random_seed(0)
    model = compiled(build, strategy, optimizer=lambda: keras.optimizers.SGD(lr))
    x, y = data(kind)
    model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    return model


def _max_diff(a: keras.Model, b: keras.Model) -> float:
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a.get_weights(), b.get_weights()))


@pytest.mark.parametrize("kind, stages, micro_batches, data_parallel", [
    ("cnn", 2, 1, 1),
    ("cnn", 2, 4, 1),
    ("cnn", 4, 1, 1),
    ("cnn", 4, 2, 1),
    ("branchy", 4, 4, 1),
    ("cnn", 2, 1, 2),
    ("branchy", 2, 2, 2),
])
def test_training_matches_one_device(kind, stages, micro_batches, data_parallel):
    build = BUILDERS[kind]
    reference = _train(build, kind)
    strategy = tfdist.LayerPlacementStrategy(cpus(stages * data_parallel), micro_batches=micro_batches,
                                             data_parallel=data_parallel)
    placed = _train(build, kind, strategy)
    assert strategy.placement_plan().num_stages == stages
    assert _max_diff(reference, placed) <= 1e-5
    x, y = data(kind)
    np.testing.assert_allclose(placed.predict(x, verbose=0), reference.predict(x, verbose=0), atol=1e-5)
    np.testing.assert_allclose(placed.evaluate(x, y, verbose=0), reference.evaluate(x, y, verbose=0), atol=1e-5)


def test_partial_last_batch_is_padded_not_mixed_in():
    # 70 samples, batch 32: the last batch has 6 samples, padded to 8 for 4 micro-batches; the
    # padded rows are dropped before the loss, so training still matches one device exactly.
    def train(strategy):
        keras.utils.set_random_seed(0)
        model = compiled(small_cnn, strategy)
        x, y = data("cnn", 70)
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        return model

    reference = train(None)
    placed = train(tfdist.LayerPlacementStrategy(cpus(2), micro_batches=4))
    assert _max_diff(reference, placed) <= 1e-5


def test_accumulated_micro_batch_gradient_equals_full_batch_gradient():
    # One SGD step with learning rate 1: the weight change is exactly the (accumulated) gradient.
    x, y = data("cnn", 32)
    changes = {}
    for micro_batches in (1, 8):
        strategy = tfdist.LayerPlacementStrategy(cpus(2), micro_batches=micro_batches)
        model = compiled(small_cnn, strategy, optimizer=lambda: keras.optimizers.SGD(1.0))
        before = model.get_weights()
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        changes[micro_batches] = [b - a for a, b in zip(model.get_weights(), before)]
    for g1, g8 in zip(changes[1], changes[8]):
        assert np.max(np.abs(g1)) > 0
        np.testing.assert_allclose(g8, g1, atol=1e-6)


def test_keras_file_round_trip_and_loads_on_one_device(tmp_path, python):
    strategy = tfdist.LayerPlacementStrategy(cpus(2), micro_batches=2)
    model = _train(small_cnn, "cnn", strategy, epochs=1)
    path = str(tmp_path / "placed.keras")
    model.save(path)
    x, _ = data("cnn")
    expected = model.predict(x, verbose=0)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "expected.npy", expected)
    with strategy.scope():  # back into a strategy: same predictions
        again = keras.saving.load_model(path)
    np.testing.assert_allclose(again.predict(x, verbose=0), expected, atol=1e-6)
    # A fresh process with TensorFlow's single default CPU: plain load, same predictions.
    out = python(f"""
        import numpy as np, keras, tensorflow as tf
        assert len(tf.config.list_logical_devices("CPU")) == 1
        model = keras.saving.load_model({path!r})
        got = model.predict(np.load({str(tmp_path / 'x.npy')!r}), verbose=0)
        print("maxdiff", float(np.max(np.abs(got - np.load({str(tmp_path / 'expected.npy')!r})))))
    """)
    assert float(out.stdout.split("maxdiff")[-1]) <= 1e-6


def test_batch_norm_single_micro_batch_matches_and_documented_difference():
    def bn_model():
        init = keras.initializers.GlorotUniform(seed=3)
        return keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, kernel_initializer=init, name="a"),
                                 keras.layers.BatchNormalization(name="bn"),
                                 keras.layers.Dense(3, activation="softmax", kernel_initializer=init, name="b")])

    reference = _train(bn_model, "branchy")
    same = _train(bn_model, "branchy", tfdist.LayerPlacementStrategy(cpus(2)))
    assert _max_diff(reference, same) <= 1e-5
    # GPipe semantics: with micro-batches BatchNormalization normalises each micro-batch with its
    # own statistics (documented in tfdist.pipeline.microbatches), so training differs measurably.
    micro = _train(bn_model, "branchy", tfdist.LayerPlacementStrategy(cpus(2), micro_batches=4))
    assert _max_diff(reference, micro) > 1e-4


def _ancestors(op) -> set:
    seen, stack = set(), [op]
    while stack:
        current = stack.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def test_stage_streams_order_micro_batches_per_device():
    # GPipe's schedule as control edges in the traced step: on each device, micro-batch m's
    # forward starts after m-1's (or after the previous layer of m). The backward runs as one
    # chain per device: input gradients (B) in micro-batch order, weight gradients (W) deferred
    # by the stage's index (zero-bubble style), each W followed by adding it to the running sum.
    # Without the chains TF ran two micro-batches (or a B and a W) of one stage on both cores.
    import re

    import tensorflow as tf

    strategy = tfdist.LayerPlacementStrategy(cpus(2), placement=["d2"], micro_batches=4)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,))] + [keras.layers.Dense(8, name=f"d{i}") for i in range(4)])
    strategy.place(model)

    @tf.function
    def grads(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=True))
        return tape.gradient(loss, model.trainable_variables)

    graph = grads.get_concrete_function(tf.TensorSpec([16, 8])).graph
    micro_batch = lambda name: int(re.search(r"micro_batch_(\d+)/", name).group(1))  # noqa: E731
    forward = set()
    for op in graph.get_operations():
        if op.control_inputs and op.device and "/to_stage/" in op.name:
            device = op.device[-5:]
            assert {c.device[-5:] for c in op.control_inputs} == {device}, op.name  # one stream per device
            m = micro_batch(op.name)
            assert {micro_batch(c.name) for c in op.control_inputs} <= {m, m - 1}, op.name
            forward.add((device, m))
    assert {m for d, m in forward if d == "CPU:0"} == {m for d, m in forward if d == "CPU:1"} == {0, 1, 2, 3}

    def expected(lag):  # layer calls 1 (later layer) then 0 on each device
        order = []
        for step in range(4 + lag):
            if step < 4:
                order += [("B", step, 1), ("B", step, 0)]
            m = step - lag
            if m >= 0:
                for seq in (1, 0):
                    order += [("W", m, seq)] + ([("sum", m, seq)] if m else [])
        return order

    schedule = {device[-5:]: tasks for device, tasks in strategy._streams.schedule(graph).items()}
    assert [label for label, _, _ in schedule["CPU:0"]] == expected(0)
    assert [label for label, _, _ in schedule["CPU:1"]] == expected(1)
    for device, tasks in schedule.items():
        for (_, _, before), (label, entries, _) in zip(tasks, tasks[1:]):
            assert entries and before, label
            for op in entries:  # each task waits (directly or through its predecessors) for the previous
                assert op.device[-5:] == device
                assert set(before) <= _ancestors(op), (device, label)
    # Each weight gradient is the running sum after the last micro-batch (no M-way sum at the end).
    assert not [op for op in graph.get_operations() if op.type == "AddN"]
    for t in graph.outputs:
        while t.op.type == "Identity":
            t = t.op.inputs[0]
        assert "accumulate_3/" in t.op.name and t.op.type in ("AddV2", "Add"), t.op.name
    # And the streamed step still computes the plain gradient.
    x = tf.random.stateless_normal([16, 8], seed=[1, 2])
    for g, v in zip(grads(x), model.trainable_variables):
        with tf.GradientTape() as tape:
            h = x
            for layer in model.layers:
                h = h @ layer.kernel + layer.bias
            loss = tf.reduce_sum(h)
        np.testing.assert_allclose(g, tape.gradient(loss, v), atol=1e-5)
