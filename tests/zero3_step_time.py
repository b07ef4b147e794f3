"""Step time of ZeRO stage 3 vs stage 0 on 4 logical replicas (one process): median of interleaved rounds.

Run: python tests/zero3_step_time.py [ROUNDS] → one JSON line {stage: {min, median, max} ms per step}.
Not a test (no timed asserts); a measurement for docs/zero.md until `tfdist bench zero` covers stage 3.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np

import tfdist

WIDTH, DEPTH, REPLICAS, BATCH, SAMPLES = 512, 6, 4, 256, 2048

if __name__ == "__main__":
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    tfdist.devices.virtual_cpus(REPLICAS)
    import keras

    x = np.random.default_rng(0).normal(size=(SAMPLES, WIDTH)).astype("float32")
    y = np.random.default_rng(1).normal(size=(SAMPLES, 1)).astype("float32")
    models = {}
    for name, stage in (("stage0", 0), ("stage3", 3), ("stage3_prefetch", 3)):
        strategy = tfdist.MirroredStrategy(zero_stage=stage)
        if name == "stage3_prefetch":
            tfdist.zero.configure_stage3(strategy, prefetch=True)
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((WIDTH,)),
                                      *[keras.layers.Dense(WIDTH, activation="tanh") for _ in range(DEPTH)],
                                      keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)  # trace and build
        models[name] = model
    times: dict[str, list[float]] = {name: [] for name in models}
    steps = SAMPLES // BATCH
    for _ in range(rounds):
        for name, model in models.items():
            start = time.perf_counter()
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
            times[name].append((time.perf_counter() - start) * 1000 / steps)
    out = {s: {"min": min(t), "median": statistics.median(t), "max": max(t)} for s, t in times.items()}
    for name in ("stage3", "stage3_prefetch"):
        out[f"{name}_over_stage0"] = out[name]["median"] / out["stage0"]["median"]
    out["setup"] = f"MLP {DEPTH}x{WIDTH} + head, Adam, global batch {BATCH}, {REPLICAS} logical CPUs, {rounds} rounds"
    print(json.dumps(out))
