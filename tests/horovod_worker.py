"""One rank of the Horovod tests: `python horovod_worker.py SCENARIO[,SCENARIO...] OUT_DIR [options]` under any
launcher.

Scenarios write `OUT_DIR/rank{r}.npz` (final weights and logs) so the test can compare ranks with
each other and with a single-device run (`--reference`, no Horovod). Several scenarios run one after another in
the process, each with a strategy of its own, and write to `OUT_DIR/SCENARIO/`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402


def regression_data(n: int = 256, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    w = rng.normal(size=(8, 1)).astype("float32")
    y = (x @ w + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    return x, y


def dense_model(keras, hidden: int = 16):
    init = keras.initializers.GlorotUniform
    return keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(hidden, activation="tanh", kernel_initializer=init(seed=1), name="h"),
        keras.layers.Dense(1, kernel_initializer=init(seed=2), name="out"),
    ])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("scenario", help="one or more (comma-separated) of: sgd, cnn, mismatch, die, accum, save; "
                                    "SCENARIO-fp16 or -bf16: with that compression on the wire")
    p.add_argument("out")
    p.add_argument("--reference", action="store_true", help="single device, no Horovod")
    p.add_argument("--compression", default=None)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--local-devices", type=int, default=1)
    p.add_argument("--dataset", default="mnist")
    args = p.parse_args()

    scenarios = args.scenario.split(",")
    unknown = ({s.partition("-")[0] for s in scenarios} - {"sgd", "cnn", "mismatch", "die", "accum", "save"}
               | {s.partition("-")[2] for s in scenarios} - {"", "fp16", "bf16"})
    if unknown:
        p.error(f"unknown scenario(s) {sorted(unknown)}")
    for scenario in scenarios:
        out = args.out if len(scenarios) == 1 else os.path.join(args.out, scenario)
        code = run(scenario, args, out)
        if code:
            return code
    return 0


def run(scenario: str, args: argparse.Namespace, out: str) -> int:
    import keras
    import tensorflow as tf

    import tfdist

    scenario, _, wire = scenario.partition("-")  # "cnn-fp16": the cnn scenario with float16 on the wire
    if args.reference:
        strategy, rank, size = tf.distribute.get_strategy(), 0, 1
    else:
        devices = tfdist.devices.virtual_cpus(args.local_devices) if args.local_devices > 1 else None
        strategy = tfdist.HorovodStrategy(local_devices=devices, compression=wire or args.compression)
        rank, size = strategy.rank, strategy.size
    os.makedirs(out, exist_ok=True)
    record: dict = {"rank": rank, "size": size, "replicas": strategy.num_replicas_in_sync,
                    "compression": getattr(strategy, "compression", None)}

    if scenario == "save":
        # Keras 3 save/load and predict under the strategy; rank 0 alone writes (the usual pattern).
        x, y = regression_data()
        with strategy.scope():
            model = dense_model(keras)
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
        record["predict_rows"] = int(model.predict(x[:64], batch_size=32, verbose=0).shape[0])
        if rank == 0:
            path = os.path.join(out, "model.keras")
            model.save(path)
            loaded = keras.models.load_model(path)
            record["reload_max_diff"] = max(float(np.abs(a - b).max())
                                            for a, b in zip(model.get_weights(), loaded.get_weights()))
            record["reload_optimizer_iterations"] = int(loaded.optimizer.iterations.numpy())
    elif scenario in ("sgd", "accum", "die"):
        x, y = regression_data()
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch)
        accum = 2 if scenario == "accum" else None
        with strategy.scope():
            model = dense_model(keras)
            model.compile(optimizer=keras.optimizers.SGD(0.05, gradient_accumulation_steps=accum),
                          loss="mse", metrics=["mae"])
        if scenario == "die":
            class Die(keras.callbacks.Callback):
                def on_train_batch_end(self, batch, logs=None):
                    if rank == 1 and batch == 3:
                        print("rank 1 dies now", flush=True)
                        os._exit(3)
            record["start"] = time.time()
            model.fit(ds.repeat(), epochs=1000, steps_per_epoch=8, verbose=0, callbacks=[Die()])
            return 0
        history = model.fit(ds, epochs=args.epochs, verbose=0, shuffle=False)
        record["history"] = {k: [float(v) for v in vs] for k, vs in history.history.items()}
        record["evaluate"] = [float(v) for v in model.evaluate(ds, verbose=0)]
    elif scenario == "cnn":
        data = tfdist.data.load(args.dataset, global_batch_size=args.batch, strategy=strategy, seed=0)
        with strategy.scope():
            model = tfdist.models.cnn(data.arrays.input_shape, data.arrays.num_classes, seed=0)
            model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy",
                          metrics=["accuracy"])
        history = model.fit(data.train, epochs=args.epochs, verbose=0)
        record["history"] = {k: [float(v) for v in vs] for k, vs in history.history.items()}
        record["evaluate"] = [float(v) for v in model.evaluate(data.test, verbose=0)]
    elif scenario == "mismatch":
        with strategy.scope():
            model = dense_model(keras, hidden=16 if rank == 0 else 12)
        return 0
    weights = {f"w{i}": w for i, w in enumerate(model.get_weights())}
    np.savez(os.path.join(out, f"rank{rank}.npz"), **weights)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    print(f"rank {rank}/{size}: done {json.dumps(record)[:300]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
