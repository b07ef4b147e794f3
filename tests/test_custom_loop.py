"""TensorFlow's custom-training-loop tutorial pattern on tfdist strategies (issue: the lazily built optimizer)."""

from __future__ import annotations

import json

import numpy as np
import pytest

# The tutorial's loop: strategy.run + experimental_distribute_dataset + compute_average_loss + reduce. The
# optimizer is built lazily, by its first apply_gradients inside the tf.function, unless BUILD_FIRST.
LOOP = """
import json, os, sys
import tfdist
tfdist.devices.virtual_cpus(2)
import keras, numpy as np, tensorflow as tf

kind, build_first = sys.argv[1], sys.argv[2] == "1"
devices = ["/cpu:0", "/cpu:1"]
strategy = {"stock": lambda: tf.distribute.MirroredStrategy(devices),
            "tfdist": lambda: tfdist.MirroredStrategy(devices=devices),
            "zero1": lambda: tfdist.MirroredStrategy(devices=devices, zero_stage=1),
            "zero2": lambda: tfdist.MirroredStrategy(devices=devices, zero_stage=2),
            "zero3": lambda: tfdist.MirroredStrategy(devices=devices, zero_stage=3),
            "placement": lambda: tfdist.LayerPlacementStrategy(devices)}[kind]()
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x, y = rng.normal(size=(128, 6)).astype("float32"), rng.integers(0, 3, size=128).astype("int32")
with strategy.scope():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    optimizer = keras.optimizers.Adam(1e-2)
    if build_first:
        optimizer.build(model.trainable_variables)
dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(32))
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

@tf.function
def train_step(inputs):
    def step(features, labels):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_fn(labels, model(features, training=True)), global_batch_size=32)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return strategy.reduce("SUM", strategy.run(step, args=inputs), axis=None)

losses = [float(train_step(batch)) for _ in range(3) for batch in dataset]
print("RESULT", json.dumps({"losses": losses, "weights": [w.tolist() for w in model.get_weights()],
                            "iterations": int(optimizer.iterations.numpy()),
                            "devices": {v.path: v.value.device[-5:] for v in model.variables + optimizer.variables}}))
"""


def _run(python, kind: str, build_first: bool) -> dict:
    out = python(LOOP, kind, "1" if build_first else "0").stdout
    return json.loads(out.split("RESULT ", 1)[1])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tfdist", "zero1", "zero2", "zero3"])
def test_an_optimizer_built_lazily_inside_the_step_trains_like_stock_mirrored(python, kind):
    # Stock MirroredStrategy needs the optimizer built first (lazily it fails: "You must feed a value for
    # placeholder tensor 'cond/...'", keras#19246); tfdist strategies build it eagerly on first apply
    # (ZeRO-3: before the step's forward, which must read the parameters' pieces, not the full variables).
    reference = _run(python, "stock", build_first=True)
    lazy = _run(python, kind, build_first=False)
    assert lazy["iterations"] == reference["iterations"] == 12
    assert lazy["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    for a, b in zip(lazy["weights"], reference["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("build_first", [False, True], ids=["lazy", "built-first"])
def test_layer_placement_places_a_custom_loops_global_model_and_its_optimizer(python, build_first):
    # The tutorial keeps `model` global: the strategy finds it on the first step and places it. An optimizer
    # built before that step follows (its slots move next to their variables, its index is rebuilt) instead
    # of Keras' "Unknown variable ... can only be called for the variables it was originally built with".
    reference = _run(python, "stock", build_first=True)
    placed = _run(python, "placement", build_first=build_first)
    assert placed["iterations"] == 12
    assert placed["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    for a, b in zip(placed["weights"], reference["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    devices = placed["devices"]
    assert devices["sequential/dense/kernel"] == "CPU:0" and devices["sequential/dense_1/kernel"] == "CPU:1"
    slots = {path: device for path, device in devices.items() if path.startswith("adam/sequential_dense_1_")}
    assert len(slots) == 4 and set(slots.values()) == {"CPU:1"}, devices
