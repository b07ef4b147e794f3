"""One node of `tfdist bench network-scaling`: a >= 10 M-parameter CNN, data-parallel, every gradient variant in turn.

    tfdist launch -n 4 --link-rate 1gbit -- python -m benchmarks.network_scaling_job --out r.json ...

One `tfdist.MultiWorkerMirroredStrategy` per process; one model per variant (the same seeded weights), each with
its own traced step:

- `plain`: the stock path, one all-reduce of every gradient after the whole backward;
- `buckets`: DDP-style buckets of --bucket-cap-mb, each all-reduced as soon as its gradients exist;
- `fp16`: buckets, each sent as float16 (`tfdist.data_parallel.comm_hooks.fp16_compress`);
- `powersgd`: buckets through PowerSGD of rank --powersgd-rank (`tfdist.data_parallel.powersgd.PowerSGD`).

A variant's bucket size and hook are read when its step is traced (its first `fit`), so the variants share one
strategy: `set_bucket_cap` / `register_comm_hook` before each model's first step. Then --rounds rounds: each
variant (order alternating per round, ABBA) runs one `fit` of 1 + --steps steps; the first step of a fit waits for
the input iterator and is not timed, images/s = steps x global batch / (end of the last step - end of the first).
Last, each variant runs --profile-steps steps under TF's profiler on rank 0 (the other ranks run them unprofiled):
per step, the time rank 0's gradient collectives ran and the share of it that overlapped its backward
(benchmarks.ddp_trace). Rank 0 writes the JSON record (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

VARIANTS = ("plain", "buckets", "fp16", "powersgd")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.network_scaling_job")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--batch-size", type=int, required=True, help="images per node per step")
    p.add_argument("--dense-units", type=int, default=3200, help="width of the CNN's dense layer (3200: 10.1 M)")
    p.add_argument("--steps", type=int, required=True, help="timed steps per variant and round")
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--profile-steps", type=int, default=3, help="profiled steps per variant (0: no trace)")
    p.add_argument("--timeout", type=float, default=300.0, help="MultiWorkerMirroredStrategy(timeout_s=...)")
    p.add_argument("--out", required=True, help="JSON record (written by rank 0)")
    return p.parse_args(argv)


def model_for(dense_units: int, seed: int = 0):
    """The benchmark's CNN: tfdist.models.cnn on 28x28x1 with a wide dense layer (3200 units: 10,088,362 weights)."""
    import tfdist

    return tfdist.models.cnn((28, 28, 1), 10, dense_units=dense_units, seed=seed)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import tfdist

    # First, before TensorFlow initialises (collectives are configured at start-up).
    strategy = tfdist.MultiWorkerMirroredStrategy(timeout_s=args.timeout)
    import keras
    import numpy as np
    import tensorflow as tf

    from benchmarks.ddp_trace import overlap_by_step, profile
    from benchmarks.thread_cpu import seconds_by_group, snapshot
    from tfdist._compat.tf_runtime import executed_partition_devices
    from tfdist.data_parallel.powersgd import PowerSGD

    rank, nodes = tfdist.cluster.rank(strategy), tfdist.cluster.world_size(strategy)
    arrays = tfdist.data.load_arrays("mnist")
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    global_batch = nodes * args.batch_size
    data = (tf.data.Dataset.from_tensor_slices((arrays.x_train, arrays.y_train)).repeat().batch(global_batch)
            .prefetch(tf.data.AUTOTUNE).with_options(options))

    class Clock(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.ends: list[float] = []

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

    variants: dict[str, dict] = {}
    for name in args.variants:
        strategy.set_bucket_cap(None)  # drops the previous variant's buckets and hook
        if name != "plain":
            strategy.set_bucket_cap(args.bucket_cap_mb)
        if name == "fp16":
            strategy.register_comm_hook("fp16")
        elif name == "powersgd":
            strategy.register_comm_hook(PowerSGD(rank=args.powersgd_rank))
        path = strategy.gradient_path
        with strategy.scope():
            model = model_for(args.dense_units)
            model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
        # The first fit traces the step (reading the bucket size and hook set above) and records where TF ran
        # each op, which the profiled steps need to tell rank 0's ops.
        device_of = executed_partition_devices(lambda m=model: m.fit(data, epochs=1, steps_per_epoch=2, verbose=0))
        gradient_bytes = sum(int(np.prod(w.shape)) * 4 for w in model.trainable_weights)
        variants[name] = {
            "model": model, "device_of": device_of, "seconds": [], "thread_cpu_s": {}, "fit_steps": 0,
            "buckets": None if path is None else len(path.buckets),
            "gradient_bytes": gradient_bytes if path is None else path.gradient_bytes,
            "sent_bytes": gradient_bytes if path is None else path.wire_bytes,
        }
    for r in range(args.rounds):
        for name in args.variants if r % 2 == 0 else list(reversed(args.variants)):
            clock, v = Clock(), variants[name]
            before = snapshot()
            v["model"].fit(data, epochs=1, steps_per_epoch=1 + args.steps, verbose=0, callbacks=[clock])
            for group, seconds in seconds_by_group(before, snapshot()).items():
                v["thread_cpu_s"][group] = v["thread_cpu_s"].get(group, 0.0) + seconds
            v["fit_steps"] += 1 + args.steps
            v["seconds"].append(clock.ends[-1] - clock.ends[0])
    for name in args.variants:
        v = variants[name]
        run = (lambda callbacks=(), m=v["model"]: m.fit(data, epochs=1, steps_per_epoch=1 + args.profile_steps, verbose=0,
                                                     callbacks=list(callbacks)))
        if args.profile_steps < 1:
            v["trace"] = None
        elif rank == 0:
            # steps 1.. of the fit: the first waits for the iterator
            steps = overlap_by_step(profile(run, steps=args.profile_steps), v["device_of"], v["model"].optimizer.name)
            comm = [sum(d.comm_ms for d in s.values()) for s in steps]
            hidden = [sum(d.hidden_ms for d in s.values()) for s in steps]
            v["trace"] = {"steps": len(steps), "comm_ms": statistics.median(comm) if comm else None,
                          "hidden_ms": statistics.median(hidden) if hidden else None,
                          "hidden_fraction": statistics.median(h / c if c else 0.0 for h, c in zip(hidden, comm))
                          if comm else None}
        else:
            run()
    if rank != 0:
        return 0
    record = {
        "nodes": nodes, "batch_per_node": args.batch_size, "global_batch": global_batch, "steps": args.steps,
        "rounds": args.rounds, "parameters": int(sum(np.prod(w.shape) for w in variants[args.variants[0]]
                                                      ["model"].trainable_weights)),
        "variants": {name: {
            "images_per_sec": [args.steps * global_batch / s for s in v["seconds"]],
            "step_ms": [1000 * s / args.steps for s in v["seconds"]],
            "buckets": v["buckets"], "gradient_bytes": v["gradient_bytes"], "sent_bytes": v["sent_bytes"],
            "trace": v["trace"],
            # what this node's CPU went to per step, by thread group (gRPC's I/O threads vs the compute pools)
            "thread_cpu_s_per_step": {g: s / v["fit_steps"] for g, s in v["thread_cpu_s"].items()},
        } for name, v in variants.items()},
    }
    with open(args.out, "w") as f:
        json.dump(record, f)
    print(f"network-scaling job: {nodes} node(s) done", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
