"""`tfdist bench tensor-parallel`: per-device weight bytes ÷ replicated, collective bytes per step ÷ Megatron's
formula, and step time at T=2 vs one device, on a Transformer block and an MLP (logical CPUs, one process).

Megatron's formula (Shoeybi et al. 2019, §3): a column/row pair costs one all-reduce of the b×s×h activation in
the forward pass and one in the backward, so a step of P pairs moves 2·P·b·s·h values through all-reduces.
The measured bytes are those of every exchange (all-reduces, gathers, scatters) in the traced step.
"""

from __future__ import annotations

import argparse
import os
import time

from benchmarks.arguments import require_at_least
from tfdist.errors import ConfigError

NAME = "tensor-parallel"
HELP = "tensor parallelism: weight bytes per device vs replicated, collective bytes vs Megatron, step time T=2 vs 1"
BYTES_SLACK = 0.02  # weight bytes of the largest device ÷ replicated must be <= 1/T + 2 %
COMM_TARGET = 1.05  # collective bytes per step ÷ Megatron's formula


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parallel", type=int, nargs="+", default=[2, 4], help="model-axis sizes T for the byte counts")
    p.add_argument("--batch-size", type=int, default=8, help="b")
    p.add_argument("--seq", type=int, default=64, help="s: sequence length of the Transformer block")
    p.add_argument("--hidden", type=int, default=256, help="h: model width (feed-forward 4h, heads of 32)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per round and configuration")
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds (median of >= 5 judged)")
    p.add_argument("--json", default="bench_tensor_parallel.json", help="where to write the JSON record")
    p.add_argument("--png", default="bench_tensor_parallel.png", help="where to write the figure ('' to skip)")


def transformer(h: int, s: int):
    """LayerNorm → MultiHeadAttention (h/32 heads) + residual → LayerNorm → feed-forward 4h + residual → LayerNorm.
    The first LayerNorm has weights, so the attention's input needs its gradient (the backward all-reduce)."""
    import keras

    keras.utils.set_random_seed(1)
    inputs = keras.Input((s, h))
    x = keras.layers.LayerNormalization(name="ln0")(inputs)
    x = keras.layers.LayerNormalization(name="ln1")(x + keras.layers.MultiHeadAttention(h // 32, 32, name="mha")(x, x))
    f = keras.layers.Dense(h, name="ff_down")(keras.layers.Dense(4 * h, activation="relu", name="ff_up")(x))
    return keras.Model(inputs, keras.layers.LayerNormalization(name="ln2")(x + f))


def mlp(h: int):
    """LayerNorm → two Megatron MLP blocks (h → 4h → h)."""
    import keras

    keras.utils.set_random_seed(1)
    inputs = keras.Input((h,))
    x = keras.layers.LayerNormalization(name="ln0")(inputs)
    for i in (1, 2):
        x = keras.layers.Dense(4 * h, activation="relu", name=f"up{i}")(x)
        x = keras.layers.Dense(h, name=f"down{i}")(x)
    return keras.Model(inputs, x)


def _step(strategy, model):
    """One SGD step (strategy.run inside a tf.function), the optimizer built in the scope."""
    import keras
    import tensorflow as tf

    with strategy.scope():
        optimizer = keras.optimizers.SGD(0.01)
        optimizer.build(model.trainable_variables)

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(model(x, training=True) - y))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    return tf.function(lambda x, y: strategy.run(replica_step, args=(x, y)))


def _measure(name: str, build, shape: tuple, parts: int, devices: list[str]) -> tuple[dict, object, object]:
    import numpy as np
    import tensorflow as tf

    import tfdist
    from tfdist.tensor_parallel import collective_bytes, collective_counts

    mesh = tfdist.DeviceMesh((1, parts), ("batch", "model"), devices[:parts])
    strategy = tfdist.ModelParallelStrategy(tfdist.LayoutMap.auto(build(), mesh))
    with strategy.scope():
        model = build()
    report = strategy.memory_report(model)
    pairs = sum(1 for s in strategy.shard_plan(model).layers if s.kind in ("row", "einsum_row"))
    x = tf.constant(np.random.default_rng(0).normal(size=shape).astype("float32"))
    step = _step(strategy, model)
    graph = step.get_concrete_function(x, x).graph
    moved = sum(collective_bytes(graph).values())
    formula = 2 * pairs * int(np.prod(shape)) * 4
    result = {"model": name, "T": parts, "pairs": pairs, "weight_bytes_ratio": report.ratio("params"),
              "weight_target": 1 / parts + BYTES_SLACK, "bytes_per_device": [r.params for r in report.rows],
              "replicated_bytes": report.replicated.params, "collectives": collective_counts(graph),
              "collective_bytes": moved, "megatron_bytes": formula, "comm_ratio": moved / formula}
    return result, step, x


def time_steps(steps: dict, x, n: int, rounds: int) -> dict[str, list[float]]:
    """Median step seconds per round for each configuration (`steps[k](x, x)`), rounds interleaved (ABBA), after
    3 warm-up calls each (tracing, thread pools, allocator)."""
    import statistics

    per_round: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(3):  # trace and warm up (thread pools, allocator) outside the rounds
        for step in steps.values():
            float(step(x, x))
    for r in range(rounds):
        for k in (list(steps) if r % 2 == 0 else list(reversed(steps))):
            times = []
            for _ in range(n):
                start = time.perf_counter()
                float(steps[k](x, x))
                times.append(time.perf_counter() - start)
            per_round[k].append(statistics.median(times))
    return per_round


def run(args: argparse.Namespace) -> int:
    import tensorflow as tf

    import tfdist
    from benchmarks.common import machine, write_json
    from benchmarks.rounds import describe, spread

    require_at_least(args, batch_size=1, seq=1, hidden=32, steps=1, rounds=1)
    if any(t < 1 for t in args.parallel):
        raise ConfigError(f"--parallel: model-axis sizes must be >= 1, got {args.parallel}.")
    devices = tfdist.devices.virtual_cpus(max([2, *args.parallel]))
    b, s, h = args.batch_size, args.seq, args.hidden
    models = {"transformer": (lambda: transformer(h, s), (b, s, h)), "mlp": (lambda: mlp(h), (b, h))}
    results, steps = [], {}
    for name, (build, shape) in models.items():
        for parts in sorted({2, *args.parallel}):
            result, step, x = _measure(name, build, shape, parts, devices)
            results.append(result)
            if name == "transformer" and parts == 2:
                steps["T=2"], x_block = step, x
    one = transformer(h, s)
    steps["one device"] = _step(tf.distribute.get_strategy(), one)
    rounds = time_steps({"one device": steps["one device"], "T=2": steps["T=2"]}, x_block, args.steps, args.rounds)
    ratio = spread([t2 / t1 for t1, t2 in zip(rounds["one device"], rounds["T=2"])])
    ok = True
    print(f"b={b}, s={s}, h={h}; load {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    print(f"{'model':12s} {'T':>2s} {'pairs':>5s} {'weights/repl':>13s} {'target':>7s} {'comm bytes':>11s} "
          f"{'Megatron':>10s} {'ratio':>6s}")
    for r in results:
        good = r["weight_bytes_ratio"] <= r["weight_target"] and r["comm_ratio"] <= COMM_TARGET
        ok &= good
        print(f"{r['model']:12s} {r['T']:>2d} {r['pairs']:>5d} {r['weight_bytes_ratio']:>13.4f} "
              f"{r['weight_target']:>7.4f} {r['collective_bytes']:>11,} {r['megatron_bytes']:>10,} "
              f"{r['comm_ratio']:>6.3f}{'' if good else '  MISSED'}")
    print(f"Transformer block step, T=2 ÷ one device: {describe(ratio)}")
    record = {"benchmark": NAME, "b": b, "s": s, "h": h, "results": results, "step_seconds": rounds,
              "step_ratio_t2_over_one": ratio, "targets": {"weight_slack": BYTES_SLACK, "comm_ratio_max": COMM_TARGET},
              "loadavg": list(os.getloadavg()), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
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
    results = record["results"]
    labels = [f"{r['model']}\nT={r['T']}" for r in results]
    xs = range(len(results))
    left.bar([x - 0.2 for x in xs], [r["weight_bytes_ratio"] for r in results], width=0.4,
             label="largest device's weights ÷ replicated")
    left.bar([x + 0.2 for x in xs], [r["comm_ratio"] for r in results], width=0.4,
             label="collective bytes ÷ Megatron formula")
    left.scatter(list(xs), [r["weight_target"] for r in results], marker="_", s=400, color="k",
                 label="target 1/T + 2 %", zorder=3)
    left.axhline(COMM_TARGET, color="grey", linestyle=":", label=f"comm target {COMM_TARGET}")
    left.set_xticks(list(xs), labels)
    left.set_ylim(0, 1.4)
    left.legend(fontsize=7, loc="upper left", ncol=2)
    q = record["step_ratio_t2_over_one"]
    plot_rounds(right, record, f"Transformer block step: T=2 ÷ 1 = {q['median']:.2f} (min {q['min']:.2f}, "
                               f"max {q['max']:.2f})")
    save_figure(fig, path)


def plot_rounds(ax, record: dict, title: str) -> None:
    """The step-time panel: median ms per step of each configuration, round by round (`record["step_seconds"]`)."""
    for name, seconds in record["step_seconds"].items():
        ax.plot([1000 * t for t in seconds], marker="o", label=name)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(f"round (load {record['loadavg'][0]:.1f})")
    ax.set_ylabel("median ms per step")
    ax.legend(fontsize=7)
