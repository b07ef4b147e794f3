"""`tfdist bench zero`: ZeRO-0/1/2 per-replica memory (measured vs formula), peak RSS and step time."""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile

from tfdist.bench.models import mlp, mlp_data

NAME = "zero"
HELP = "ZeRO stages 0/1/2: per-replica bytes vs formula, peak RSS per stage, step time ratios"
STAGES = (0, 1, 2)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=4, help="logical devices (GPUs if present, else CPUs)")
    p.add_argument("--width", type=int, default=4096, help="hidden width of the MLP used for memory (4096: 25.2M params)")
    p.add_argument("--batch-size", type=int, default=256, help="global batch size for the step-time CNN")
    p.add_argument("--steps", type=int, default=20, help="timed steps per block (CNN)")
    p.add_argument("--rounds", type=int, default=6, help="interleaved blocks per stage (CNN)")
    p.add_argument("--big-steps", type=int, default=4, help="timed steps per block on the big MLP (0: skip)")
    p.add_argument("--big-rounds", type=int, default=3, help="interleaved blocks per stage on the big MLP")
    p.add_argument("--no-rss", action="store_true", help="skip the peak-RSS subprocesses")
    p.add_argument("--processes", type=int, default=1,
                   help="> 1: run each stage as that many real processes (peak RSS per process, step time)")
    p.add_argument("--backend", default="horovod", choices=("horovod", "tf"),
                   help="with --processes: launcher backend (horovod: HorovodStrategy; tf: MultiWorkerMirroredStrategy)")
    p.add_argument("--proc-steps", type=int, default=10, help="with --processes: timed steps per stage")
    p.add_argument("--proc-batch-size", type=int, default=64, help="with --processes: global batch size")
    p.add_argument("--json", default="bench_zero.json", help="where to write the JSON record")
    p.add_argument("--png", default="bench_zero.png", help="where to write the figure ('' to skip)")


def _rss_worker(argv: list[str]) -> int:
    """One stage in a fresh process, so that the process's peak RSS is that stage's alone: trains the
    MLP on `--replicas` logical CPUs and writes the peak RSS and memory report to `--json`."""
    p = argparse.ArgumentParser()
    for name in ("--stage", "--replicas", "--width"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--json", required=True)
    a = p.parse_args(argv)
    import tfdist
    from tfdist.bench.memory import resident_bytes

    tfdist.devices.virtual_cpus(a.replicas)
    strategy = tfdist.MirroredStrategy(zero_stage=a.stage)
    x, y = mlp_data(64)
    with strategy.scope():
        model = mlp(a.width)
        model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=64, epochs=3, verbose=0)
    report = strategy.memory_report(model)
    with open(a.json, "w") as f:
        json.dump({"peak_rss_bytes": resident_bytes()["peak"], "report": report.to_dict()}, f)
    return 0


def measure_rss(stage: int, replicas: int, width: int) -> dict:
    """Peak RSS and memory report of one stage, from a process of its own (see _rss_worker)."""
    from tfdist.bench.processes import module_command, run_workers

    with tempfile.TemporaryDirectory(prefix="tfdist-bench-zero-") as tmp:
        path = os.path.join(tmp, "rss.json")
        log = io.StringIO()
        cmd = module_command("tfdist.bench.zero", stage=stage, replicas=replicas, width=width, json=path)
        # One process under the launcher ("tf": a 1-worker TF_CONFIG, which MirroredStrategy ignores).
        code = run_workers(cmd, 1, launcher="tf", out=log)
        if code != 0 or not os.path.exists(path):
            raise RuntimeError(f"RSS child for stage {stage} failed (exit code {code}):\n{log.getvalue()[-3000:]}")
        with open(path) as f:
            return json.load(f)


def _memory_in_process(replicas: int, width: int) -> dict:
    """Per-replica bytes of each stage on the big MLP, read from where the variables live."""
    import gc

    import keras

    import tfdist
    from tfdist.strategies.factory import local_replica_devices

    x, y = mlp_data(64)
    out = {}
    for stage in STAGES:
        strategy = tfdist.MirroredStrategy(local_replica_devices(replicas), zero_stage=stage)
        with strategy.scope():
            model = mlp(width)
            model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
        model.fit(x, y, batch_size=64, epochs=1, verbose=0)
        report = strategy.memory_report(model)
        print(report, "\n")
        out[stage] = report
        del model, strategy
        gc.collect()
    return out


def _time_stages(make_model, loss, data, replicas: int, steps: int, rounds: int, batch_size: int | None) -> dict:
    import keras

    import tfdist
    from tfdist.bench.common import StepTimer, interleaved, median_ms
    from tfdist.strategies.factory import local_replica_devices

    blocks = {}
    for stage in STAGES:
        strategy = tfdist.MirroredStrategy(local_replica_devices(replicas), zero_stage=stage)
        with strategy.scope():
            model = make_model()
            model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
        timer = StepTimer()

        def fit(n, model=model, timer=timer):
            if batch_size is None:
                model.fit(data, epochs=1, steps_per_epoch=n, verbose=0, callbacks=[timer])
            else:
                x, y = data
                model.fit(x, y, batch_size=batch_size, epochs=1, steps_per_epoch=n, verbose=0, callbacks=[timer])

        blocks[stage] = (timer, fit)
    for _, fit in blocks.values():
        fit(3)  # trace and warm up
    for timer, _ in blocks.values():
        timer.step_seconds.clear()
    interleaved({s: (lambda fit=fit: fit(steps + 1)) for s, (_, fit) in blocks.items()}, rounds)
    result = {s: {"median_step_ms": median_ms(t.step_seconds), "steps_timed": len(t.step_seconds)}
              for s, (t, _) in blocks.items()}
    for s in STAGES:
        result[s]["ratio_to_stage0"] = result[s]["median_step_ms"] / result[0]["median_step_ms"]
    return result


def run(args: argparse.Namespace) -> int:
    import tfdist
    from tfdist.bench.common import machine, write_json

    if args.processes > 1:  # real processes: one launch per stage (tfdist.bench.zero_procs)
        from tfdist.bench import zero_procs

        record = {"benchmark": NAME, "mode": "processes", "optimizer": "Adam",
                  "memory_model": f"mlp width {args.width}", **zero_procs.run_processes(args),
                  "target_step_ratio_max": 1.10, "machine": machine()}
        write_json(args.json, record)
        if args.png:
            zero_procs.plot(record, args.png)
        return 0
    from tfdist.strategies.factory import local_replica_devices

    local_replica_devices(args.replicas)  # sets up logical CPUs before TF initialises
    rss = {}
    if not args.no_rss:  # first, while this process is small (children are forked from it)
        for stage in STAGES:
            rss[stage] = measure_rss(stage, args.replicas, args.width)["peak_rss_bytes"]
            print(f"stage {stage}: peak RSS of a {args.replicas}-replica process {rss[stage] / 2**20:8.1f} MiB")
    memory = _memory_in_process(args.replicas, args.width)
    checks = {}
    for stage, rep in memory.items():
        f = rep.formula
        state = rep.max_over_replicas("optimizer_state")
        grads = rep.max_over_replicas("gradients")
        checks[stage] = {
            "optimizer_state_bytes_max": state, "formula_optimizer_state": f["optimizer_state"],
            "optimizer_state_ok": state <= 1.01 * f["optimizer_state"],
            "gradient_bytes_max": grads, "formula_gradients": f["gradients"],
            "gradients_ok": grads <= 1.01 * f["gradients"],
            "shard_buffer_bytes_max": rep.max_over_replicas("shard_buffer"),
        }

    data = tfdist.data.mnist(global_batch_size=args.batch_size, num_replicas=args.replicas)
    cnn_times = _time_stages(lambda: tfdist.models.cnn(data.arrays.input_shape, data.arrays.num_classes, seed=0),
                             "sparse_categorical_crossentropy", data.train.repeat(), args.replicas,
                             args.steps, args.rounds, None)
    big_times = None
    if args.big_steps:
        big_times = _time_stages(lambda: mlp(args.width), "mse", mlp_data(256), args.replicas,
                                 args.big_steps, args.big_rounds, 64)

    n = memory[0].num_params
    print(f"\n{'stage':6s} {'opt state/replica':>18s} {'formula':>10s} {'grads/replica':>14s} {'formula':>10s}  MiB")
    for s, c in checks.items():
        print(f"ZeRO-{s} {c['optimizer_state_bytes_max'] / 2**20:18.2f} {c['formula_optimizer_state'] / 2**20:10.2f} "
              f"{c['gradient_bytes_max'] / 2**20:14.2f} {c['formula_gradients'] / 2**20:10.2f}  "
              f"{'PASS' if c['optimizer_state_ok'] and c['gradients_ok'] else 'MISS'} (<= formula + 1%)")
    if rss:
        theory = 8 * n * (args.replicas - 1)  # Adam state no longer replicated on N-1 of N replicas
        for s in (1, 2):
            saved = rss[0] - rss[s]
            extra = 4 * n * (args.replicas - 1) if s == 2 else 0
            print(f"peak RSS stage {s} vs 0: saved {saved / 2**20:8.1f} MiB of a theoretical "
                  f"{(theory + extra) / 2**20:8.1f} MiB (one process holding all {args.replicas} replicas)")
    for label, times in (("CNN", cnn_times), (f"MLP {n / 1e6:.1f}M", big_times)):
        if times:
            print(f"step time {label}: " + ", ".join(
                f"ZeRO-{s} {t['median_step_ms']:.1f} ms (x{t['ratio_to_stage0']:.3f})" for s, t in times.items()))
    record = {
        "benchmark": NAME, "replicas": args.replicas, "devices": local_replica_devices(args.replicas),
        "memory_model": f"mlp width {args.width}", "num_params": n, "optimizer": "Adam",
        "memory": {s: rep.to_dict() for s, rep in memory.items()}, "checks": checks,
        "peak_rss_bytes": rss, "step_time_cnn": cnn_times, "step_time_mlp": big_times,
        "target_step_ratio_max": 1.10, "machine": machine(),
        "notes": "in-process: all replicas share one process, so RSS covers all of them; "
                 "gradients in the report are the reduced gradient each replica keeps after the reduction",
    }
    write_json(args.json, record)
    if args.png:
        plot(record, args.png)
    return 0


def plot(record: dict, path: str) -> None:
    from tfdist.bench.common import save_figure
    from tfdist.plots import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    stages = [int(s) for s in record["memory"]]
    parts = [("params", "parameters"), ("gradients", "gradients kept"), ("optimizer_state", "optimizer state"),
             ("shard_buffer", "param shard buffer")]
    bottom = [0.0] * len(stages)
    for key, label in parts:
        vals = [max((r[key] or 0) for r in record["memory"][s]["rows"]) / 2**20 for s in record["memory"]]
        ax.bar([f"ZeRO-{s}" for s in stages], vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    formula = [record["memory"][s]["formula"]["total"] / 2**20 for s in record["memory"]]
    ax.scatter([f"ZeRO-{s}" for s in stages], formula, color="black", marker="_", s=900, zorder=3,
               label="formula 16Ψ / 8Ψ+8Ψ/N / 4Ψ+12Ψ/N")
    ax.set_ylabel("MiB per replica (measured)")
    ax.set_title(f"{record['num_params'] / 1e6:.1f}M params, Adam, {record['replicas']} replicas")
    ax.legend(fontsize=7)
    ax = axes[1]
    for i, (label, key) in enumerate((("CNN", "step_time_cnn"), ("MLP", "step_time_mlp"))):
        times = record.get(key)
        if not times:
            continue
        xs = [j + 0.4 * i for j in range(len(times))]
        ax.bar(xs, [t["ratio_to_stage0"] for t in times.values()], width=0.4, label=label)
    ax.axhline(1.10, color="red", linestyle="--", label="target 1.10")
    ax.set_xticks([j + 0.2 for j in range(3)], [f"ZeRO-{s}" for s in STAGES])
    ax.set_ylabel("median step time / stage 0")
    ax.legend(fontsize=7)
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(_rss_worker(sys.argv[1:]))
