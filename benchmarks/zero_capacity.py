"""`tfdist bench zero-capacity`: the widest MLP each ZeRO stage trains across N processes, each process in
a memory-capped cgroup (bisection over the width). With `--phases WIDTH`: where each process's memory goes,
phase by phase (benchmarks.memory_phases), at one width."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import time

NAME = "zero-capacity"
HELP = ("largest model (MLP width) each ZeRO stage trains with N real processes, each inside a memory-capped "
        "cgroup (v1, root): table, JSON and PNG")
STAGES = (0, 1, 2, 3)
MODULE = "benchmarks.zero_capacity"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stages", type=int, nargs="+", default=list(STAGES), choices=STAGES, metavar="STAGE",
                   help="ZeRO stages to measure (default 0 1 2 3)")
    p.add_argument("--processes", type=int, default=2, help="MultiWorkerMirroredStrategy workers, one device each")
    p.add_argument("--cap-mb", type=int, default=1536, help="memory cap of each process's cgroup, MiB")
    p.add_argument("--depth", type=int, default=4, help="hidden Dense layers of width W x W")
    p.add_argument("--min-width", type=int, default=256, help="smallest width tried")
    p.add_argument("--max-width", type=int, default=8192, help="largest width tried")
    p.add_argument("--granularity", type=int, default=256, help="widths tried are multiples of this")
    p.add_argument("--steps", type=int, default=2, help="Adam steps per trial (global batch 16)")
    p.add_argument("--local-devices", type=int, default=1, help="devices (logical CPUs) per process")
    p.add_argument("--phases", type=int, default=None, metavar="WIDTH",
                   help="instead of the search: one uncapped run per stage at this width, recording each process's "
                        "resident memory (and TF's allocator bytes) phase by phase (imports, model created, "
                        "optimizer built = stage 3's cut, each step)")
    p.add_argument("--json", default="bench_zero_capacity.json", help="where to write the JSON record")
    p.add_argument("--png", default="bench_zero_capacity.png", help="where to write the figure ('' to skip)")


def mlp_params(width: int, depth: int) -> int:
    """Trainable parameters of the benchmark's MLP (input width W, `depth` Dense(W) layers, Dense(1))."""
    return depth * (width * width + width) + width + 1


# --- one worker (python -m benchmarks.zero_capacity --worker ...) -------------------------------------
def worker(args: argparse.Namespace) -> None:
    """Joins cgroup `{group}-r{task index}` (unless "-") before TensorFlow loads, trains the MLP for
    `steps` Adam steps at `stage` under MultiWorkerMirroredStrategy (one device), and the chief prints
    a JSON line with the loss."""
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"] if "TF_CONFIG" in os.environ else 0
    if args.group != "-":  # charged from here on: TensorFlow's state, the model and the training
        with open(f"{args.group}-r{rank}/cgroup.procs", "w") as f:
            f.write(str(os.getpid()))
    phases = None
    if getattr(args, "phases", False):
        from benchmarks.memory_phases import MemoryPhases

        phases = MemoryPhases(cgroup=None if args.group == "-" else f"{args.group}-r{rank}")
    import numpy as np

    import tfdist

    local = getattr(args, "local_devices", 1)
    strategy = tfdist.MultiWorkerMirroredStrategy(timeout_s=300, zero_stage=args.stage, local_devices=local)
    import keras
    import tensorflow as tf

    mark = phases.mark if phases else (lambda name: None)
    mark("imports + strategy")
    width = args.width
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((width,)),
                                  *[keras.layers.Dense(width, activation="tanh") for _ in range(args.depth)],
                                  keras.layers.Dense(1)])
        mark("model created")
        model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
        if phases:  # fit would build it at its start; here its own phase (at stage 3: the cut)
            model.optimizer.build(model.trainable_variables)
            mark("optimizer built (cut)")
    batch = 16  # global
    x = np.random.default_rng(0).normal(size=(batch * args.steps, width)).astype("float32")
    y = np.random.default_rng(1).normal(size=(batch * args.steps, 1)).astype("float32")
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).with_options(options)
    callbacks = [_phase_marks(keras, mark)] if phases else []
    loss = model.fit(data, epochs=1, verbose=0, callbacks=callbacks).history["loss"]
    mark("after fit")
    if phases:
        print(f"PHASES {rank} " + json.dumps(phases.rows), flush=True)
    if rank == 0:
        print("RESULT " + json.dumps({"stage": args.stage, "width": width, "loss": loss,
                                      "replicas": strategy.num_replicas_in_sync,
                                      "num_params": int(sum(np.prod(v.shape) for v in model.trainable_variables))}),
              flush=True)


def _phase_marks(keras, mark):
    """A Keras callback marking a phase at the end of each training step (step 1 includes the trace)."""

    class PhaseMarks(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            mark(f"step {batch + 1}" + (" (trace + run)" if batch == 0 else ""))

    return PhaseMarks()


def _worker_arguments(p: argparse.ArgumentParser) -> None:
    """The worker's own options (depth and steps are the driver's)."""
    p.add_argument("--group", default="-")
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--width", type=int, default=0)


# --- driver -------------------------------------------------------------------------------------------
def trial(stage: int, width: int, depth: int, steps: int, processes: int, cap_bytes: int | None,
          tag: str = "trial", local_devices: int = 1, phases: bool = False) -> dict:
    """One run of `processes` workers, each in its own cgroup capped at `cap_bytes` (None: uncapped, but
    still measured). Returns {"ok", "exit", "oom_kills", "peaks", "loss"} (and with `phases`, "phases":
    each process's `MemoryPhases` rows)."""
    import contextlib

    from benchmarks.processes import module_command, run_workers
    from benchmarks.zero_cgroups import capped, usage

    cap = cap_bytes if cap_bytes is not None else 64 << 30
    with contextlib.ExitStack() as stack:
        groups = [stack.enter_context(capped(f"{tag}-s{stage}-w{width}-r{r}", cap)) for r in range(processes)]
        prefix = str(groups[0])[:-len("-r0")]
        out = io.StringIO()
        start = time.perf_counter()
        rc = run_workers(module_command(MODULE, worker=True, group=prefix, stage=stage, width=width, depth=depth,
                                        steps=steps, local_devices=local_devices,
                                        phases=width if phases else None), processes, out=out,
                         env={"TF_ENABLE_ONEDNN_OPTS": "1"} if phases else None)  # TF's allocator statistics
        seconds = time.perf_counter() - start
        used = [usage(g) for g in groups]
    log = out.getvalue()
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in log.splitlines() if "RESULT " in line]
    oom = [u["oom_kills"] for u in used]
    record = {"stage": stage, "width": width, "params": mlp_params(width, depth), "ok": rc == 0 and not any(oom),
              "exit": rc, "oom_kills": oom, "peaks": [u["peak"] for u in used], "seconds": round(seconds, 1),
              "loss": results[0]["loss"] if results else None, "log_tail": None if rc == 0 else log[-1500:]}
    if phases:
        rows = {}
        for line in log.splitlines():
            if "PHASES " in line:
                rank, payload = line.split("PHASES ", 1)[1].split(" ", 1)
                rows[int(rank)] = json.loads(payload)
        record["phases"] = [rows.get(r) for r in range(processes)]
        # Each mark resets the group's peak (memory.max_usage_in_bytes): the run's peak is the phases' largest.
        record["peaks"] = [max([p, *(row.get("cgroup_peak", 0) for row in rows.get(r) or ())])
                           for r, p in enumerate(record["peaks"])]
    return record


def largest_width(stage: int, args: argparse.Namespace, cap_bytes: int) -> tuple[int | None, list[dict]]:
    """Bisection over multiples of `granularity` in [min_width, max_width]: the widest that trains."""
    g = args.granularity
    lo, hi = max(1, args.min_width // g), args.max_width // g  # in units of g
    trials = []

    def fits(units: int) -> bool:
        def once() -> dict:
            return trial(stage, units * g, args.depth, args.steps, args.processes, cap_bytes, tag="cap",
                         local_devices=getattr(args, "local_devices", 1))

        t = once()
        if not t["ok"] and not any(t["oom_kills"]):  # not memory (a start-up failure): once more, then an error
            trials.append(t)
            t = once()
            if not t["ok"] and not any(t["oom_kills"]):
                raise RuntimeError(f"stage {stage}, width {units * g}: the workers failed (exit {t['exit']}) without "
                                   f"being OOM-killed, twice; last output:\n{t['log_tail']}")
        trials.append(t)
        print(f"  stage {stage} width {units * g:5d} ({t['params'] / 1e6:6.1f} M params): "
              f"{'trains' if t['ok'] else 'killed' if any(t['oom_kills']) else 'failed'} "
              f"(exit {t['exit']}, peaks {[round(p / 2**20) for p in t['peaks']]} MiB, {t['seconds']} s)", flush=True)
        return t["ok"]

    if not fits(lo):
        return None, trials
    if fits(hi):
        return hi * g, trials
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * g, trials


def run(args: argparse.Namespace) -> int:
    from benchmarks.common import machine, write_json
    from benchmarks.zero_cgroups import unavailable

    why = unavailable()
    if why:
        print(f"tfdist bench zero-capacity: {why}; nothing measured.")
        return 1
    # The page cache of TF's libraries is charged to the group that first reads them: load them outside.
    subprocess.run([sys.executable, "-c", "import tensorflow, keras"], check=True, capture_output=True)
    if args.phases:
        return run_phases(args)
    cap = args.cap_mb * 2**20
    print(f"ZeRO capacity: {args.processes} processes x {args.local_devices} devices, each capped at {args.cap_mb} MiB; MLP of "
          f"{args.depth} Dense(W) layers, widths {args.min_width}..{args.max_width} step {args.granularity}; "
          f"load {_loadavg()}")
    rows, trials = [], []
    for stage in sorted(set(args.stages)):
        width, tried = largest_width(stage, args, cap)
        trials += tried
        rows.append({"stage": stage, "largest_width": width,
                     "params": mlp_params(width, args.depth) if width else 0,
                     "training_state_bytes_per_process": args.local_devices * _state_bytes(
                         stage, mlp_params(width, args.depth), args.processes * args.local_devices) if width else 0})
    print(f"\n{'stage':>5} {'largest width':>14} {'params (M)':>11} {'16Psi-style state / process (MiB)':>34}")
    for row in rows:
        print(f"{row['stage']:>5} {row['largest_width']!s:>14} {row['params'] / 1e6:>11.1f} "
              f"{row['training_state_bytes_per_process'] / 2**20:>34.0f}")
    record = {"benchmark": NAME, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "machine": machine(), "loadavg": _loadavg(),
              "args": {k: v for k, v in vars(args).items() if k not in ("run", "benchmark", "command")},
              "rows": rows, "trials": trials}
    write_json(args.json, record)
    if args.png:
        plot(record, args.png)
    return 0


def run_phases(args: argparse.Namespace) -> int:
    """`--phases WIDTH`: one uncapped run per stage; each process's memory phase by phase, as tables and JSON."""
    from benchmarks.common import machine, write_json

    width = args.phases
    psi = mlp_params(width, args.depth)
    replicas = args.processes * args.local_devices
    print(f"ZeRO memory by phase: {args.processes} processes x {args.local_devices} devices, MLP of {args.depth} "
          f"Dense({width}) layers (Psi = {psi / 1e6:.1f} M, 4 Psi = {4 * psi / 2**20:.0f} MiB), {args.steps} steps; "
          f"load {_loadavg()}")
    runs = []
    for stage in sorted(set(args.stages)):
        t = trial(stage, width, args.depth, args.steps, args.processes, None, tag="phases",
                  local_devices=args.local_devices, phases=True)
        if not t["ok"]:
            print(f"stage {stage}: the run failed (exit {t['exit']}):\n{t['log_tail']}")
            return 1
        t["formula_bytes_per_process"] = _state_bytes(stage, psi, replicas) * args.local_devices
        runs.append(t)
        for rank, rows in enumerate(t["phases"]):
            print(f"\nstage {stage}, process {rank} (cgroup peak {t['peaks'][rank] / 2**20:.0f} MiB, formula "
                  f"{t['formula_bytes_per_process'] / 2**20:.0f} MiB of training state per process), MiB:")
            print(_phase_table(rows))
    record = {"benchmark": NAME + " --phases", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "machine": machine(), "loadavg": _loadavg(),
              "args": {k: v for k, v in vars(args).items() if k not in ("run", "benchmark", "command")},
              "params": psi, "runs": runs}
    write_json(args.json, record)
    return 0


def _phase_table(rows: list[dict] | None) -> str:
    if not rows:
        return "  (no phases reported)"
    keys = ("cgroup", "cgroup_peak", "rss", "rss_peak", "anon", "tf_current", "tf_peak")
    header = (f"  {'phase (peaks: since the row above)':<36} {'cgroup':>7} {'peak':>6} {'RSS':>6} {'peak':>6} "
              f"{'anon':>6} {'TF':>6} {'peak':>6}")
    lines = [header]
    for r in rows:
        cells = (f"{r[k] / 2**20:.0f}" if k in r else "-" for k in keys)
        lines.append(f"  {r['phase']:<36} " + " ".join(f"{c:>{w}}" for c, w in zip(cells, (7, 6, 6, 6, 6, 6, 6))))
    return "\n".join(lines)


def _loadavg() -> list[str]:
    """1, 5 and 15 minute load averages (timings on a loaded box are noisy: recorded next to them)."""
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def _state_bytes(stage: int, params: int, n: int) -> float:
    """Adam float32 training state per process by the ZeRO formulas (params + grads + 2 moments)."""
    return {0: 16 * params, 1: 8 * params + 8 * params / n, 2: 4 * params + 12 * params / n,
            3: 16 * params / n}[stage]


def plot(record: dict, path: str) -> None:
    from benchmarks.common import save_figure
    from tfdist.plots import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    rows = record["rows"]
    ax.bar([f"stage {r['stage']}" for r in rows], [r["params"] / 1e6 for r in rows], color="tab:blue")
    for i, r in enumerate(rows):
        ax.text(i, r["params"] / 1e6, f"W={r['largest_width']}", ha="center", va="bottom")
    a = record["args"]
    ax.set_ylabel("largest trainable model (M params)")
    ax.set_title(f"{a['processes']} processes, {a['cap_mb']} MiB cap each")
    save_figure(fig, path)


if __name__ == "__main__":
    from benchmarks.processes import worker_or_driver_main

    def _arguments(p):
        add_arguments(p)
        _worker_arguments(p)

    sys.exit(worker_or_driver_main(f"python -m {MODULE}", HELP, _arguments, worker, run))
