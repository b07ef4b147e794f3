"""Trains a wide MLP for a few Adam steps at one ZeRO stage on 4 logical replicas; prints a JSON line.

Run: python tests/zero3_cgroup_job.py STAGE WIDTH DEPTH STEPS. tests/test_zero3_cgroup.py runs it inside
a memory-capped cgroup: the stages that do not fit are OOM-killed, stage 3 trains.
"""

from __future__ import annotations

import json
import sys

import numpy as np

import tfdist

if __name__ == "__main__":
    stage, width, depth, steps = (int(a) for a in sys.argv[1:5])
    tfdist.devices.virtual_cpus(4)
    import keras

    strategy = tfdist.MirroredStrategy(zero_stage=stage)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((width,)),
                                  *[keras.layers.Dense(width, activation="tanh") for _ in range(depth)],
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    batch = 16
    x = np.random.default_rng(0).normal(size=(batch * steps, width)).astype("float32")
    y = np.random.default_rng(1).normal(size=(batch * steps, 1)).astype("float32")
    history = model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0).history["loss"]
    print(json.dumps({"stage": stage, "loss": history,
                      "num_params": int(sum(np.prod(v.shape) for v in model.trainable_variables))}), flush=True)
