"""`tfdist bench zero --processes N`: peak RSS per process and step time of ZeRO-0/1/2 across real processes."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

STAGES = (0, 1, 2)
# launcher backend -> tfdist strategy name (tfdist.strategies.factory)
STRATEGY_OF_BACKEND = {"horovod": "horovod", "tf": "multiworker"}


def _child(argv: list[str]) -> int:
    """One rank: trains the big MLP with Adam under ZeRO stage S and writes its peak RSS and step times."""
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", required=True)
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--width", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    import tfdist
    from tfdist.bench.common import StepTimer, median_ms
    from tfdist.bench.zero import _mlp_data, mlp

    options = {"zero_stage": a.stage} if a.stage else {}
    strategy = tfdist.strategies.make_strategy(a.strategy, **options)
    rank = tfdist.cluster.rank(strategy)
    x, y = _mlp_data(a.batch_size)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(a.batch_size).repeat()
    with strategy.scope():
        model = mlp(a.width)
        model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    timer = StepTimer()
    with strategy.scope():
        model.optimizer.build(model.trainable_variables)
    with open("/proc/self/status") as f:  # resident set with the model and optimizer state built
        before = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    tf_built = _tf_memory(reset=True)
    model.fit(data, epochs=1, steps_per_epoch=3, verbose=0)  # trace and warm up
    tf_warmup = _tf_memory(reset=True)  # its peak includes tracing and the initial variable sync
    model.fit(data, epochs=1, steps_per_epoch=a.steps + 1, verbose=0, callbacks=[timer])
    report = strategy.memory_report(model) if hasattr(strategy, "memory_report") else None
    with open("/proc/self/status") as f:  # VmHWM: the peak resident set of this process; VmRSS: now
        status = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.startswith("Vm")}
    hwm = status["VmHWM"]
    tf_after = _tf_memory()
    start = time.perf_counter()  # after VmHWM: a save gathers the state, which is not the training peak
    tfdist.cluster.save_model(model, os.path.join(a.out, f"stage{a.stage}.keras"))  # every rank, chief writes
    save_seconds = time.perf_counter() - start
    record = {"rank": rank, "stage": a.stage, "peak_rss_bytes": hwm, "rss_after_bytes": status["VmRSS"],
              "rss_before_fit_bytes": before,
              "tf_step_peak_bytes": tf_after and tf_after["peak"], "tf_warmup_peak_bytes": tf_warmup and tf_warmup["peak"],
              "tf_built_bytes": tf_built and tf_built["current"],
              "median_step_ms": median_ms(timer.step_seconds),
              "save_seconds": save_seconds,
              "steps_timed": len(timer.step_seconds), "replicas": strategy.num_replicas_in_sync,
              "num_params": int(sum(int(v.shape.num_elements()) for v in model.trainable_variables)),
              "report": report.to_dict() if report is not None else None}
    with open(os.path.join(a.out, f"stage{a.stage}_rank{rank}.json"), "w") as f:
        json.dump(record, f)
    tf_line = (f"TF allocator: built {tf_built['current'] / 2**20:.1f}, warm-up peak {tf_warmup['peak'] / 2**20:.1f}, "
               f"step peak {tf_after['peak'] / 2**20:.1f} MiB; " if tf_after else "")
    print(f"rank {rank} stage {a.stage}: {tf_line}peak RSS {hwm / 2**20:.1f} MiB (built {before / 2**20:.1f}, "
          f"after {status['VmRSS'] / 2**20:.1f}), "
          f"median step {record['median_step_ms']:.1f} ms", flush=True)
    return 0


def _tf_memory(reset: bool = False) -> dict | None:
    """Bytes in use now and at peak in TF's CPU allocator (None where TF keeps no statistics).

    TF's oneDNN build (the default on x86) serves tensors of 256 KB and more from a BFC pool that
    counts them exactly; that pool grows in regions and never shrinks, so process RSS follows the
    pool's size (live tensors plus fragmentation) in steps of a region. With TF_ENABLE_ONEDNN_OPTS=0
    tensors come from malloc and TF keeps no statistics.
    """
    import tensorflow as tf

    try:
        info = tf.config.experimental.get_memory_info("CPU:0")
        if reset:
            tf.config.experimental.reset_memory_stats("CPU:0")
        return info
    except ValueError:
        return None


def run_processes(args: argparse.Namespace) -> dict:
    """Launches `args.processes` ranks per stage (one launch per stage, so each peak RSS is that stage's)."""
    from tfdist.cluster.launcher import launch
    from tfdist.errors import ConfigError

    if args.backend not in STRATEGY_OF_BACKEND:
        raise ConfigError(f"--backend must be one of {sorted(STRATEGY_OF_BACKEND)}, got {args.backend!r}.")
    strategy = STRATEGY_OF_BACKEND[args.backend]
    n = args.processes
    per_stage: dict[int, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="tfdist-bench-zero-") as out:
        for stage in STAGES:
            cmd = [sys.executable, "-m", "tfdist.bench.zero_procs", "--strategy", strategy, "--stage", str(stage),
                   "--width", str(args.width), "--steps", str(args.proc_steps),
                   "--batch-size", str(args.proc_batch_size), "--out", out]
            code = launch(cmd, n, backend=args.backend, env={"TF_CPP_MIN_LOG_LEVEL": "2"}, timeout_s=900)
            if code != 0:
                raise RuntimeError(f"stage {stage}: the {n}-process run ({args.backend}) exited with {code}")
            per_stage[stage] = [json.load(open(os.path.join(out, f"stage{stage}_rank{r}.json"))) for r in range(n)]
    num_params = per_stage[0][0]["num_params"]
    peak = {s: max(r["peak_rss_bytes"] for r in rows) for s, rows in per_stage.items()}
    tf_peak = {s: max(r["tf_step_peak_bytes"] for r in rows) if all(r["tf_step_peak_bytes"] for r in rows) else None
               for s, rows in per_stage.items()}
    step = {s: max(r["median_step_ms"] for r in rows) for s, rows in per_stage.items()}
    save = {s: max(r["save_seconds"] for r in rows) for s, rows in per_stage.items()}
    # Theory per process, fp32 Adam: stage 1 stops holding (N-1)/N of the 8Ψ state; stage 2 also of
    # the 4Ψ reduced gradient.
    theory = {1: 8 * num_params * (n - 1) / n, 2: 12 * num_params * (n - 1) / n}
    savings = {}
    for s in (1, 2):
        saved = peak[0] - peak[s]
        tf_saved = tf_peak[0] - tf_peak[s] if tf_peak[0] and tf_peak[s] else None
        savings[s] = {"measured_bytes": saved, "theoretical_bytes": theory[s], "ratio": saved / theory[s],
                      "target_ratio_min": 0.80, "ok": saved >= 0.80 * theory[s],
                      "tf_allocator_bytes": tf_saved,
                      "tf_allocator_ratio": tf_saved / theory[s] if tf_saved is not None else None,
                      "step_ratio_to_stage0": step[s] / step[0], "step_ok": step[s] / step[0] <= 1.10}
    print(f"\n{n} processes ({args.backend}, strategy {strategy}), MLP {num_params / 1e6:.1f}M params, Adam, "
          f"global batch {args.proc_batch_size}")
    print(f"{'stage':7s} {'peak RSS':>9s} {'saved':>6s} {'ratio':>6s} {'TF step peak':>12s} {'saved':>6s} "
          f"{'ratio':>6s} {'theory':>7s} {'step ms':>8s} {'÷ st. 0':>7s} {'save s':>7s}   (MiB per process)")
    for s in STAGES:
        line = f"ZeRO-{s}  {peak[s] / 2**20:9.1f}"
        v = savings.get(s)
        line += f" {v['measured_bytes'] / 2**20:6.1f} {v['ratio']:6.2f}" if v else " " * 14
        line += f" {tf_peak[s] / 2**20:12.1f}" if tf_peak[s] else f" {'n/a':>12s}"
        if v and v["tf_allocator_bytes"] is not None:
            line += f" {v['tf_allocator_bytes'] / 2**20:6.1f} {v['tf_allocator_ratio']:6.2f}"
        else:
            line += " " * 14
        line += f" {v['theoretical_bytes'] / 2**20:7.1f}" if v else " " * 8
        line += f" {step[s]:8.1f} {step[s] / step[0]:7.3f} {save[s]:7.2f}"
        print(line)
    print("targets: saving >= 0.80 x theory ((N-1)/N of the Adam state [+ gradient at stage 2]), step time <= 1.10 x "
          "stage 0. TF step peak: most bytes in use in TF's CPU allocator during the timed steps (the live "
          "tensors; n/a with TF_ENABLE_ONEDNN_OPTS=0); peak RSS also counts that allocator's pool, which grows "
          "in regions and never shrinks, and buffers outside TF's allocator (collective transports)")
    return {"processes": n, "backend": args.backend, "strategy": strategy, "num_params": num_params,
            "global_batch_size": args.proc_batch_size, "steps_timed": args.proc_steps,
            "per_rank": {s: rows for s, rows in per_stage.items()}, "peak_rss_bytes": peak,
            "tf_step_peak_bytes": tf_peak,
            "median_step_ms": step, "save_seconds": save, "savings": savings,
            "notes": "one launch per stage; peak RSS = VmHWM of each rank (max over ranks), read before the "
                     "save; TF step peak = tf.config.experimental.get_memory_info('CPU:0')['peak'] over the timed "
                     "steps (stats reset after the warm-up fit); save = tfdist.cluster.save_model of model + full optimizer state on every rank; "
                     "theory = (N-1)/N x (8 Psi Adam state [+ 4 Psi gradient for stage 2]) bytes"}


def plot(record: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    stages = [int(s) for s in record["peak_rss_bytes"]]
    labels = [f"ZeRO-{s}" for s in stages]
    ax = axes[0]
    peaks = [record["peak_rss_bytes"][s] / 2**20 for s in record["peak_rss_bytes"]]
    ax.bar(labels, peaks, color="tab:blue", label="measured peak RSS")
    base = peaks[0]
    ax.scatter(labels[1:], [base - record["savings"][s]["theoretical_bytes"] / 2**20 for s in record["savings"]],
               color="black", marker="_", s=900, zorder=3, label="stage 0 − theoretical (N−1)/N saving")
    ax.set_ylim(min(peaks) * 0.8, max(peaks) * 1.05)
    ax.set_ylabel("MiB per process (peak RSS)")
    ax.set_title(f"{record['processes']} processes ({record['backend']}), "
                 f"{record['num_params'] / 1e6:.1f}M params, Adam")
    ax.legend(fontsize=7)
    ax = axes[1]
    steps = [record["median_step_ms"][s] / record["median_step_ms"][list(record["median_step_ms"])[0]]
             for s in record["median_step_ms"]]
    ax.bar(labels, steps)
    ax.axhline(1.10, color="red", linestyle="--", label="target 1.10")
    ax.set_ylabel("median step time / stage 0")
    ax.legend(fontsize=7)
    from tfdist.bench.common import save_figure

    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
