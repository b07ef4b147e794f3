"""Stage 0 of tfdist.HorovodStrategy with global_clipnorm and Keras' EMA (overwrite every 3 steps), fed global
batches (the strategy splits each across the ranks); rank 0 also trains one device on them. Writes
OUT/rank{r}.npz: the strategy's weights (and, on rank 0, the one-device and unclipped references)."""

from __future__ import annotations

import contextlib
import os
import sys

import numpy as np

import tfdist

strategy = tfdist.HorovodStrategy()
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

out, rank = sys.argv[1], strategy.rank
rng = np.random.default_rng(0)
x = rng.normal(size=(192, 8)).astype("float32")
y = rng.normal(size=(192, 4)).astype("float32")
GLOBAL = 32


def optimizer(clip: bool = True):
    extra = {"global_clipnorm": 0.05} if clip else {}
    return keras.optimizers.SGD(0.1, momentum=0.5, use_ema=True, ema_momentum=0.8, ema_overwrite_frequency=3,
                                **extra)


def train(scope, clip=True):
    with scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(4)])
        model.compile(optimizer=optimizer(clip), loss="mse")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL)
    model.fit(data, epochs=2, shuffle=False, verbose=0)
    return model.get_weights()


arrays = {"strategy": train(strategy.scope)}
if rank == 0:
    arrays["single"] = train(contextlib.nullcontext)
    arrays["unclipped"] = train(contextlib.nullcontext, clip=False)
np.savez(os.path.join(out, f"rank{rank}.npz"),
         **{f"{k}_{i}": w for k, ws in arrays.items() for i, w in enumerate(ws)})
