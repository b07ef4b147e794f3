"""Measures TF's CPU allocator during training steps of an MLP at one ZeRO stage (4 logical replicas).

Run: python tests/zero3_peak_job.py STAGE [keep] → prints one JSON line ("keep": stage 3 with
reshard_after_forward=False). In its own process, so that the
allocator holds only this run's tensors. TF's oneDNN CPU allocator counts every tensor of 256 KiB and
more (the weights, gradients and optimizer state here; not the small activations); it is asked for, as TF turns
oneDNN on by itself only on CPUs with AVX-512 VNNI/BF16 or AMX, and without it TF keeps no statistics.
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np

import tfdist

WIDTH, DEPTH, REPLICAS = 512, 6, 4

if __name__ == "__main__":
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = "1"  # before TensorFlow starts
    stage = int(sys.argv[1])
    tfdist.devices.virtual_cpus(REPLICAS)
    import keras
    import tensorflow as tf

    strategy = tfdist.MirroredStrategy(zero_stage=stage)
    keep = sys.argv[2:] == ["keep"]
    if keep:
        tfdist.zero.configure_stage3(strategy, reshard_after_forward=False)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((WIDTH,)),
                                  *[keras.layers.Dense(WIDTH, activation="tanh") for _ in range(DEPTH)],
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    x = np.random.default_rng(0).normal(size=(256, WIDTH)).astype("float32")
    y = np.random.default_rng(1).normal(size=(256, 1)).astype("float32")
    model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)  # traces, builds the state
    held = tf.config.experimental.get_memory_info("CPU:0")["current"]  # weights + optimizer state between steps
    tf.config.experimental.reset_memory_stats("CPU:0")
    loss = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0).history["loss"][-1]
    info = tf.config.experimental.get_memory_info("CPU:0")
    num_params = sum(math.prod(v.shape) for v in model.trainable_variables)
    engine = tfdist.zero.engine_of(model)
    units = sorted((u.gathered_bytes for u in getattr(engine, "units", ())), reverse=True)
    print(json.dumps({"stage": stage, "keep": keep, "held": held, "peak": info["peak"], "num_params": num_params,
                      "largest_units": units[:2], "loss": float(loss),
                      "formula": tfdist.zero.zero_formula(num_params, REPLICAS, stage)["total"]}))
