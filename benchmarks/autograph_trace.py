"""`tfdist bench autograph-trace`: the first call of a custom training loop's step (the TensorFlow tutorial's
pattern: `@tf.function def step(...): strategy.run(replica_step, ...)`) with AutoGraph rewriting tfdist's code, as
it did before tfdist exempted itself, and with tfdist exempt, as shipped (`tfdist/_compat/autograph.py`).

Each measurement is a fresh process (AutoGraph caches what it rewrote per process): it builds the strategy and the
model, then times the step's first call (AutoGraph + trace + one run) and the median of the next ones (the run
alone, to show that the graph runs as fast). Modes alternate round by round; medians with their spread.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

NAME = "autograph-trace"
HELP = ("a custom loop's first step with AutoGraph rewriting tfdist's code vs tfdist exempt (as shipped): "
        "seconds to the first step and per step after, on tfdist's strategies")
MODES = ("rewritten", "exempt")
STRATEGIES = ("mirrored-zero2", "mesh-2x2", "mesh-2x2-zero2")
MODULE = "benchmarks.autograph_trace"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=5, help="rounds; each runs every mode and strategy once (default 5)")
    p.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    p.add_argument("--steps", type=int, default=10, help="steps after the first, for the per-step time (default 10)")
    p.add_argument("--json", default="bench_autograph_trace.json", help="where to write the JSON record")
    p.add_argument("--png", default="bench_autograph_trace.png", help="where to write the figure ('' to skip)")
    p.add_argument("--mode", choices=MODES, default=MODES[0], help=argparse.SUPPRESS)  # a worker's mode
    p.add_argument("--strategy", choices=STRATEGIES, default=STRATEGIES[0], help=argparse.SUPPRESS)


def _worker(args: argparse.Namespace) -> None:
    import keras
    import numpy as np
    import tensorflow as tf

    import tfdist

    if args.mode == "rewritten":  # what AutoGraph did before tfdist exempted itself
        from tensorflow.python.autograph.core import config

        import tfdist._compat  # noqa: F401  (adds the exemption when first imported: remove it after)

        config.CONVERSION_RULES = tuple(r for r in config.CONVERSION_RULES if not r.matches("tfdist"))
    devices = tfdist.devices.virtual_cpus(4)
    if args.strategy == "mirrored-zero2":
        strategy = tfdist.MirroredStrategy(devices, zero_stage=2)
    else:
        mesh = tfdist.DeviceMesh((2, 2), ("batch", "model"), devices)
        layout = tfdist.LayoutMap(mesh)
        layout["up.*/kernel"] = (None, "model")
        layout["down.*/kernel"] = ("model", None)
        strategy = tfdist.ModelParallelStrategy(layout, batch_dim_name="batch",
                                                zero_stage=2 if args.strategy.endswith("zero2") else 0)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((32,))
        hidden = inputs
        for i in range(3):
            up = keras.layers.Dense(128, activation="relu", name=f"up{i}")(hidden)
            hidden = keras.layers.Dense(32, name=f"down{i}")(up)
        model = keras.Model(inputs, keras.layers.Dense(10, name="head")(hidden))
        optimizer = keras.optimizers.Adam(1e-3)  # built by its first apply_gradients, as in the tutorial
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64 * (args.steps + 1), 32)).astype("float32"), rng.integers(0, 10, 64 * (args.steps + 1))
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(64))

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True)) / 64
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    @tf.function
    def step(xb, yb):
        return strategy.run(replica_step, args=(xb, yb))

    times = []
    for xb, yb in dataset:
        began = time.perf_counter()
        strategy.experimental_local_results(step(xb, yb))[0].numpy()
        times.append(time.perf_counter() - began)
    print("RESULT " + json.dumps({"first_s": times[0], "step_s": sorted(times[1:])[len(times[1:]) // 2]}), flush=True)


def _measure(mode: str, strategy: str, steps: int) -> dict:
    command = [sys.executable, "-m", MODULE, "--worker", "--mode", mode, "--strategy", strategy, "--steps", str(steps)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} {strategy}: the worker failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1].split(" ", 1)[1])


def _driver(args: argparse.Namespace) -> dict:
    from benchmarks.common import machine, write_json
    from benchmarks.rounds import describe, spread

    runs = {(m, s): [] for m in MODES for s in args.strategies}
    for r in range(args.rounds):
        for mode in MODES if r % 2 == 0 else reversed(MODES):
            for s in args.strategies:
                runs[mode, s].append(_measure(mode, s, args.steps))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    summary = {}
    for s in args.strategies:
        row = {m: {k: spread([x[k] for x in runs[m, s]]) for k in ("first_s", "step_s")} for m in MODES}
        firsts = [a["first_s"] / b["first_s"] for a, b in zip(runs["rewritten", s], runs["exempt", s])]
        row["first_ratio"] = spread(firsts)  # rewritten / exempt, round by round
        summary[s] = row
        print(f"{s}: first step rewritten {describe(row['rewritten']['first_s'], '{:.2f}')} s, exempt "
              f"{describe(row['exempt']['first_s'], '{:.2f}')} s (ratio {describe(row['first_ratio'], '{:.2f}')}); "
              f"per step after: {row['rewritten']['step_s']['median'] * 1e3:.1f} vs "
              f"{row['exempt']['step_s']['median'] * 1e3:.1f} ms", flush=True)
    record = {"benchmark": NAME, "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "rounds": args.rounds, "steps": args.steps, "summary": summary,
              "runs": {f"{m}/{s}": v for (m, s), v in runs.items()}}
    write_json(args.json, record)
    if args.png:
        _plot(summary, args.png)
    return record


def _plot(summary: dict, path: str) -> None:
    from benchmarks.common import save_figure
    from tfdist.plots import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    names = list(summary)
    for i, mode in enumerate(MODES):
        med = [summary[s][mode]["first_s"]["median"] for s in names]
        lo = [med[j] - summary[s][mode]["first_s"]["min"] for j, s in enumerate(names)]
        hi = [summary[s][mode]["first_s"]["max"] - med[j] for j, s in enumerate(names)]
        ax.bar([j + (i - 0.5) * 0.38 for j in range(len(names))], med, 0.38, yerr=[lo, hi], capsize=3, label=mode)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("first step of a custom loop, s")
    ax.set_title("AutoGraph rewriting tfdist's code vs tfdist exempt (median, min-max)")
    ax.legend()
    save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    _driver(args)
    return 0


if __name__ == "__main__":
    from benchmarks.processes import worker_or_driver_main

    sys.exit(worker_or_driver_main(f"python -m {MODULE}", HELP, add_arguments, _worker, run))
