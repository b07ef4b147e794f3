"""`tfdist bench epoch-boundary`: the first training step after each validation ÷ a steady step, stock
`tf.distribute.MirroredStrategy` vs `tfdist.MirroredStrategy`, 4 logical CPUs, `fit(..., validation_data=...)`.

Each run is one process (two MirroredStrategies in one process collide) training the example CNN on MNIST
(4000 train / 1000 test images, global batch 64, Adam) for 1 + E epochs, validating after every epoch — the job
of `tfdist train --strategy mirrored --replicas 4`. A callback timestamps Keras' callback events:

- first step after validation: from the end of epoch e-1's validation (`on_test_end`) to the end of epoch e's
  first training step (`on_train_batch_end`, batch 0) — everything Keras does between the two, including making
  (and the previous pass's tearing down of) input iterators;
- steady step: the median of epoch e's step-to-step times (consecutive `on_train_batch_end`s);
- also: the first step as `on_train_batch_begin` → `on_train_batch_end` sees it (which leaves iterator work out),
  validation time, and the epoch boundary outside validation's own steps (last step of e-1 to first step of e,
  minus `on_test_begin` → `on_test_end`), in steady steps.

Epoch 0 (tracing, first iterators) is not counted; epochs 1..E are. Runs alternate (stock, tfdist, tfdist,
stock, ...) for --rounds rounds. The ratio is the median over all counted epochs of all rounds; the spread is
the range of the per-round medians (and of single epochs).

`--kinds multiworker horovod` also runs the same job across 2 processes of one device each
(`tfdist.MultiWorkerMirroredStrategy` under `tfdist launch -n 2`, `tfdist.HorovodStrategy` under
`tfdist launch -n 2 --backend horovod`); rank 0's figures are reported. `multiworker-tf-iterators` and
`horovod-tf-iterators` are the same with `reuse_input_iterators=False` (TF's iterators, the stall).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.arguments import require_at_least

NAME = "epoch-boundary"
HELP = ("first training step after validation ÷ steady step, stock tf.distribute.MirroredStrategy vs "
        "tfdist.MirroredStrategy on logical CPUs (fit with validation_data)")
TARGET = 3.0  # the first step after validation <= 3 x a steady step
KINDS = ("stock", "tfdist", "multiworker", "multiworker-tf-iterators", "horovod", "horovod-tf-iterators")
LABELS = {"stock": "tf.distribute.MirroredStrategy", "tfdist": "tfdist.MirroredStrategy",
          "multiworker": "tfdist.MultiWorkerMirroredStrategy x2",
          "multiworker-tf-iterators": "tfdist.MultiWorkerMirroredStrategy x2, reuse_input_iterators=False",
          "horovod": "tfdist.HorovodStrategy x2",
          "horovod-tf-iterators": "tfdist.HorovodStrategy x2, reuse_input_iterators=False"}
# kinds that run as 2 processes, and their launcher
LAUNCHERS = {"multiworker": "tf", "multiworker-tf-iterators": "tf", "horovod": "horovod",
             "horovod-tf-iterators": "horovod"}
PROCESSES = 2
TIMEOUT_S = 1800.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--epochs", type=int, default=10, help="counted epochs per run, after one warm-up epoch "
                   "(default 10)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of (stock, tfdist) runs, interleaved (default 3)")
    p.add_argument("--replicas", type=int, default=4, help="logical CPUs = replicas (default 4)")
    p.add_argument("--batch-size", type=int, default=64, help="global batch size (default 64, as tfdist train)")
    p.add_argument("--train-images", type=int, default=None,
                   help="train on the first N of the 4000 MNIST training images (default: all)")
    p.add_argument("--test-images", type=int, default=None,
                   help="validate on the first N of the 1000 MNIST test images (default: all)")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=["stock", "tfdist"],
                   help="strategies to run: stock and tfdist (default; --replicas logical CPUs in one process), "
                        "multiworker and horovod (2 processes, one device each; the -tf-iterators kinds "
                        "with reuse_input_iterators=False, TF's iterators)")
    p.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds allowed per run (default 1800)")
    p.add_argument("--json", default="bench_epoch_boundary.json", help="where to write the JSON record")
    p.add_argument("--png", default="bench_epoch_boundary.png", help="where to write the chart (empty: none)")
    p.add_argument("--kind", choices=KINDS, help=argparse.SUPPRESS)  # a worker's strategy


# ---------------------------------------------------------------------------------------------- one run


class RunFailed(RuntimeError):
    """A run of the benchmark did not finish (its exit code and last lines are in the message)."""


def _worker(args: argparse.Namespace) -> None:
    import tfdist

    if args.kind in LAUNCHERS:  # first thing: MWMS configures collectives at start-up
        name, _, tf_iterators = args.kind.partition("-")
        strategy = tfdist.strategies.make_strategy(name, reuse_input_iterators=not tf_iterators)
    else:
        tfdist.devices.virtual_cpus(args.replicas)  # before TensorFlow initialises
    import keras
    import tensorflow as tf

    if args.kind == "stock":
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices())
    elif args.kind == "tfdist":
        strategy = tfdist.MirroredStrategy()
    keras.utils.set_random_seed(0)
    arrays = tfdist.data.load_arrays("mnist")
    n = len(arrays.x_train) if args.train_images is None else args.train_images
    # The pipelines of tfdist.data.load (what `tfdist train` trains on), on the first n training images.
    order = tfdist.data.EpochOrder(seed=0)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    train = order.dataset(arrays.x_train[:n], arrays.y_train[:n], args.batch_size).prefetch(tf.data.AUTOTUNE)
    m = len(arrays.x_test) if args.test_images is None else args.test_images
    test = tf.data.Dataset.from_tensor_slices((arrays.x_test[:m], arrays.y_test[:m])).batch(args.batch_size)
    train, test = train.with_options(options), test.prefetch(tf.data.AUTOTUNE).with_options(options)
    with strategy.scope():
        model = tfdist.models.cnn(arrays.input_shape, arrays.num_classes, seed=0)
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    clock = _event_clock()
    start = time.perf_counter()
    history = model.fit(train, validation_data=test, epochs=args.epochs + 1, shuffle=False, verbose=0,
                        callbacks=[clock, order])
    wall = time.perf_counter() - start
    if not tfdist.cluster.is_chief(strategy):
        return  # rank 0 writes the record
    record = {"kind": args.kind, "strategy": LABELS[args.kind], "replicas": strategy.num_replicas_in_sync,
              "processes": tfdist.cluster.world_size(strategy),
              "train_images": n, "test_images": m, "global_batch": args.batch_size, "fit_seconds": wall,
              "epochs": epoch_figures(clock.epochs),
              "val_accuracy": [float(v) for v in history.history.get("val_accuracy", [])]}
    from tfdist.data_parallel.input_reuse import total_iterator_counts

    record["input_iterators"] = total_iterator_counts()  # all zero where no dataset reuses its iterator
    with open(args.json, "w") as f:
        json.dump(record, f)


def _event_clock():
    """A Keras callback (Keras is imported only in the worker) that keeps the timestamps of every epoch's events."""
    import keras

    class _EventClock(keras.callbacks.Callback):
        """Timestamps (perf_counter) of the callback events of every epoch of a fit."""

        def __init__(self):
            super().__init__()
            self.epochs: list[dict] = []

        def _now(self, key: str, *, append: bool = False) -> None:
            t = time.perf_counter()
            if append:
                self.epochs[-1].setdefault(key, []).append(t)
            else:
                self.epochs[-1][key] = t

        def on_epoch_begin(self, epoch, logs=None):
            self.epochs.append({})
            self._now("epoch_begin")

        def on_train_batch_begin(self, batch, logs=None):
            self._now("batch_begin", append=True)

        def on_train_batch_end(self, batch, logs=None):
            self._now("batch_end", append=True)

        def on_test_begin(self, logs=None):
            self._now("test_begin")

        def on_test_end(self, logs=None):
            self._now("test_end")

        def on_epoch_end(self, epoch, logs=None):
            self._now("epoch_end")

    return _EventClock()


def epoch_figures(events: list[dict]) -> list[dict]:
    """Per epoch e >= 1 (epoch 0 is the warm-up): the figures of the module doc, in seconds and steady steps."""
    out = []
    for e in range(1, len(events)):
        prev, cur = events[e - 1], events[e]
        ends = cur["batch_end"]
        steps = [b - a for a, b in itertools.pairwise(ends)]
        steady = statistics.median(steps)
        after_validation = ends[0] - prev["test_end"]
        validation = prev["test_end"] - prev["test_begin"]
        boundary = ends[0] - prev["batch_end"][-1] - validation
        out.append({
            "epoch": e, "steady_step_s": steady, "first_step_after_validation_s": after_validation,
            "ratio": after_validation / steady,
            "first_step_begin_to_end_s": ends[0] - cur["batch_begin"][0],
            "ratio_begin_to_end": (ends[0] - cur["batch_begin"][0]) / steady,
            "validation_s": validation, "boundary_outside_validation_s": boundary,
            "boundary_steps": boundary / steady, "epoch_s": cur["epoch_end"] - cur["epoch_begin"],
            "steps": len(ends)})
    return out


def run_one(kind: str, args: argparse.Namespace, out: str) -> dict:
    from benchmarks.processes import module_command

    cmd = module_command("benchmarks.epoch_boundary", worker=True, kind=kind, epochs=args.epochs,
                         replicas=args.replicas, batch_size=args.batch_size, train_images=args.train_images,
                         test_images=args.test_images, json=out)
    start = time.perf_counter()
    if kind in LAUNCHERS:
        code, output = _run_processes(cmd, kind, args.timeout)
    else:
        code, output = _run_process(cmd, args.timeout)
    if code != 0 or not os.path.isfile(out):
        raise RunFailed(f"the {kind} run failed (exit code {code}{', timed out' if code == TIMED_OUT else ''}):\n"
                        f"{output[-4000:]}")
    with open(out) as f:
        record = json.load(f)
    record["process_seconds"] = time.perf_counter() - start
    return record


TIMED_OUT = 124


def _run_process(cmd: list[str], timeout: float) -> tuple[int, str]:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return TIMED_OUT, ""
    return proc.returncode, proc.stdout + proc.stderr


def _run_processes(cmd: list[str], kind: str, timeout: float) -> tuple[int, str]:
    import io

    from benchmarks.processes import run_workers

    out = io.StringIO()
    code = run_workers(cmd, PROCESSES, launcher=LAUNCHERS[kind], out=out, timeout_s=timeout)
    return code, out.getvalue()


# ---------------------------------------------------------------------------------------------- driver


def run(args: argparse.Namespace) -> int:
    """`tfdist bench epoch-boundary`: measure, print, write JSON and PNG."""
    _check(args)
    try:
        measure(args)
    except RunFailed as err:
        print(f"tfdist bench {NAME}: error: {err}", file=sys.stderr)
        return 1
    return 0


def _check(args: argparse.Namespace) -> None:
    from tfdist.errors import ConfigError

    require_at_least(args, epochs=1, rounds=1, replicas=1, batch_size=1)
    if args.batch_size % args.replicas:
        raise ConfigError(f"--batch-size {args.batch_size} must divide by --replicas {args.replicas}.")
    if args.train_images is not None and not 2 * args.batch_size <= args.train_images <= 4000:
        raise ConfigError(f"--train-images must be between 2 x --batch-size ({2 * args.batch_size}) and 4000, "
                          f"got {args.train_images}.")
    if args.test_images is not None and not args.batch_size <= args.test_images <= 1000:
        raise ConfigError(f"--test-images must be between --batch-size ({args.batch_size}) and 1000, "
                          f"got {args.test_images}.")


def measure(args: argparse.Namespace) -> dict:
    """Runs --rounds interleaved rounds, prints, writes JSON and PNG."""
    from benchmarks.common import interleaved, machine, write_json

    runs: dict[str, list[dict]] = {k: [] for k in args.kinds}
    order: list[str] = []
    with tempfile.TemporaryDirectory(prefix="tfdist-epoch-boundary-") as tmp:

        def one(kind: str):
            def go():
                record = run_one(kind, args, os.path.join(tmp, f"{kind}{len(runs[kind])}.json"))
                runs[kind].append(record)
                order.append(kind)
                ratios = [e["ratio"] for e in record["epochs"]]
                print(f"round {len(runs[kind]) - 1} {kind:6s}: first step after validation / steady step: median "
                      f"{statistics.median(ratios):.1f} ({min(ratios):.1f}-{max(ratios):.1f}) over "
                      f"{len(ratios)} epochs; steady step {1000 * _median(record, 'steady_step_s'):.1f} ms; "
                      f"fit {record['fit_seconds']:.1f} s", flush=True)
            return go

        interleaved({k: one(k) for k in args.kinds}, args.rounds)
    record = summarize(args, runs, order)
    record["date"] = time.strftime("%Y-%m-%d")
    record["command"] = "tfdist bench epoch-boundary " + " ".join(
        sys.argv[3:] if sys.argv[1:3] == ["bench", NAME] else sys.argv[1:])
    record["machine"] = machine()
    report(record)
    write_json(args.json, record)
    if args.png:
        plot(record, args.png)
    return record


def _median(run: dict, key: str) -> float:
    return statistics.median(e[key] for e in run["epochs"])


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(args: argparse.Namespace, runs: dict[str, list[dict]], order: list[str]) -> dict:
    per_kind = {}
    for kind, rs in runs.items():
        epochs = [e for r in rs for e in r["epochs"]]
        per_kind[kind] = {
            "ratio": _spread([e["ratio"] for e in epochs]),
            "ratio_per_round": _spread([_median(r, "ratio") for r in rs]),
            "ratio_begin_to_end": _spread([e["ratio_begin_to_end"] for e in epochs]),
            "first_step_after_validation_s": _spread([e["first_step_after_validation_s"] for e in epochs]),
            "steady_step_s": _spread([e["steady_step_s"] for e in epochs]),
            "boundary_steps": _spread([e["boundary_steps"] for e in epochs]),
            "validation_s": _spread([e["validation_s"] for e in epochs]),
            "fit_seconds": _spread([r["fit_seconds"] for r in rs]),
            "met": statistics.median(e["ratio"] for e in epochs) <= TARGET,
            "replicas": rs[0]["replicas"], "processes": rs[0].get("processes", 1),
        }
    return {
        "benchmark": NAME, "model": "tfdist.models.cnn", "dataset": "mnist (4000 train / 1000 test)",
        "optimizer": "Adam(1e-3)", "logical_cpus": args.replicas, "global_batch": args.batch_size,
        "train_images": args.train_images or 4000, "test_images": args.test_images or 1000,
        "counted_epochs": args.epochs, "warmup_epochs": 1,
        "rounds": args.rounds, "order": order, "target_ratio": TARGET,
        "definitions": {
            "ratio": "(on_train_batch_end of epoch e's first step - on_test_end of epoch e-1's validation) / "
                     "median step-to-step time of epoch e",
            "ratio_begin_to_end": "(on_train_batch_end - on_train_batch_begin of epoch e's first step) / steady step",
            "boundary_steps": "(first step end of e - last step end of e-1 - validation's on_test_begin..on_test_end)"
                              " / steady step",
            "spread": "median, min, max over all counted epochs of all rounds; ratio_per_round: over per-round "
                      "medians"},
        "summary": per_kind, "runs": runs,
    }


def report(record: dict) -> None:
    print(f"\nfit with validation, global batch {record['global_batch']}, {record['counted_epochs']} counted epochs x "
          f"{record['rounds']} rounds:")
    for kind, s in record["summary"].items():
        r, rr, st = s["ratio"], s["ratio_per_round"], s["steady_step_s"]
        where = f"{s['replicas']} replicas in {s['processes']} process{'es' if s['processes'] > 1 else ''}"
        print(f"  {LABELS[kind]} ({where}): first step after validation / steady step: {r['median']:.1f} "
              f"(epochs {r['min']:.1f}-{r['max']:.1f}; per-round medians {rr['min']:.1f}-{rr['max']:.1f}); "
              f"steady step {1000 * st['median']:.1f} ms; boundary outside validation "
              f"{s['boundary_steps']['median']:.1f} steps; fit {s['fit_seconds']['median']:.1f} s "
              f"({s['fit_seconds']['min']:.1f}-{s['fit_seconds']['max']:.1f}); target <= {record['target_ratio']:g}: "
              f"{'PASS' if s['met'] else 'MISS'}")


def plot(record: dict, path: str) -> None:
    from benchmarks.common import save_figure
    from tfdist.plots import pyplot

    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    kinds = list(record["summary"])
    colors = {"stock": "tab:gray", "tfdist": "tab:green", "multiworker": "tab:orange", "horovod": "tab:purple",
              "multiworker-tf-iterators": "tab:brown", "horovod-tf-iterators": "tab:pink"}
    for k, kind in enumerate(kinds):
        for r, run in enumerate(record["runs"][kind]):
            xs = [e["epoch"] + 0.08 * (r - 1) + 0.2 * (k - (len(kinds) - 1) / 2) for e in run["epochs"]]
            ax.plot(xs, [e["ratio"] for e in run["epochs"]], "o", ms=4, color=colors[kind], alpha=0.7,
                    label=f"{LABELS[kind]} (median {record['summary'][kind]['ratio']['median']:.1f})" if r == 0
                    else None)
    ax.axhline(record["target_ratio"], color="k", ls="--", lw=1, label=f"target {record['target_ratio']:g}")
    ax.set_yscale("log")
    ax.set_xlabel("epoch")
    ax.set_ylabel("first step after validation / steady step")
    ax.set_title("each epoch of each round", fontsize=10)
    ax.legend(fontsize=8)
    width = 0.8 / len(kinds)
    parts = [("steady_step_s", "steady step"), ("first_step_after_validation_s", "first step after validation")]
    for k, kind in enumerate(kinds):
        s = record["summary"][kind]
        ax2.bar([i + (k - (len(kinds) - 1) / 2) * width for i in range(len(parts))], [1000 * s[p]["median"] for p, _ in parts], width,
                color=colors[kind], label=LABELS[kind],
                yerr=[[1000 * (s[p]["median"] - s[p]["min"]) for p, _ in parts],
                      [1000 * (s[p]["max"] - s[p]["median"]) for p, _ in parts]], capsize=4)
    ax2.set_yscale("log")
    ax2.set_xticks(range(len(parts)), [label for _, label in parts])
    ax2.set_ylabel("ms (median, min-max over epochs)")
    ax2.set_title(f"global batch {record['global_batch']}, "
                  f"{record['counted_epochs']} epochs x {record['rounds']} rounds", fontsize=10)
    ax2.legend(fontsize=8)
    save_figure(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.processes import worker_or_driver_main

    return worker_or_driver_main("python -m benchmarks.epoch_boundary", HELP, add_arguments, _worker, run, argv)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
