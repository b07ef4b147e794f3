"""`tfdist bench ddp`: how much of the gradient all-reduce runs during the backward, one pack vs buckets (TF's profiler).

One process, `tfdist.MirroredStrategy` over N logical CPUs, the example CNN on MNIST-shaped batches. Per mode (the
stock path: one all-reduce after the whole backward; buckets of --bucket-cap-mb) and round, a few training steps run
under TF's profiler; per step and device, `comm` is the time in which that device's collectives ran and `hidden` the
part of it that overlapped the device's backward ops (benchmarks.ddp_trace). Modes alternate within each round;
the median round is judged. Also the gradient bytes per replica each hook hands to the collectives for one step.
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.rounds import MIN_ROUNDS, describe, spread

NAME = "ddp"
HELP = "share of the gradient all-reduce hidden behind the backward, one pack vs buckets, from TF's profiler"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=2, help="logical CPUs (replicas) of the MirroredStrategy")
    p.add_argument("--bucket-cap-mb", type=float, default=0.1,
                   help="bucket size (the 1.7 MB CNN: 0.1 MB gives 3 buckets; DDP's 25 MB would be one)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=4, help="profiled steps per mode and round")
    p.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    p.add_argument("--json", default="bench_ddp.json")
    p.add_argument("--png", default="bench_ddp.png", help="one step's timeline per mode, one row per device")


def _model_and_data(strategy, batch_size: int, batches: int = 5):
    import keras
    import numpy as np

    import tfdist

    with strategy.scope():
        model = tfdist.models.cnn()
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    arrays = tfdist.data.load_arrays("mnist")
    x = arrays.x_train[: batch_size * batches].astype("float32")
    y = arrays.y_train[: batch_size * batches]
    return model, x, y, np


def _step_figures(step: dict) -> dict:
    comm = sum(d.comm_ms for d in step.values())
    hidden = sum(d.hidden_ms for d in step.values())
    return {"comm_ms": comm, "hidden_ms": hidden, "hidden_fraction": hidden / comm if comm else 0.0,
            "devices": {name: {"backward": d.backward, "collectives": d.collectives,
                               "backward_end_ms": d.backward_end, "first_collective_ms": d.first_collective_start}
                        for name, d in step.items()}}


def _wire_bytes(devices, batch_size: int) -> dict:
    import tfdist
    from tfdist.data_parallel.powersgd import PowerSGD

    out = {}
    for hook in (None, "fp16", "bf16", PowerSGD(rank=4)):
        strategy = tfdist.MirroredStrategy(devices)
        if hook is None:
            strategy.set_bucket_cap(25)
        else:
            strategy.register_comm_hook(hook)
        model, x, y, _ = _model_and_data(strategy, batch_size)
        model.fit(x[:batch_size], y[:batch_size], batch_size=batch_size, epochs=1, verbose=0)
        path = strategy.gradient_path
        out[getattr(hook, "__name__", hook) or "none"] = {
            "gradient_bytes": path.gradient_bytes, "wire_bytes": path.wire_bytes,
            "cut": path.gradient_bytes / path.wire_bytes}
    return out


def run(args: argparse.Namespace) -> int:
    import tfdist
    from benchmarks.common import machine, write_json
    from benchmarks.ddp_trace import overlap_by_step, profile
    from tfdist._compat.tf_runtime import executed_partition_devices
    from tfdist.errors import ConfigError

    if args.replicas < 2 or args.steps < 1 or not args.bucket_cap_mb > 0:
        raise ConfigError("--replicas must be >= 2, --steps >= 1 and --bucket-cap-mb > 0.")
    devices = tfdist.devices.virtual_cpus(args.replicas)[: args.replicas]
    modes = {"one_pack": None, "buckets": args.bucket_cap_mb}
    fits = {}
    for mode, cap in modes.items():
        strategy = tfdist.MirroredStrategy(devices, bucket_cap_mb=cap)
        n = args.batch_size * (1 + args.steps)  # the first step (a new iterator) is not profiled
        model, x, y, _ = _model_and_data(strategy, args.batch_size, 1 + args.steps)
        fit = (lambda callbacks=(), m=model, x=x[:n], y=y[:n]: m.fit(x, y, batch_size=args.batch_size, epochs=1,
                                                                    verbose=0, callbacks=list(callbacks)))
        fits[mode] = (fit, executed_partition_devices(fit), strategy, model.optimizer.name)
    per_round: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(max(1, args.rounds)):
        for mode in (list(modes) if r % 2 == 0 else list(reversed(modes))):
            fit, device_of, _, scope = fits[mode]
            steps = [_step_figures(s) for s in overlap_by_step(profile(fit, steps=args.steps), device_of, scope)]
            median = sorted(steps, key=lambda s: s["hidden_fraction"])[(len(steps) - 1) // 2]
            per_round[mode].append(median)
    results = {}
    for mode, rounds in per_round.items():
        results[mode] = {
            "hidden_fraction": spread([s["hidden_fraction"] for s in rounds]),
            "comm_ms": spread([s["comm_ms"] for s in rounds]),
            "hidden_ms": spread([s["hidden_ms"] for s in rounds]),
            "buckets": None if modes[mode] is None else [list(b) for b in fits[mode][2].gradient_path.buckets],
            "example_step": sorted(rounds, key=lambda s: s["hidden_fraction"])[(len(rounds) - 1) // 2],
        }
        print(f"{mode:9s} share of all-reduce time hidden behind the backward: {describe(results[mode]['hidden_fraction'])}"
              f"; all-reduce ms per step (all devices): {statistics.median(s['comm_ms'] for s in rounds):.2f}")
    wire = _wire_bytes(devices, args.batch_size)
    for name, w in wire.items():
        print(f"hook {name:16s} gradient bytes {w['gradient_bytes']:>9d} sent {w['wire_bytes']:>9d}  cut {w['cut']:.1f}x")
    if args.png:
        _plot(results, args.png)
    write_json(args.json, {
        "benchmark": NAME, "replicas": args.replicas, "bucket_cap_mb": args.bucket_cap_mb,
        "global_batch_size": args.batch_size, "steps": args.steps, "rounds": args.rounds, "model": "tfdist.models.cnn",
        "definition": "per step and device: comm = union of the device's collective op intervals, hidden = the part "
        "of it overlapping the device's backward (gradient_tape) op intervals; summed over devices; per round the "
        "median step, over rounds median/min/max; modes alternate within each round",
        "results": results, "wire_bytes": wire, "machine": machine(),
    })
    return 0


def _plot(results: dict, path: str) -> None:
    from tfdist.plots import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(len(results), 1, figsize=(10, 1.6 + 1.2 * len(results) * 2), sharex=True)
    for ax, (mode, r) in zip(axes, results.items()):
        devices = r["example_step"]["devices"]
        for row, (name, d) in enumerate(sorted(devices.items())):
            ax.broken_barh([(a, b - a) for a, b in d["backward"]], (row + 0.05, 0.4), color="0.6",
                           label="backward ops" if row == 0 else None)
            ax.broken_barh([(a, b - a) for a, b in d["collectives"]], (row + 0.5, 0.4), color="tab:red",
                           label="all-reduce" if row == 0 else None)
        ax.set_yticks([i + 0.5 for i in range(len(devices))], [n.split("/")[-1] for n in sorted(devices)])
        frac = r["hidden_fraction"]["median"]
        ax.set_title(f"{mode}: {100 * frac:.0f}% of the all-reduce time overlaps the backward (median of "
                     f"{r['hidden_fraction']['rounds']} rounds)", fontsize=9)
        ax.legend(loc="upper left", fontsize=7)
    axes[-1].set_xlabel("ms from the step's first backward op")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
