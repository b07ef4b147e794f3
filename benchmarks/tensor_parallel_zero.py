"""`tfdist bench tensor-parallel-zero`: ZeRO over the batch axis of ModelParallelStrategy on a 2 x 2 mesh (logical
CPUs, one process): each device's optimizer-state and gradient bytes at stages 1 and 2 ÷ stage 0's (read from the
variables by `memory_report`), and the Adam step time ÷ stage 0 (median of interleaved rounds)."""

from __future__ import annotations

import argparse
import os
import time

from benchmarks.arguments import require_at_least
from benchmarks.tensor_parallel import plot_rounds, time_steps, transformer

NAME = "tensor-parallel-zero"
HELP = "ZeRO over ModelParallelStrategy's batch axis: optimizer bytes per device and step time vs stage 0 (2 x 2 mesh)"
STATE_SLACK = 0.02  # the largest device's optimizer bytes ÷ stage 0's must be <= 1/R + 2 % (R = 2 rows)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=int, default=8, help="b: samples per row and step")
    p.add_argument("--seq", type=int, default=64, help="s: sequence length of the Transformer block")
    p.add_argument("--hidden", type=int, default=256, help="h: model width (feed-forward 4h, heads of 32)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per round and stage")
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds (median of >= 5 judged)")
    p.add_argument("--json", default="bench_tensor_parallel_zero.json", help="where to write the JSON record")
    p.add_argument("--png", default="bench_tensor_parallel_zero.png", help="where to write the figure ('' to skip)")


def _setup(stage: int, h: int, s: int, devices: list[str]):
    """The block split by LayoutMap.auto on a 2 x 2 mesh at `stage`, its Adam step (built in the scope)."""
    import keras
    import tensorflow as tf

    import tfdist

    mesh = tfdist.DeviceMesh((2, 2), ("batch", "model"), devices[:4])
    strategy = tfdist.ModelParallelStrategy(tfdist.LayoutMap.auto(transformer(h, s), mesh), zero_stage=stage)
    with strategy.scope():
        model = transformer(h, s)
        model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")  # memory_report reads model.optimizer
        optimizer = model.optimizer
        optimizer.build(model.trainable_variables)

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(model(x, training=True) - y))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    step = tf.function(lambda x, y: strategy.reduce("SUM", strategy.run(replica_step, args=(x, y)), axis=None))
    return strategy, model, step


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import tensorflow as tf

    import tfdist
    from benchmarks.common import machine, write_json
    from benchmarks.rounds import describe, spread

    require_at_least(args, batch_size=1, seq=1, hidden=32, steps=1, rounds=1)
    devices = tfdist.devices.virtual_cpus(4)
    b, s, h = args.batch_size, args.seq, args.hidden
    x = tf.constant(np.random.default_rng(0).normal(size=(b, s, h)).astype("float32"))  # each row's batch
    setups = {stage: _setup(stage, h, s, devices) for stage in (0, 1, 2)}
    steps = {f"stage {stage}": step for stage, (_, _, step) in setups.items()}
    rounds = time_steps(steps, x, args.steps, args.rounds)  # traces first: stage 2's kept gradients are known
    reports = {stage: strategy.memory_report(model) for stage, (strategy, model, _) in setups.items()}
    base = {r.device: r for r in reports[0].rows}
    memory = {}
    for stage in (1, 2):
        rows, full = reports[stage].rows, base.values()
        memory[stage] = {
            "optimizer_state_ratio": max(r.optimizer_state for r in rows) / max(r.optimizer_state for r in full),
            "gradients_ratio": max(r.gradients for r in rows) / max(r.gradients for r in full),
            "per_device": {r.device: {"optimizer_state": r.optimizer_state, "stage0_optimizer_state":
                                      base[r.device].optimizer_state, "gradients": r.gradients,
                                      "stage0_gradients": base[r.device].gradients} for r in rows}}
    times = {stage: spread([t / t0 for t0, t in zip(rounds["stage 0"], rounds[f"stage {stage}"])]) for stage in (1, 2)}
    target = 1 / 2 + STATE_SLACK
    ok = all(m["optimizer_state_ratio"] <= target for m in memory.values())
    load = os.getloadavg()
    print(f"2 x 2 mesh (2 rows x T = 2), Transformer block b={b} per row, s={s}, h={h}, Adam; "
          f"load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"{'stage':>5s} {'opt state / stage 0':>20s} {'target':>7s} {'grads / stage 0':>16s}  step time / stage 0")
    for stage in (1, 2):
        m = memory[stage]
        good = m["optimizer_state_ratio"] <= target
        print(f"{stage:>5d} {m['optimizer_state_ratio']:>20.4f} {target:>7.3f} {m['gradients_ratio']:>16.4f}  "
              f"{describe(times[stage])}{'' if good else '  MISSED'}")
    record = {"benchmark": NAME, "mesh": [2, 2], "b": b, "s": s, "h": h, "memory": memory, "step_seconds": rounds,
              "step_ratio_over_stage0": times, "targets": {"optimizer_state_ratio_max": target},
              "loadavg": list(load), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": machine(), "passed": ok}
    write_json(args.json, record)
    if args.png:
        plot(record, args.png)
    return 0 if ok else 1


def plot(record: dict, path: str) -> None:
    from benchmarks.common import save_figure
    from tfdist.plots import pyplot

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    stages = sorted(record["memory"], key=int)
    xs = range(len(stages))
    left.bar([x - 0.2 for x in xs], [record["memory"][s]["optimizer_state_ratio"] for s in stages], width=0.4,
             label="largest device's optimizer bytes ÷ stage 0")
    left.bar([x + 0.2 for x in xs], [record["memory"][s]["gradients_ratio"] for s in stages], width=0.4,
             label="largest device's gradient bytes ÷ stage 0")
    left.axhline(record["targets"]["optimizer_state_ratio_max"], color="k", linestyle=":", label="target 1/R + 2 %")
    left.set_xticks(list(xs), [f"stage {s}" for s in stages])
    left.set_ylim(0, 1.2)
    left.legend(fontsize=7)
    plot_rounds(right, record, "Adam step, 2 x 2 mesh: " + ", ".join(
        f"stage {s} ÷ 0 = {record['step_ratio_over_stage0'][s]['median']:.2f}" for s in stages))
    save_figure(fig, path)
