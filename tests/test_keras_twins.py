"""A Keras object built under a tfdist strategy is the same Keras object as its twin built in plain Keras: the same
names in dir(), the same config, Keras' own serialization round trip, the same variables in the same order."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import twins

import tfdist

X = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
Y = np.random.default_rng(1).normal(size=(64, 1)).astype("float32")


def build(optimizer) -> keras.Model:
    inputs = keras.Input((8,), name="x")
    hidden = keras.layers.Dense(16, activation="relu", name="hidden",
                                kernel_initializer=keras.initializers.GlorotUniform(1))(inputs)
    model = keras.Model(inputs, keras.layers.Dense(
        1, name="out", kernel_initializer=keras.initializers.GlorotUniform(2))(hidden), name="twin")
    model.compile(optimizer=optimizer(), loss="mse")
    return model


def layout() -> tfdist.LayoutMap:
    layout_map = tfdist.LayoutMap(tfdist.DeviceMesh((2, 2), ("batch", "model")))
    layout_map["hidden/kernel"] = (None, "model")
    layout_map["out/kernel"] = ("model", None)
    return layout_map


OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01, name="opt"),
    "sgd-accumulate-ema": lambda: keras.optimizers.SGD(0.1, momentum=0.9, gradient_accumulation_steps=2,
                                                       use_ema=True, name="opt"),
}
STRATEGIES = {
    **{f"mirrored-zero{stage}": lambda stage=stage: tfdist.MirroredStrategy(zero_stage=stage) for stage in range(4)},
    "layer-placement": lambda: tfdist.LayerPlacementStrategy(devices=["/cpu:0", "/cpu:1"], micro_batches=2),
    "model-parallel": lambda: tfdist.ModelParallelStrategy(layout()),
    "model-parallel-zero3": lambda: tfdist.ModelParallelStrategy(layout(), zero_stage=3),
}
# ModelParallelStrategy keeps a split weight as one variable per device (docs/tensor-parallel.md): its
# variable lists (`model.weights`, the optimizer's) hold the shards, compared by the tensor-parallel tests against
# the logical model; `get_weights`/`set_weights` are logical, as in plain Keras.
SHARDED_VARIABLES = {"model-parallel", "model-parallel-zero3"}


def names(obj) -> set[str]:
    return set(dir(obj))


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("strategy_name", sorted(STRATEGIES))
def test_a_model_and_optimizer_built_under_a_strategy_are_their_plain_keras_twins(strategy_name, optimizer):
    plain = build(OPTIMIZERS[optimizer])
    strategy = STRATEGIES[strategy_name]()
    with strategy.scope():
        twin = build(OPTIMIZERS[optimizer])
    # Keras' own check, on the optimizer as the scope made it: config round trip, then dir() of the revived one.
    assert twins.serialization_differences(twin.optimizer) == []
    assert names(twin.optimizer) == names(plain.optimizer)

    plain.fit(X, Y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    if strategy_name == "model-parallel" and optimizer == "sgd-accumulate-ema":
        # Keras puts an accumulating update inside tf.cond, which rows meeting in a merge_call cannot run.
        with pytest.raises(tfdist.ConfigError,
                           match="gradient_accumulation_steps=2 at zero_stage=0 needs one mesh row"):
            twin.fit(X, Y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        return
    if strategy_name == "mirrored-zero0" and optimizer == "sgd-accumulate-ema":
        with pytest.raises(tfdist.ConfigError, match="gradient_accumulation_steps=2 at zero_stage=0 needs one device"):
            twin.fit(X, Y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        return
    twin.fit(X, Y, batch_size=16, epochs=2, verbose=0, shuffle=False)

    assert twins.differences(twin, plain, sharded_variables=strategy_name in SHARDED_VARIABLES) == []
    for mine, theirs in zip(twin.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)
    if strategy_name in SHARDED_VARIABLES:  # logical values in, logical values out: each split over its shards
        twin.set_weights(plain.get_weights())
        for mine, theirs in zip(twin.get_weights(), plain.get_weights(), strict=True):
            np.testing.assert_array_equal(mine, theirs)
        for mine, theirs in zip(twin.layers, plain.layers, strict=True):
            assert [w.shape for w in mine.get_weights()] == [w.shape for w in theirs.get_weights()], mine.name
        with pytest.raises(ValueError, match="weight shape"):
            twin.set_weights([np.zeros((16, 8), "float32")] + plain.get_weights()[1:])
    if strategy_name == "mirrored-zero0":  # no_sync attaches its accumulation hook to the optimizer
        strategy = STRATEGIES[strategy_name]()  # no_sync acts on every optimizer of its strategy: a fresh one
        with strategy.scope():
            fresh = build(OPTIMIZERS[optimizer])
        with strategy.no_sync():
            fresh.fit(X[:32], Y[:32], batch_size=16, epochs=1, verbose=0, shuffle=False)
        assert names(fresh.optimizer) == names(plain.optimizer)


def test_accumulation_over_several_pipelines_is_a_config_error_naming_the_fix():
    strategy = tfdist.LayerPlacementStrategy(devices=["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"], data_parallel=2)
    with strategy.scope():
        model = build(OPTIMIZERS["sgd-accumulate-ema"])
    with pytest.raises(tfdist.ConfigError, match=r"gradient_accumulation_steps=2 needs one pipeline \(data_parallel=1"):
        model.fit(X, Y, batch_size=16, epochs=1, verbose=0, shuffle=False)
