"""`tfdist bench zero-capacity`: the widest MLP each ZeRO stage trains across N processes, each process in
a memory-capped cgroup (bisection over the width)."""

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
MODULE = "tfdist.bench.zero_capacity"


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
    p.add_argument("--json", default="bench_zero_capacity.json", help="where to write the JSON record")
    p.add_argument("--png", default="bench_zero_capacity.png", help="where to write the figure ('' to skip)")


def mlp_params(width: int, depth: int) -> int:
    """Trainable parameters of the benchmark's MLP (input width W, `depth` Dense(W) layers, Dense(1))."""
    return depth * (width * width + width) + width + 1


# --- one worker (python -m tfdist.bench.zero_capacity --worker ...) -------------------------------------
def worker(args: argparse.Namespace) -> None:
    """Joins cgroup `{group}-r{task index}` (unless "-") before TensorFlow loads, trains the MLP for
    `steps` Adam steps at `stage` under MultiWorkerMirroredStrategy (one device), and the chief prints
    a JSON line with the loss."""
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"] if "TF_CONFIG" in os.environ else 0
    if args.group != "-":  # charged from here on: TensorFlow's state, the model and the training
        with open(f"{args.group}-r{rank}/cgroup.procs", "w") as f:
            f.write(str(os.getpid()))
    import numpy as np

    import tfdist

    strategy = tfdist.MultiWorkerMirroredStrategy(timeout_s=300, zero_stage=args.stage, local_devices=1)
    import keras
    import tensorflow as tf

    width = args.width
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((width,)),
                                  *[keras.layers.Dense(width, activation="tanh") for _ in range(args.depth)],
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    batch = 16  # global
    x = np.random.default_rng(0).normal(size=(batch * args.steps, width)).astype("float32")
    y = np.random.default_rng(1).normal(size=(batch * args.steps, 1)).astype("float32")
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).with_options(options)
    loss = model.fit(data, epochs=1, verbose=0).history["loss"]
    if rank == 0:
        print("RESULT " + json.dumps({"stage": args.stage, "width": width, "loss": loss,
                                      "replicas": strategy.num_replicas_in_sync,
                                      "num_params": int(sum(np.prod(v.shape) for v in model.trainable_variables))}),
              flush=True)


def _worker_arguments(p: argparse.ArgumentParser) -> None:
    """The worker's own options (depth and steps are the driver's)."""
    p.add_argument("--group", default="-")
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--width", type=int, default=0)


# --- driver -------------------------------------------------------------------------------------------
def trial(stage: int, width: int, depth: int, steps: int, processes: int, cap_bytes: int | None,
          tag: str = "trial") -> dict:
    """One run of `processes` workers, each in its own cgroup capped at `cap_bytes` (None: uncapped, but
    still measured). Returns {"ok", "exit", "oom_kills", "peaks", "loss"}."""
    import contextlib

    from tfdist.bench.processes import module_command, run_workers
    from tfdist.bench.zero_cgroups import capped, usage

    cap = cap_bytes if cap_bytes is not None else 64 << 30
    with contextlib.ExitStack() as stack:
        groups = [stack.enter_context(capped(f"{tag}-s{stage}-w{width}-r{r}", cap)) for r in range(processes)]
        prefix = str(groups[0])[:-len("-r0")]
        out = io.StringIO()
        start = time.perf_counter()
        rc = run_workers(module_command(MODULE, worker=True, group=prefix, stage=stage, width=width, depth=depth,
                                        steps=steps), processes, out=out)
        seconds = time.perf_counter() - start
        used = [usage(g) for g in groups]
    log = out.getvalue()
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in log.splitlines() if "RESULT " in line]
    oom = [u["oom_kills"] for u in used]
    return {"stage": stage, "width": width, "params": mlp_params(width, depth), "ok": rc == 0 and not any(oom),
            "exit": rc, "oom_kills": oom, "peaks": [u["peak"] for u in used], "seconds": round(seconds, 1),
            "loss": results[0]["loss"] if results else None, "log_tail": None if rc == 0 else log[-1500:]}


def largest_width(stage: int, args: argparse.Namespace, cap_bytes: int) -> tuple[int | None, list[dict]]:
    """Bisection over multiples of `granularity` in [min_width, max_width]: the widest that trains."""
    g = args.granularity
    lo, hi = max(1, args.min_width // g), args.max_width // g  # in units of g
    trials = []

    def fits(units: int) -> bool:
        t = trial(stage, units * g, args.depth, args.steps, args.processes, cap_bytes, tag="cap")
        if not t["ok"] and not any(t["oom_kills"]):  # not memory (a start-up failure): once more, then an error
            trials.append(t)
            t = trial(stage, units * g, args.depth, args.steps, args.processes, cap_bytes, tag="cap")
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
    from tfdist.bench.common import machine, write_json
    from tfdist.bench.zero_cgroups import unavailable

    why = unavailable()
    if why:
        print(f"tfdist bench zero-capacity: {why}; nothing measured.")
        return 1
    # The page cache of TF's libraries is charged to the group that first reads them: load them outside.
    subprocess.run([sys.executable, "-c", "import tensorflow, keras"], check=True, capture_output=True)
    cap = args.cap_mb * 2**20
    print(f"ZeRO capacity: {args.processes} processes x 1 device, each capped at {args.cap_mb} MiB; MLP of "
          f"{args.depth} Dense(W) layers, widths {args.min_width}..{args.max_width} step {args.granularity}; "
          f"load {_loadavg()}")
    rows, trials = [], []
    for stage in sorted(set(args.stages)):
        width, tried = largest_width(stage, args, cap)
        trials += tried
        rows.append({"stage": stage, "largest_width": width,
                     "params": mlp_params(width, args.depth) if width else 0,
                     "training_state_bytes_per_process": _state_bytes(stage, mlp_params(width, args.depth),
                                                                      args.processes) if width else 0})
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


def _loadavg() -> list[str]:
    """1, 5 and 15 minute load averages (timings on a loaded box are noisy: recorded next to them)."""
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def _state_bytes(stage: int, params: int, n: int) -> float:
    """Adam float32 training state per process by the ZeRO formulas (params + grads + 2 moments)."""
    return {0: 16 * params, 1: 8 * params + 8 * params / n, 2: 4 * params + 12 * params / n,
            3: 16 * params / n}[stage]


def plot(record: dict, path: str) -> None:
    from tfdist.bench.common import save_figure
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
    from tfdist.bench.processes import worker_or_driver_main

    def _arguments(p):
        add_arguments(p)
        _worker_arguments(p)

    sys.exit(worker_or_driver_main(f"python -m {MODULE}", HELP, _arguments, worker, run))
