"""`tfdist bench zero`: ZeRO-0/1/2/3 per-replica memory (measured vs formula), peak memory and step time."""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile

from benchmarks.models import mlp, mlp_data

NAME = "zero"
HELP = "ZeRO stages 0/1/2/3: per-replica bytes vs formula, peak memory per stage, step time ratios"
STAGES = (0, 1, 2, 3)
PREFETCH = "3_prefetch"  # the step-time key of stage 3 with fsdp_prefetch=True (stage 3's own key: without)
STEP_TARGET = {0: 1.10, 1: 1.10, 2: 1.10, 3: 1.25, PREFETCH: 1.25}  # max median step time / stage 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stages", type=int, nargs="+", default=list(STAGES), choices=STAGES, metavar="STAGE",
                   help=f"ZeRO stages to measure, of {{{', '.join(map(str, STAGES))}}} (stage 0 is always "
                        "measured: the ratios are to it; 3 also times stage 3 with fsdp_prefetch)")
    p.add_argument("--replicas", type=int, default=4, help="logical devices (GPUs if present, else CPUs)")
    p.add_argument("--width", type=int, default=4096, help="hidden width of the MLP used for memory (4096: 25.2M params)")
    p.add_argument("--batch-size", type=int, default=256, help="global batch size for the step-time CNN")
    p.add_argument("--steps", type=int, default=20, help="timed steps per block (CNN)")
    p.add_argument("--rounds", type=int, default=6, help="interleaved blocks per stage (CNN); median of >= 5 judged")
    p.add_argument("--big-steps", type=int, default=4, help="timed steps per block on the big MLP (0: skip)")
    p.add_argument("--big-rounds", type=int, default=5, help="interleaved blocks per stage on the big MLP")
    p.add_argument("--no-rss", action="store_true", help="skip the peak-RSS subprocesses")
    p.add_argument("--processes", type=int, default=1,
                   help="> 1: run each stage as that many real processes (peak RSS per process, step time)")
    p.add_argument("--backend", default="horovod", choices=("horovod", "tf"),
                   help="with --processes: launcher backend (horovod: HorovodStrategy; tf: MultiWorkerMirroredStrategy)")
    p.add_argument("--proc-steps", type=int, default=10, help="with --processes: timed steps per stage")
    p.add_argument("--proc-rounds", type=int, default=5,
                   help="with --processes: interleaved rounds of step-time launches (median of the per-round ratios)")
    p.add_argument("--proc-batch-size", type=int, default=64, help="with --processes: global batch size")
    p.add_argument("--json", default="bench_zero.json", help="where to write the JSON record")
    p.add_argument("--png", default="bench_zero.png", help="where to write the figure ('' to skip)")


def _rss_worker(argv: list[str]) -> int:
    """One stage in a fresh process, so that the process's peak RSS is that stage's alone: trains the
    MLP on `--replicas` logical CPUs and writes the peak RSS, TF's CPU allocator step peak and the memory
    report to `--json`."""
    p = argparse.ArgumentParser()
    for name in ("--stage", "--replicas", "--width"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--json", required=True)
    a = p.parse_args(argv)
    import tfdist
    from benchmarks.memory import resident_bytes, tf_allocator_bytes

    tfdist.devices.virtual_cpus(a.replicas)
    strategy = tfdist.MirroredStrategy(zero_stage=a.stage)
    x, y = mlp_data(64)
    with strategy.scope():
        model = mlp(a.width)
        model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=64, epochs=1, verbose=0)  # traces the step, builds (and at stage 3 cuts) the state
    tf_allocator_bytes(reset=True)  # from here the allocator's peak is the steady steps', not the build's
    model.fit(x, y, batch_size=64, epochs=2, verbose=0)
    allocator = tf_allocator_bytes()
    report = strategy.memory_report(model)
    with open(a.json, "w") as f:
        json.dump({"peak_rss_bytes": resident_bytes()["peak"],
                   "tf_allocator_step_peak_bytes": allocator["peak"] if allocator else None,
                   "report": report.to_dict()}, f)
    return 0


def measure_rss(stage: int, replicas: int, width: int) -> dict:
    """Peak RSS, allocator step peak and memory report of one stage, from a process of its own (see _rss_worker)."""
    from benchmarks.processes import module_command, run_workers

    with tempfile.TemporaryDirectory(prefix="tfdist-bench-zero-") as tmp:
        path = os.path.join(tmp, "rss.json")
        log = io.StringIO()
        cmd = module_command("benchmarks.zero", stage=stage, replicas=replicas, width=width, json=path)
        # One process under the launcher ("tf": a 1-worker TF_CONFIG, which MirroredStrategy ignores).
        code = run_workers(cmd, 1, launcher="tf", out=log)
        if code != 0 or not os.path.exists(path):
            raise RuntimeError(f"RSS child for stage {stage} failed (exit code {code}):\n{log.getvalue()[-3000:]}")
        with open(path) as f:
            return json.load(f)


def _strategy(replicas: int, stage: int, prefetch: bool = False):
    import tfdist
    from tfdist.strategies.factory import local_replica_devices

    extra = {"fsdp_prefetch": True} if prefetch else {}  # only stage 3 accepts the FSDP options
    return tfdist.MirroredStrategy(local_replica_devices(replicas), zero_stage=stage, **extra)


def _memory_in_process(stages: list[int], replicas: int, width: int) -> dict:
    """Per-replica bytes of each stage on the big MLP, read from where the variables live."""
    import gc

    import keras

    x, y = mlp_data(64)
    out = {}
    for stage in stages:
        strategy = _strategy(replicas, stage)
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


def _check(rep) -> dict:
    """Largest replica's measured bytes per part against the formula. `_ok`: at most 1 % above it (the
    old stage-0/1/2 criterion); `_ratio`: measured / formula, so that a shortfall shows as well."""
    f = rep.formula
    parts = {"param": "params", "gradient": "gradients", "optimizer_state": "optimizer_state"}
    out = {}
    for prefix, part in parts.items():
        measured = rep.max_over_replicas(part)
        out[f"{prefix}_bytes_max"] = measured
        out[f"formula_{part}"] = f[part]
        out[f"{part}_ok"] = measured <= 1.01 * f[part]
        out[f"{part}_ratio"] = measured / f[part] if f[part] else None
    # the formula's total (params + grads + state) of the largest replica; the shard buffer is reported apart
    total = max(r.params + (r.gradients or 0) + r.optimizer_state for r in rep.rows)
    out.update(total_bytes_max=total, formula_total=f["total"], total_ratio=total / f["total"],
               shard_buffer_bytes_max=rep.max_over_replicas("shard_buffer"))
    return out


def _variants(stages: list[int]) -> list[tuple]:
    """(key, stage, prefetch) of each timed configuration: every stage, and stage 3 once more with prefetch."""
    out = [(s, s, False) for s in stages]
    if 3 in stages:
        out.append((PREFETCH, 3, True))
    return out


def _timed_fit(make_model, loss: str, data, strategy, batch_size: int | None):
    """Builds the model under `strategy`; returns fit(n) -> the step seconds of that call (first step dropped)."""
    import keras

    from benchmarks.common import StepTimer

    with strategy.scope():
        model = make_model()
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
    timer = StepTimer()

    def fit(n: int) -> list[float]:
        timer.step_seconds.clear()
        if batch_size is None:
            model.fit(data, epochs=1, steps_per_epoch=n, verbose=0, callbacks=[timer])
        else:
            x, y = data
            model.fit(x, y, batch_size=batch_size, epochs=1, steps_per_epoch=n, verbose=0, callbacks=[timer])
        return list(timer.step_seconds)

    return fit


def _time_stages(make_model, loss: str, data, variants: list[tuple], replicas: int, steps: int, rounds: int,
                 batch_size: int | None) -> dict:
    """Step times of every variant, measured in interleaved rounds (ABBA order, see `interleaved`)."""
    from benchmarks.common import interleaved

    fits = {key: _timed_fit(make_model, loss, data, _strategy(replicas, stage, prefetch), batch_size)
            for key, stage, prefetch in variants}
    for fit in fits.values():
        fit(3)  # trace and warm up
    per_round: dict = {key: [] for key in fits}
    interleaved({key: (lambda key=key: per_round[key].append(fits[key](steps + 1))) for key in fits}, rounds)
    return _summarise(per_round)


def _summarise(per_round: dict) -> dict:
    """Per variant: the median over rounds of each round's median step, and the ratio to stage 0 judged on
    the median of per-round ratios (both halves of a ratio come from the same round, so a slow round on the
    shared machine mostly cancels)."""
    from benchmarks.common import median_ms
    from benchmarks.rounds import spread

    base = [median_ms(r) for r in per_round[0]]
    out = {}
    for key, rounds in per_round.items():
        ms = [median_ms(r) for r in rounds]
        ratios = spread([m / b for m, b in zip(ms, base)])
        out[key] = {"median_step_ms": statistics.median(ms), "step_ms_rounds": spread(ms),
                    "ratio_to_stage0": ratios["median"], "ratio_rounds": ratios,
                    "steps_timed": sum(len(r) for r in rounds), "target_ratio_max": STEP_TARGET[key],
                    "ratio_ok": ratios["median"] <= STEP_TARGET[key]}
    return out


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:10.2f}"


def _print_memory(checks: dict) -> None:
    print(f"\n{'stage':6s} {'params':>10s} {'formula':>10s} {'grads':>10s} {'formula':>10s} {'opt state':>10s} "
          f"{'formula':>10s}  MiB per replica (largest replica)")
    for s, c in checks.items():
        ok = c["params_ok"] and c["gradients_ok"] and c["optimizer_state_ok"]
        print(f"ZeRO-{s} {_mib(c['param_bytes_max'])} {_mib(c['formula_params'])} {_mib(c['gradient_bytes_max'])} "
              f"{_mib(c['formula_gradients'])} {_mib(c['optimizer_state_bytes_max'])} "
              f"{_mib(c['formula_optimizer_state'])}  total x{c['total_ratio']:.4f} of the formula "
              f"{'PASS' if ok else 'MISS'} (<= formula + 1%)")


def _print_peaks(rss: dict, allocator: dict, memory: dict, replicas: int) -> None:
    """Peak RSS saved vs stage 0 against the formula's saving over all replicas (one process holds them all)."""
    for s, peak in rss.items():
        line = f"ZeRO-{s}: peak RSS {peak / 2**20:8.1f} MiB"
        if allocator.get(s) is not None:
            line += f", TF CPU allocator step peak {allocator[s] / 2**20:8.1f} MiB"
        if s and 0 in rss and s in memory:
            theory = replicas * (memory[0].formula["total"] - memory[s].formula["total"])
            line += f"; RSS saved vs ZeRO-0 {(rss[0] - peak) / 2**20:8.1f} of a theoretical {theory / 2**20:8.1f} MiB"
        print(line)


def _print_times(label: str, times: dict | None) -> None:
    from benchmarks.rounds import describe

    if not times:
        return
    print(f"step time {label} (median of per-round medians; ratio: median of per-round ratios):")
    for key, t in times.items():
        verdict = "PASS" if t["ratio_ok"] else "MISS"
        print(f"  ZeRO-{key!s:10s} {describe(t['step_ms_rounds'], '{:.1f}')} ms; / ZeRO-0 "
              f"{describe(t['ratio_rounds'])}  target <= {t['target_ratio_max']:.2f} on the median: {verdict}")


def _run_processes(args: argparse.Namespace) -> int:
    from benchmarks import zero_procs
    from benchmarks.common import machine, write_json

    record = {"benchmark": NAME, "mode": "processes", "optimizer": "Adam",
              "memory_model": f"mlp width {args.width}", **zero_procs.run_processes(args),
              "target_step_ratio_max": 1.10, "machine": machine()}
    write_json(args.json, record)
    if args.png:
        zero_procs.plot(record, args.png)
    return 0


def _peaks(stages: list[int], args: argparse.Namespace) -> tuple[dict, dict]:
    """Per stage, from a fresh process each: peak RSS and TF's CPU allocator peak over steady steps."""
    rss, allocator = {}, {}
    for stage in stages:
        child = measure_rss(stage, args.replicas, args.width)
        rss[stage] = child["peak_rss_bytes"]
        allocator[stage] = child.get("tf_allocator_step_peak_bytes")
        print(f"stage {stage}: peak RSS of a {args.replicas}-replica process {rss[stage] / 2**20:8.1f} MiB")
    return rss, allocator


def _step_times(stages: list[int], args: argparse.Namespace) -> tuple[dict, dict | None]:
    import tfdist

    variants = _variants(stages)
    data = tfdist.data.mnist(global_batch_size=args.batch_size, num_replicas=args.replicas)
    cnn = _time_stages(lambda: tfdist.models.cnn(data.arrays.input_shape, data.arrays.num_classes, seed=0),
                       "sparse_categorical_crossentropy", data.train.repeat(), variants, args.replicas,
                       args.steps, args.rounds, None)
    big = None
    if args.big_steps:
        big = _time_stages(lambda: mlp(args.width), "mse", mlp_data(256), variants, args.replicas,
                           args.big_steps, args.big_rounds, 64)
    return cnn, big


def run(args: argparse.Namespace) -> int:
    from benchmarks.common import machine, write_json
    from tfdist.strategies.factory import local_replica_devices

    if args.processes > 1:  # real processes: one launch per stage (benchmarks.zero_procs)
        return _run_processes(args)
    stages = sorted(set(args.stages) | {0})  # stage 0 is the baseline of every ratio
    local_replica_devices(args.replicas)  # sets up logical CPUs before TF initialises
    # first, while this process is small (children are forked from it)
    rss, allocator = ({}, {}) if args.no_rss else _peaks(stages, args)
    memory = _memory_in_process(stages, args.replicas, args.width)
    checks = {stage: _check(rep) for stage, rep in memory.items()}
    cnn_times, big_times = _step_times(stages, args)
    n = memory[0].num_params
    _print_memory(checks)
    _print_peaks(rss, allocator, memory, args.replicas)
    for label, times in (("CNN", cnn_times), (f"MLP {n / 1e6:.1f}M", big_times)):
        _print_times(label, times)
    record = {
        "benchmark": NAME, "stages": stages, "replicas": args.replicas,
        "devices": local_replica_devices(args.replicas),
        "memory_model": f"mlp width {args.width}", "num_params": n, "optimizer": "Adam",
        "memory": {s: rep.to_dict() for s, rep in memory.items()}, "checks": checks,
        "peak_rss_bytes": rss, "tf_allocator_step_peak_bytes": allocator,
        "step_time_cnn": cnn_times, "step_time_mlp": big_times, "rounds": args.rounds, "big_rounds": args.big_rounds,
        "target_step_ratio_max": 1.10, "target_step_ratio_max_stage3": STEP_TARGET[3], "machine": machine(),
        "notes": "in-process: all replicas share one process, so RSS covers all of them; "
                 "gradients in the report are the reduced gradient each replica keeps after the reduction; "
                 f"'{PREFETCH}': stage 3 with fsdp_prefetch=True (key 3: without)",
    }
    write_json(args.json, record)
    if args.png:
        plot(record, args.png)
    return 0


def _plot_memory(ax, record: dict) -> None:
    stages = list(record["memory"])
    labels = [f"ZeRO-{s}" for s in stages]
    parts = [("params", "parameters"), ("gradients", "gradients kept"), ("optimizer_state", "optimizer state"),
             ("shard_buffer", "param shard buffer")]
    bottom = [0.0] * len(stages)
    for key, label in parts:
        vals = [max((r[key] or 0) for r in record["memory"][s]["rows"]) / 2**20 for s in stages]
        ax.bar(labels, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    formula = [record["memory"][s]["formula"]["total"] / 2**20 for s in stages]
    ax.scatter(labels, formula, color="black", marker="_", s=900, zorder=3,
               label="formula 16Ψ / 8Ψ+8Ψ/N / 4Ψ+12Ψ/N / 16Ψ/N")
    ax.set_ylim(top=1.25 * max(bottom + formula))  # headroom: the legend sits above the tallest bar
    ax.set_ylabel("MiB per replica (measured)")
    ax.set_title(f"{record['num_params'] / 1e6:.1f}M params, Adam, {record['replicas']} replicas")
    ax.legend(fontsize=7)


def _plot_times(ax, record: dict) -> None:
    keys: list = []
    for i, (label, key) in enumerate((("CNN", "step_time_cnn"), ("MLP", "step_time_mlp"))):
        times = record.get(key)
        if not times:
            continue
        keys = list(times)
        xs = [j + 0.4 * i for j in range(len(times))]
        medians = [t["ratio_to_stage0"] for t in times.values()]
        errors = [[m - t["ratio_rounds"]["min"] for m, t in zip(medians, times.values())],
                  [t["ratio_rounds"]["max"] - m for m, t in zip(medians, times.values())]]
        ax.bar(xs, medians, width=0.4, yerr=errors, capsize=3, label=f"{label} (bars: min/max round)")
    ax.axhline(1.10, color="red", linestyle="--", label="target 1.10 (stages 1, 2)")
    ax.axhline(STEP_TARGET[3], color="purple", linestyle=":", label=f"target {STEP_TARGET[3]:.2f} (stage 3)")
    ax.set_xticks([j + 0.2 for j in range(len(keys))], [f"ZeRO-{k}" for k in keys], fontsize=8)
    ax.set_ylabel("median step time / stage 0")
    ax.legend(fontsize=7)


def _plot_peaks(ax, record: dict) -> None:
    rss, alloc = record.get("peak_rss_bytes") or {}, record.get("tf_allocator_step_peak_bytes") or {}
    stages = list(rss)
    xs = range(len(stages))
    ax.bar([x - 0.2 for x in xs], [rss[s] / 2**20 for s in stages], width=0.4, label="peak RSS (process)")
    ax.bar([x + 0.2 for x in xs], [(alloc.get(s) or 0) / 2**20 for s in stages], width=0.4,
           label="TF CPU allocator step peak")
    ax.set_xticks(list(xs), [f"ZeRO-{s}" for s in stages])
    ax.set_ylabel(f"MiB, one process, {record['replicas']} replicas")
    ax.legend(fontsize=7)


def plot(record: dict, path: str) -> None:
    from benchmarks.common import save_figure
    from tfdist.plots import pyplot

    plt = pyplot()
    panels = [_plot_memory, _plot_times] + ([_plot_peaks] if record.get("peak_rss_bytes") else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4))
    for ax, draw in zip(axes, panels):
        draw(ax, record)
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(_rss_worker(sys.argv[1:]))
