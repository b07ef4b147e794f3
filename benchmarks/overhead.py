"""`tfdist bench overhead`: step time of tfdist.MirroredStrategy vs stock MirroredStrategy, same devices."""

from __future__ import annotations

import argparse

NAME = "overhead"
HELP = "median step time, tfdist.MirroredStrategy vs stock tf.distribute.MirroredStrategy"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=4, help="logical devices (GPUs if present, else CPUs)")
    p.add_argument("--batch-size", type=int, default=256, help="global batch size")
    p.add_argument("--steps", type=int, default=20, help="timed steps per block")
    p.add_argument("--rounds", type=int, default=10, help="interleaved blocks per strategy")
    p.add_argument("--json", default="bench_overhead.json", help="where to write the JSON record")


def _train_block(strategy, data, seed: int):
    import keras

    import tfdist
    from benchmarks.common import StepTimer

    with strategy.scope():
        model = tfdist.models.cnn(data.arrays.input_shape, data.arrays.num_classes, seed=seed)
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    timer = StepTimer()
    train = data.train.repeat()
    return timer, lambda steps: model.fit(train, epochs=1, steps_per_epoch=steps, shuffle=False, verbose=0,
                                          callbacks=[timer])


def run(args: argparse.Namespace) -> int:
    import tensorflow as tf

    import tfdist
    from benchmarks.common import interleaved, machine, median_ms, write_json
    from tfdist.strategies.factory import local_replica_devices

    devices = local_replica_devices(args.replicas)
    strategies = {
        "tfdist.MirroredStrategy": tfdist.MirroredStrategy(devices),
        "tf.distribute.MirroredStrategy": tf.distribute.MirroredStrategy(devices),
    }
    data = tfdist.data.mnist(global_batch_size=args.batch_size, num_replicas=args.replicas)
    blocks = {name: _train_block(s, data, seed=0) for name, s in strategies.items()}
    for _, fit in blocks.values():  # warm-up: trace and compile both before timing
        fit(3)
    for timer, _ in blocks.values():
        timer.step_seconds.clear()
    interleaved({name: (lambda fit=fit: fit(args.steps + 1)) for name, (_, fit) in blocks.items()}, args.rounds)

    result = {name: {"median_step_ms": median_ms(t.step_seconds), "steps_timed": len(t.step_seconds)}
              for name, (t, _) in blocks.items()}
    ours, stock = (result[n]["median_step_ms"] for n in strategies)
    ratio = ours / stock
    print(f"{'strategy':34s} {'median step':>12s}  steps")
    for name, r in result.items():
        print(f"{name:34s} {r['median_step_ms']:9.2f} ms  {r['steps_timed']:5d}")
    print(f"ratio tfdist / stock = {ratio:.3f} (target <= 1.03): {'PASS' if ratio <= 1.03 else 'MISS'}")
    write_json(args.json, {
        "benchmark": NAME, "replicas": args.replicas, "devices": devices, "global_batch_size": args.batch_size,
        "steps_per_block": args.steps, "rounds": args.rounds, "model": "tfdist.models.cnn", "dataset": "mnist",
        "results": result, "ratio": ratio, "target_ratio_max": 1.03, "machine": machine(),
    })
    return 0
