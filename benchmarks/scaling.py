"""`tfdist bench scaling`: CNN images/s, 1 process x 1 core vs N processes x 1 core each, under HorovodStrategy.

Weak scaling, as Horovod reports it: every process trains the same per-process batch on its own
core (mpirun --bind-to core, and TensorFlow limited to one intra-op and one inter-op thread), so N
processes do N times the work per step. Efficiency = images/s(N) / (N x images/s(1)). The runs
alternate (1, N, N, 1, ...); each round's efficiency compares its own adjacent pair, and the target
is judged on the median over rounds (min and max printed next to it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from benchmarks.rounds import MIN_ROUNDS, describe, spread

NAME = "scaling"
HELP = "CNN images/s and scaling efficiency: 1 process x 1 core vs N processes x 1 core (HorovodStrategy)"
TARGET_EFFICIENCY = 0.9  # Horovod's published headline


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--np", type=int, default=2, help="processes of the multi-process run (default 2)")
    p.add_argument("--batch-per-process", type=int, default=128, help="images per process per step")
    p.add_argument("--steps", type=int, default=30, help="timed steps per run")
    p.add_argument("--rounds", type=int, default=MIN_ROUNDS,
                   help=f"alternating (1, N) rounds; the median is judged (default {MIN_ROUNDS})")
    p.add_argument("--json", default="bench_scaling.json", help="where to write the JSON record")
    p.add_argument("--plot", default="bench_scaling.png", help="where to write the PNG")


def _worker(args: argparse.Namespace) -> None:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras

    import tfdist
    from benchmarks.common import StepTimer

    strategy = tfdist.HorovodStrategy()
    n = strategy.size
    data = tfdist.data.mnist(global_batch_size=args.batch_per_process * n, strategy=strategy, seed=0)
    with strategy.scope():
        model = tfdist.models.cnn(data.arrays.input_shape, data.arrays.num_classes, seed=0)
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    train = data.train.repeat()
    model.fit(train, epochs=1, steps_per_epoch=5, verbose=0)  # trace, warm up
    timer = StepTimer()
    model.fit(train, epochs=1, steps_per_epoch=args.steps + 1, verbose=0, callbacks=[timer])
    step = statistics.median(timer.step_seconds)
    if strategy.is_chief:
        with open(args.json, "w") as f:
            json.dump({"processes": n, "step_seconds": step, "global_batch": args.batch_per_process * n,
                       "images_per_sec": args.batch_per_process * n / step}, f)


def _launch(args: argparse.Namespace, np_: int, out: str) -> dict:
    from benchmarks.processes import module_command, run_workers

    cmd = module_command("benchmarks.scaling", worker=True, batch_per_process=args.batch_per_process,
                         steps=args.steps, json=out)
    # One core per process holds TensorFlow's thread and Horovod's background thread: OpenMPI must
    # yield while it waits, not spin, or the two fight over the core.
    pinning = ["--bind-to", "core", "--map-by", "core", "--mca", "mpi_yield_when_idle", "1"]
    code = run_workers(cmd, np_, launcher="mpirun", mpirun_options=pinning, env={"OMP_NUM_THREADS": "1"})
    if code != 0:
        raise RuntimeError(f"{np_}-process run under mpirun failed: exit code {code}")
    with open(out) as f:
        return json.load(f)


def _plot(record: dict, path: str) -> None:
    from benchmarks.common import save_figure
    from tfdist.plots import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 4))
    procs = [1, record["processes"]]
    measured = [record["images_per_sec"]["1"], record["images_per_sec"][str(record["processes"])]]
    ax.bar([str(p) for p in procs], measured, color=["tab:blue", "tab:orange"], label="measured")
    ax.plot([str(p) for p in procs], [measured[0] * p for p in procs], "k--o", label="linear (ideal)")
    ax.set_xlabel("processes (1 core each)")
    ax.set_ylabel("images / s")
    r = record["efficiency_rounds"]
    ax.set_title(f"HorovodStrategy weak scaling: {100 * r['median']:.0f} % efficiency\n"
                 f"(median of {r['rounds']} rounds, {100 * r['min']:.0f}–{100 * r['max']:.0f} %)", fontsize=10)
    ax.legend()
    save_figure(fig, path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """`tfdist bench scaling`: measure, print, write JSON and PNG."""
    measure(args)
    return 0


def measure(args: argparse.Namespace) -> dict:
    """Alternates 1-process and N-process runs, prints images/s and efficiency, writes JSON and PNG."""
    from benchmarks.common import machine, write_json

    if (os.cpu_count() or 1) < args.np:
        print(f"note: {args.np} processes on {os.cpu_count()} core(s): they share cores, efficiency will suffer")
    runs: dict[str, list[dict]] = {"1": [], str(args.np): []}
    with tempfile.TemporaryDirectory(prefix="tfdist-scaling-") as tmp:
        for r in range(args.rounds):
            for n in (1, args.np) if r % 2 == 0 else (args.np, 1):
                result = _launch(args, n, os.path.join(tmp, f"r{r}_n{n}.json"))
                runs[str(n)].append(result)
                print(f"round {r}: {n} process(es): {result['images_per_sec']:.0f} images/s "
                      f"({1000 * result['step_seconds']:.1f} ms/step, global batch {result['global_batch']})",
                      flush=True)
    ips = {n: statistics.median(r["images_per_sec"] for r in rs) for n, rs in runs.items()}
    per_round = [n_run["images_per_sec"] / (args.np * one["images_per_sec"])
                 for one, n_run in zip(runs["1"], runs[str(args.np)])]
    rounds = spread(per_round)
    efficiency = rounds["median"]
    print(f"images/s (median): 1 process {ips['1']:.0f}, {args.np} processes {ips[str(args.np)]:.0f}")
    print(f"scaling efficiency {describe(rounds, '{:.1%}')}; target >= {100 * TARGET_EFFICIENCY:.0f} % on the "
          f"median: {'PASS' if efficiency >= TARGET_EFFICIENCY else 'MISS'}")
    record = {"benchmark": NAME, "processes": args.np, "batch_per_process": args.batch_per_process,
              "steps": args.steps, "rounds": args.rounds, "model": "tfdist.models.cnn", "dataset": "mnist",
              "pinning": "mpirun --bind-to core --mca mpi_yield_when_idle 1; TF intra/inter-op threads = 1",
              "images_per_sec": ips,
              "efficiency": efficiency, "efficiency_rounds": rounds, "efficiency_per_round": per_round,
              "target_efficiency": TARGET_EFFICIENCY, "runs": runs, "machine": machine()}
    write_json(args.json, record)
    if args.plot:
        _plot(record, args.plot)
    return record


def main(argv: list[str] | None = None) -> int:
    from benchmarks.processes import worker_or_driver_main

    return worker_or_driver_main("python -m benchmarks.scaling", HELP, add_arguments, _worker, measure, argv)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
