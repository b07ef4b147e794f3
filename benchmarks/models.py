"""The model both ZeRO benchmarks train (in one process and across processes), and its data."""

from __future__ import annotations


def mlp(width: int, inputs: int = 1024, outputs: int = 1024, seed: int = 0):
    """Input(inputs) -> Dense(width) -> Dense(width) -> Dense(outputs): 25.2M parameters at width 4096."""
    import keras

    init = keras.initializers.GlorotUniform(seed=seed)
    return keras.Sequential([
        keras.Input((inputs,)),
        keras.layers.Dense(width, activation="relu", kernel_initializer=init, name="fc1"),
        keras.layers.Dense(width, activation="relu", kernel_initializer=init, name="fc2"),
        keras.layers.Dense(outputs, kernel_initializer=init, name="out"),
    ], name=f"mlp{width}")


def mlp_data(n: int = 256, inputs: int = 1024, outputs: int = 1024):
    """`n` random (x, y) float32 rows for `mlp`, the same on every call (seed 0)."""
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.normal(size=(n, inputs)).astype("float32"), rng.normal(size=(n, outputs)).astype("float32")
