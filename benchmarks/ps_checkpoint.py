"""`tfdist bench ps-checkpoint`: memory of a `tf.train.Checkpoint` save and restore of an embedding table larger
than one parameter server can hold, on every process of the job.

One `tfdist launch --ps K` job (a chief, one worker, K servers). The chief builds Embedding(ROWS, DIM) -> mean ->
Dense in `tfdist.ParameterServerStrategy`'s scope (the table split over the K servers), trains one step, then, round
after round, saves the model with `tf.train.Checkpoint(...).write` and restores it with `.read`. Around each save and
each restore it resets every process's peak resident memory (`/proc/PID/clear_refs`) and reads it after
(`VmHWM`), so each figure is what that process added above where it stood: a process that gathered the table
would add the table's size. The restore is checked: the first and last row of every shard read back equal what
was saved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

NAME = "ps-checkpoint"
HELP = ("peak memory each process adds while tf.train.Checkpoint saves and restores an embedding table split over "
        "parameter servers (one entry per shard, written and read by its server)")
MODULE = "benchmarks.ps_checkpoint"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, default=4_000_000, help="table rows (default 4,000,000)")
    p.add_argument("--dim", type=int, default=64, help="table columns (default 64: 977 MiB of float32)")
    p.add_argument("--servers", type=int, default=4, help="parameter servers (default 4)")
    p.add_argument("--rounds", type=int, default=5, help="save + restore rounds (default 5)")
    p.add_argument("--dir", default="bench_ps_checkpoint", help="where the job writes its checkpoints and pids")
    p.add_argument("--json", default="bench_ps_checkpoint.json", help="where to write the JSON record")
    p.add_argument("--png", default="bench_ps_checkpoint.png", help="where to write the figure ('' to skip)")


# --- every process of the job -------------------------------------------------------------------------------
def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _processes(folder: str) -> dict[str, int]:
    return {name.removesuffix(".pid"): int(open(os.path.join(folder, name)).read())
            for name in sorted(os.listdir(folder)) if name.endswith(".pid")}


def _measured(processes: dict[str, int], action) -> tuple[dict[str, float], float]:
    """Runs `action`; returns the MiB each process's resident peak rose above its resident size before, and the
    seconds the action took."""
    before = {}
    for name, pid in processes.items():
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")  # the peak (VmHWM) restarts from the current resident size
        before[name] = _status_kib(pid, "VmRSS")
    start = time.perf_counter()
    action()
    seconds = time.perf_counter() - start
    return {name: (_status_kib(pid, "VmHWM") - before[name]) / 1024 for name, pid in processes.items()}, seconds


def _worker(args: argparse.Namespace) -> None:
    pids = os.path.join(args.dir, "pids")
    os.makedirs(pids, exist_ok=True)
    role = os.environ.get("TFDIST_ROLE", "chief")
    with open(os.path.join(pids, f"{role}{os.environ.get('TFDIST_RANK', '0')}.pid"), "w") as f:
        f.write(str(os.getpid()))
    import keras
    import numpy as np
    import tensorflow as tf

    import tfdist
    from tfdist.parameter_server.sharded_embedding import lookup, sharded_table

    tf.get_logger().setLevel("ERROR")  # each write/read traces TF's saver again: its retracing warning, every round
    strategy = tfdist.ParameterServerStrategy(min_shard_bytes=1 << 20)  # servers and the worker stay in here
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,), dtype="int32"),
                                  keras.layers.Embedding(args.rows, args.dim, name="table"),
                                  keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1, name="head")])
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")

    def dataset_fn(input_context):
        ids = tf.random.stateless_uniform((64, 8), seed=(3, 4), maxval=args.rows, dtype=tf.int32)
        return tf.data.Dataset.from_tensor_slices((ids, tf.ones(64))).repeat().batch(64)

    model.fit(dataset_fn, epochs=1, steps_per_epoch=1, verbose=0)
    table = sharded_table(model.get_layer("table"))
    starts = np.cumsum([0] + [int(s.shape[0]) for s in table.variables])
    probe = tf.constant(sorted({int(r) for a, b in zip(starts[:-1], starts[1:]) for r in (a, b - 1)}))  # each
    # shard's first and last row, read through the sharded lookup
    saved_rows = lookup(table, probe).numpy()
    checkpoint = tf.train.Checkpoint(model=model)
    processes = _processes(pids)
    rounds, path = [], os.path.join(args.dir, "checkpoint", "ckpt")
    for _ in range(args.rounds):
        save, save_s = _measured(processes, lambda: checkpoint.write(path))
        for shard in table.variables:  # overwritten on each server, so the restore has something to do
            shard.assign(tf.zeros_like(shard))
        restore, restore_s = _measured(processes, lambda: checkpoint.read(path).assert_consumed())
        rounds.append({"save_mib": save, "restore_mib": restore, "save_s": save_s, "restore_s": restore_s,
                       "restored_exactly": bool(np.array_equal(lookup(table, probe).numpy(), saved_rows))})
    record = {"benchmark": NAME, "rows": args.rows, "dim": args.dim, "servers": args.servers,
              "table_mib": args.rows * args.dim * 4 / 2**20,
              "shards": [[s.shape.as_list(), s.device] for s in table.variables],
              "data_files": {f: os.path.getsize(os.path.join(os.path.dirname(path), f))  # one per task that holds
                             for f in sorted(os.listdir(os.path.dirname(path))) if ".data-" in f},  # variables
              "rounds": rounds}
    with open(os.path.join(args.dir, "record.json"), "w") as f:
        json.dump(record, f)


# --- the driver ---------------------------------------------------------------------------------------------
def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _driver(args: argparse.Namespace) -> None:
    from benchmarks.processes import module_command
    from tfdist.cluster.launcher import launch

    os.makedirs(os.path.join(args.dir, "pids"), exist_ok=True)
    for name in os.listdir(os.path.join(args.dir, "pids")):
        os.remove(os.path.join(args.dir, "pids", name))
    command = module_command(MODULE, worker=True, rows=args.rows, dim=args.dim, servers=args.servers,
                             rounds=args.rounds, dir=os.path.abspath(args.dir))
    code = launch(command, 1, ps=args.servers, env={"TF_CPP_MIN_LOG_LEVEL": "2"}, timeout_s=1800)
    if code != 0:
        sys.exit(f"tfdist bench {NAME}: the job failed (exit {code})")
    with open(os.path.join(args.dir, "record.json")) as f:
        record = json.load(f)
    names = sorted(record["rounds"][0]["save_mib"])
    record["summary"] = {
        phase: {name: _summary([r[f"{phase}_mib"][name] for r in record["rounds"]]) for name in names}
        for phase in ("save", "restore")}
    record["seconds"] = {phase: _summary([r[f"{phase}_s"] for r in record["rounds"]]) for phase in ("save", "restore")}
    shard = record["table_mib"] / record["servers"]
    print(f"table {record['table_mib']:.0f} MiB over {record['servers']} servers ({shard:.0f} MiB each), "
          f"{len(record['rounds'])} rounds; data files (MiB): "
          f"{[round(b / 2**20, 1) for b in record['data_files'].values()]}; restored exactly: "
          f"{all(r['restored_exactly'] for r in record['rounds'])}")
    print("peak MiB a process adds, median (min-max):")
    for name in names:
        cells = [f"{phase} {s['median']:7.1f} ({s['min']:.1f}-{s['max']:.1f})"
                 for phase, s in ((p, record["summary"][p][name]) for p in ("save", "restore"))]
        print(f"  {name:8s} " + "   ".join(cells))
    print("seconds, median: save {save:.2f}, restore {restore:.2f}".format(
        **{p: record["seconds"][p]["median"] for p in ("save", "restore")}))
    with open(args.json, "w") as f:
        json.dump(record, f, indent=1)
    if args.png:
        _plot(record, names, args.png)


def _plot(record: dict, names: list[str], png: str) -> None:
    from benchmarks.common import save_figure
    from tfdist.plots import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.38
    for k, phase in enumerate(("save", "restore")):
        s = [record["summary"][phase][n] for n in names]
        ax.bar([i + (k - 0.5) * width for i in range(len(names))], [v["median"] for v in s], width, label=phase,
               yerr=[[v["median"] - v["min"] for v in s], [v["max"] - v["median"] for v in s]])
    ax.axhline(record["table_mib"] / record["servers"], color="gray", ls="--", label="one shard")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("peak added (MiB)")
    ax.set_title(f"tf.train.Checkpoint of a {record['table_mib']:.0f} MiB table on {record['servers']} servers")
    ax.legend()
    save_figure(fig, png)


def run(args: argparse.Namespace) -> int:
    _driver(args)
    return 0


if __name__ == "__main__":
    from benchmarks.processes import worker_or_driver_main

    sys.exit(worker_or_driver_main(f"python -m {MODULE}", HELP, add_arguments, _worker, run))
