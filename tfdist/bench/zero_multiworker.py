"""`tfdist bench zero-multiworker`: ZeRO 0/1/2 under MultiWorkerMirroredStrategy — peak RSS, step time, save time."""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import resource
import sys
import tempfile
import time

NAME = "zero-multiworker"
HELP = ("ZeRO stage 0/1/2 on N worker processes (tfdist.MultiWorkerMirroredStrategy): peak RSS per process, "
        "median step time and save time of a large MLP with Adam")

_INPUT = 512  # input features of the MLP
_CLASSES = 10


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--devices-per-worker", type=int, default=1, help="replicas per worker (default 1)")
    p.add_argument("--params", type=float, default=25e6, help="MLP parameters, approximately (default 25e6)")
    p.add_argument("--batch-size", type=int, default=64, help="global batch size (default 64)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per stage, after 2 warm-up steps (default 8)")
    p.add_argument("--stages", default="0,1,2", help="comma-separated ZeRO stages (default 0,1,2)")
    p.add_argument("--json", default="bench_zero_multiworker.json", help="where to write the JSON record")
    p.add_argument("--plot", default="bench_zero_multiworker.png", help="bar chart of peak RSS per stage ('' = none)")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: stage,output-dir of one worker process


def _hidden(params: float) -> int:
    # MLP 512 -> h -> h -> h -> 10: about 512h + 2h^2 + 10h parameters
    return int((-(_INPUT + _CLASSES) + math.sqrt((_INPUT + _CLASSES) ** 2 + 8 * params)) / 4)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _worker(args: argparse.Namespace) -> int:
    stage, out = args.worker.split(",", 1)
    import tfdist

    strategy = tfdist.MultiWorkerMirroredStrategy(zero_stage=int(stage), timeout_s=300)
    import keras
    import numpy as np
    import tensorflow as tf

    from tfdist.bench.common import StepTimer

    rank = tfdist.cluster.rank(strategy)
    rss_start = _rss_mb()  # TensorFlow and the cluster are up, no model yet
    h = _hidden(args.params)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4 * args.batch_size, _INPUT)).astype("float32")
    y = rng.integers(0, _CLASSES, 4 * args.batch_size)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch_size).repeat().with_options(options)
    with strategy.scope():
        model = keras.Sequential([keras.Input((_INPUT,)), keras.layers.Dense(h, activation="relu"),
                                  keras.layers.Dense(h, activation="relu"), keras.layers.Dense(h, activation="relu"),
                                  keras.layers.Dense(_CLASSES)])
        model.compile(optimizer=keras.optimizers.Adam(1e-4), loss=keras.losses.SparseCategoricalCrossentropy(True))
    timer = StepTimer()
    model.fit(data, epochs=1, steps_per_epoch=args.steps + 2, verbose=0, callbacks=[timer])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    steps = sorted(timer.step_seconds[1:])  # the first timed step still warms up
    report = strategy.memory_report(model)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:  # every worker takes part; the chief writes
        tfdist.cluster.save_model(model, os.path.join(tmp, "model.keras"))
    save_s = time.perf_counter() - start
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "stage": int(stage), "params": int(model.count_params()), "hidden": h,
                   "replicas": strategy.num_replicas_in_sync, "rss_start_mb": rss_start, "peak_rss_mb": peak,
                   "median_step_ms": 1000 * steps[len(steps) // 2], "save_s": save_s,
                   "memory_report": report.to_dict()}, f)
    return 0


def _launch(args: argparse.Namespace, stage: int, out: str) -> list[dict]:
    from tfdist.cluster.launcher import launch

    log = io.StringIO()
    cmd = [sys.executable, "-m", "tfdist.bench.zero_multiworker", "--worker", f"{stage},{out}",
           "--params", str(args.params), "--batch-size", str(args.batch_size), "--steps", str(args.steps)]
    rc = launch(cmd, args.workers, devices_per_worker=args.devices_per_worker, out=log, timeout_s=1200,
                env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    if rc != 0:
        raise RuntimeError(f"stage {stage} workers failed (exit {rc}):\n{log.getvalue()[-3000:]}")
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(args.workers)]


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return _worker(args)
    from tfdist.bench.common import write_json

    stages = [int(s) for s in args.stages.split(",")]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for stage in stages:
            out = os.path.join(tmp, f"stage{stage}")
            os.makedirs(out)
            results[stage] = _launch(args, stage, out)
    first = results[stages[0]][0]
    psi, n = first["params"], first["replicas"]
    base = results.get(0)
    print(f"{psi / 1e6:.1f} M parameters (Adam, fp32), {args.workers} workers x {args.devices_per_worker} devices "
          f"= {n} replicas, global batch {args.batch_size}")
    print(f"{'stage':>5s} {'step ms':>9s} {'/stage 0':>8s} {'peak RSS MB':>12s} {'saved MB':>9s} {'theory MB':>9s} "
          f"{'share':>6s} {'opt state B/replica':>20s} {'formula':>10s} {'save s':>7s}")
    rows = []
    for stage in stages:
        ranks = results[stage]
        step = max(r["median_step_ms"] for r in ranks)
        peak = max(r["peak_rss_mb"] for r in ranks)
        state = max(row["optimizer_state"] for r in ranks for row in r["memory_report"]["rows"])
        formula = ranks[0]["memory_report"]["formula"]["optimizer_state"]
        # Theoretical saving per process vs stage 0: (N-1)/N of the 8-byte Adam state (stage >= 1) and of the
        # 4-byte gradients (stage 2), for each of the process's replicas.
        theory = args.devices_per_worker * (n - 1) / n * psi * (8 + (4 if stage == 2 else 0)) / 2**20
        row = {"stage": stage, "median_step_ms": step, "peak_rss_mb": peak, "save_s": max(r["save_s"] for r in ranks),
               "optimizer_state_bytes_per_replica": state, "formula_bytes_per_replica": formula,
               "theoretical_saving_mb": theory if stage else 0.0, "ranks": ranks}
        if base is not None:
            row["step_ratio"] = step / max(r["median_step_ms"] for r in base)
            row["saved_mb"] = max(r["peak_rss_mb"] for r in base) - peak
            row["saving_share"] = row["saved_mb"] / theory if stage else None
        rows.append(row)
        share = f"{row['saving_share']:6.0%}" if row.get("saving_share") is not None else f"{'':6s}"
        print(f"{stage:5d} {step:9.1f} {row.get('step_ratio', float('nan')):8.3f} {peak:12.1f} "
              f"{row.get('saved_mb', float('nan')):9.1f} {row['theoretical_saving_mb']:9.1f} {share} "
              f"{state:20,d} {formula:10,.0f} {row['save_s']:7.2f}")
    print("peak RSS: the larger of the processes' ru_maxrss; 'share' = measured saving / theoretical (N-1)/N saving.")
    write_json(args.json, {"benchmark": NAME, "params": psi, "replicas": n, "workers": args.workers,
                           "devices_per_worker": args.devices_per_worker, "global_batch_size": args.batch_size,
                           "steps": args.steps, "rows": rows})
    if args.plot:
        _plot(rows, args.plot, f"{psi / 1e6:.1f} M params, Adam, {n} replicas on {args.workers} processes")
    return 0


def _plot(rows: list[dict], path: str, title: str) -> None:
    from tfdist.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar([f"stage {r['stage']}" for r in rows], [r["peak_rss_mb"] for r in rows], color="#4c72b0")
    for i, r in enumerate(rows):
        ax.text(i, r["peak_rss_mb"], f"{r['peak_rss_mb']:.0f}", ha="center", va="bottom")
    ax.set_ylabel("peak RSS per process (MB)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tfdist.bench.zero_multiworker", description=HELP)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
