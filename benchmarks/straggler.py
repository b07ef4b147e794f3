"""`tfdist bench straggler`: images/s of asynchronous parameter-server training vs synchronous all-reduce
training when one of the 2 workers is slowed to a third of the other's speed.

Each worker process sits in its own cgroup (cgroup v1 CPU controller) with a CPU quota,
`cpu.cfs_quota_us / cpu.cfs_period_us`: by default worker 0 gets 0.6 CPU and worker 1 gets 0.2 CPU, so
the ratio is 3:1 whatever else runs on the machine. The same quotas apply to both jobs:

- async: `tfdist launch -n 2 --ps 1` (chief + 2 workers + 1 parameter server), `tfdist.ParameterServerStrategy`,
  `fit(dataset_fn, steps_per_epoch=2 x S)`; a step is one worker's batch of B images;
- sync: `tfdist launch -n 2`, `tfdist.MultiWorkerMirroredStrategy`, `fit(dataset, steps_per_epoch=S)`; a step
  is the global batch of 2 x B images, B on each worker.

"Images" are training images whose gradient was applied to the model: B per async step, 2 x B per sync
step. Both jobs train the example CNN on MNIST (Adam) for 2 epochs of the same number of images; the first
epoch is the warm-up, the second is timed (benchmarks.straggler_job). After training each job evaluates on
the MNIST test split, so the accuracies are compared after equal numbers of training images. The chief and
the parameter server get their own cgroups too, with no quota unless --service-cpus says so; the CPU time
every process used during the timed epoch is read from the cgroups (cpuacct) and reported.

The processes start unthrottled (importing TensorFlow and tracing the step function at 0.2 CPU would only
make the run longer): the quotas are switched on after the first few steps of the warm-up epoch, when the
job prints its marker line, and off again when the timed epoch ends. Runs alternate (async, sync, sync,
async, ...) for --rounds rounds; figures are medians over rounds with min-max spread. Needs root and a
cgroup v1 CPU controller (otherwise: a message and exit code 1); every cgroup made is removed at the end,
also after errors, Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time

from benchmarks.arguments import require_at_least
from benchmarks.cpu_groups import CPU_ROOT, CgroupsUnavailable, CpuGroups, cgroup_problem  # noqa: F401
from benchmarks.rounds import spread as _spread

NAME = "straggler"
HELP = ("images/s of async parameter-server training vs synchronous MultiWorkerMirroredStrategy, 2 workers, "
        "one slowed to a third of the other's speed by cgroup CPU quotas")
TARGET_RATIO = 1.5  # async >= 1.5 x sync
MODES = ("async", "sync")
IMAGES = ("training images whose gradient was applied: an async step is one worker's batch (batch_per_worker "
          "images), a sync step is the global batch (2 x batch_per_worker, one batch per worker); both jobs "
          "train on the same number of images")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fast-cpus", type=float, default=0.6, help="CPU quota of worker 0 (default 0.6)")
    p.add_argument("--slow-cpus", type=float, default=0.2, help="CPU quota of worker 1, the straggler (default 0.2)")
    p.add_argument("--service-cpus", type=float, default=None,
                   help="CPU quota of the async job's chief and of its parameter server, each (default: none)")
    p.add_argument("--period-us", type=int, default=100_000, help="cpu.cfs_period_us of the quotas (default 100000)")
    p.add_argument("--batch-size", type=int, default=64, help="images per worker per step, B (default 64)")
    p.add_argument("--steps", type=int, default=40,
                   help="S: synchronous steps per epoch (the async job runs 2 x S one-worker steps per epoch, the "
                        "same images); one warm-up epoch, one timed (default 40)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of (async, sync) runs, interleaved (default 5)")
    p.add_argument("--learning-rate", type=float, default=1e-3, help="Adam learning rate of both jobs")
    p.add_argument("--max-in-flight", type=int, default=None,
                   help="async: ParameterServerStrategy(max_in_flight=...) (default: the strategy's, 2 per worker)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per job (default 300)")
    p.add_argument("--cgroup-root", default=CPU_ROOT, help=f"the cgroup v1 CPU controller (default {CPU_ROOT})")
    p.add_argument("--verbose", action="store_true", help="show the jobs' output")
    p.add_argument("--json", default="bench_straggler.json", help="where to write the JSON record")
    p.add_argument("--png", default="bench_straggler.png", help="where to write the bar chart (empty: none)")


# ---------------------------------------------------------------------------------------------- jobs


class JobFailed(RuntimeError):
    """One of the benchmark's jobs did not finish (its exit code and last lines are in the message)."""


# ---------------------------------------------------------------------------------------------- one job


class _Watcher:
    """The launcher's `out`: reacts to the job's marker lines (benchmarks.straggler_job) and keeps the
    last lines for error messages; prints every line with --verbose."""

    def __init__(self, on_mark, verbose: bool):
        self.on_mark, self.verbose = on_mark, verbose
        self.tail: collections.deque[str] = collections.deque(maxlen=80)

    def write(self, text: str) -> None:
        for line in text.splitlines():
            self.tail.append(line)
            if self.verbose:
                print(line, flush=True)
            self.on_mark(line.split("] ", 1)[-1].strip())

    def flush(self) -> None:
        pass


def run_job(mode: str, args: argparse.Namespace, groups: CpuGroups, out_path: str) -> dict:
    """Launches one async or sync job under the quotas and returns its record, with the CPU use of every
    task during the timed epoch."""
    from benchmarks import straggler_job as job
    from benchmarks.processes import module_command
    from tfdist.cluster.launcher import launch

    names = ["chief", "worker 0", "worker 1", "ps 0"] if mode == "async" else ["worker 0", "worker 1"]
    quotas = {"worker 0": args.fast_cpus, "worker 1": args.slow_cpus}
    if mode == "async":
        quotas.update({"chief": args.service_cpus, "ps 0": args.service_cpus})
    marks: dict[str, dict] = {}
    throttled = threading.Event()
    errors: list[str] = []

    def on_mark(text: str) -> None:
        # Runs in the launcher's output thread: an exception here would stop it reading the job's output.
        try:
            if text == job.MARK_THROTTLE:
                for name, cpus in quotas.items():
                    groups.set_quota(name, cpus)
                throttled.set()
            elif text in (job.MARK_START, job.MARK_END):
                marks[text] = {"time": time.perf_counter(), "cpu": groups.cpu_seconds(),
                               "stat": groups.throttling(), "members": {n: len(groups.members(n)) for n in names}}
                if text == job.MARK_END:  # nothing after the timed epoch is measured: the test evaluation
                    for name in quotas:   # and the processes' exits run at full speed
                        groups.set_quota(name, None)
        except OSError as err:
            errors.append(f"{text!r}: {type(err).__name__}: {err}")

    def on_start(procs) -> None:
        for name, proc in zip(names, procs):
            groups.move(name, proc.pid)

    cmd = module_command("benchmarks.straggler_job", mode=mode, batch_size=args.batch_size, steps=args.steps,
                         learning_rate=args.learning_rate, out=out_path,
                         max_in_flight=args.max_in_flight if mode == "async" else None)
    watcher = _Watcher(on_mark, args.verbose)
    env = {"TF_CPP_MIN_LOG_LEVEL": "2"}
    options = {"ps": 1, "max_restarts": 0} if mode == "async" else {}
    start = time.perf_counter()
    try:
        code = launch(cmd, 2, env=env, out=watcher, on_start=on_start, timeout_s=args.timeout, **options)
    finally:
        for name in names:
            groups.set_quota(name, None)  # the next job starts unthrottled
    wall = time.perf_counter() - start
    if errors:
        raise JobFailed(f"the {mode} job ran, but the cgroups could not be used: {'; '.join(errors)}")
    if code != 0 or not os.path.isfile(out_path) or len(marks) < 2 or not throttled.is_set():
        tail = "\n".join(watcher.tail)
        raise JobFailed(f"the {mode} job failed (exit code {code}{', timed out' if code == 124 else ''}); "
                        f"its last lines:\n{tail}")
    with open(out_path) as f:
        record = json.load(f)
    begin, end = marks[job.MARK_START], marks[job.MARK_END]
    window = end["time"] - begin["time"]
    record["job_seconds"] = wall
    record["members"] = begin["members"]
    if begin["cpu"] is not None:
        used = {n: end["cpu"][n] - begin["cpu"][n] for n in names}
        record["cpu_seconds"] = used
        record["cpus_used"] = {n: used[n] / window for n in names}  # average CPUs busy during the timed epoch
        record["images_per_cpu_second"] = record["timed_images"] / sum(used.values())  # all the job's processes
    record["throttled_periods"] = {n: end["stat"][n]["throttled"] - begin["stat"][n]["throttled"] for n in names}
    return record


# ---------------------------------------------------------------------------------------------- driver


def run(args: argparse.Namespace) -> int:
    """`tfdist bench straggler`: measure, print, write JSON and PNG. Exit 1 without root/cgroups."""
    _check(args)
    problem = cgroup_problem(args.cgroup_root)
    if problem:
        print(f"tfdist bench straggler: error: {problem}.", file=sys.stderr)
        return 1
    try:
        measure(args)
    except JobFailed as err:
        print(f"tfdist bench straggler: error: {err}", file=sys.stderr)
        return 1
    return 0


def _check(args: argparse.Namespace) -> None:
    from tfdist.errors import ConfigError

    for name in ("fast_cpus", "slow_cpus", "service_cpus"):
        value = getattr(args, name)
        if value is not None and not 0.01 <= value <= (os.cpu_count() or 1):
            raise ConfigError(f"--{name.replace('_', '-')} must be between 0.01 and {os.cpu_count()} CPUs, "
                              f"got {value}.")
    require_at_least(args, batch_size=1, steps=1, rounds=1, period_us=1000)


@contextlib.contextmanager
def _terminate_as_exit():
    """SIGTERM raises SystemExit while the benchmark runs, so the cgroups are removed (finally) then too."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def measure(args: argparse.Namespace) -> dict:
    """Runs --rounds interleaved rounds of the async and sync jobs, prints, writes JSON and PNG."""
    from benchmarks.common import interleaved, machine, write_json

    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    order: list[str] = []
    with _terminate_as_exit():
        groups = CpuGroups(["chief", "worker 0", "worker 1", "ps 0"], cpu_root=args.cgroup_root,
                           period_us=args.period_us)
        cgroup_paths = groups.paths()
        try:
            with tempfile.TemporaryDirectory(prefix="tfdist-straggler-") as tmp:

                def one(mode: str):
                    def go():
                        record = run_job(mode, args, groups, os.path.join(tmp, f"{mode}{len(runs[mode])}.json"))
                        runs[mode].append(record)
                        order.append(mode)
                        used = record.get("cpus_used", {})
                        cpu = ", ".join(f"{n} {c:.2f}" for n, c in used.items())
                        print(f"round {len(runs[mode]) - 1} {mode:5s}: {record['images_per_sec']:6.0f} images/s "
                              f"({record['timed_images']} images in {record['timed_seconds']:.2f} s), test accuracy "
                              f"{record['test_accuracy']:.4f}; CPUs used: {cpu}; job {record['job_seconds']:.0f} s",
                              flush=True)
                    return go

                interleaved({m: one(m) for m in MODES}, args.rounds)
        finally:
            groups.remove()
    record = summarize(args, runs, order, cgroup_paths)
    record["date"] = time.strftime("%Y-%m-%d")
    record["command"] = "tfdist bench straggler " + " ".join(sys.argv[3:] if sys.argv[1:3] == ["bench", NAME]
                                                             else sys.argv[1:])
    record["machine"] = machine()
    report(record)
    write_json(args.json, record)
    if args.png:
        plot(record, args.png)
    return record


def summarize(args: argparse.Namespace, runs: dict[str, list[dict]], order: list[str], paths: list[str]) -> dict:
    ips = {m: _spread([r["images_per_sec"] for r in runs[m]]) for m in MODES}
    accuracy = {m: _spread([r["test_accuracy"] for r in runs[m]]) for m in MODES}
    per_round = [a["images_per_sec"] / s["images_per_sec"] for a, s in zip(runs["async"], runs["sync"])]
    ratio = ips["async"]["median"] / ips["sync"]["median"]
    cpus, per_cpu = {}, {}
    for m in MODES:
        if all("cpus_used" in r for r in runs[m]):
            cpus[m] = {n: statistics.median(r["cpus_used"][n] for r in runs[m]) for n in runs[m][0]["cpus_used"]}
            per_cpu[m] = _spread([r["images_per_cpu_second"] for r in runs[m]])
    return {
        "benchmark": NAME, "model": "tfdist.models.cnn", "dataset": "mnist (4000 train / 1000 test)",
        "optimizer": f"Adam({args.learning_rate})",
        "workers": 2, "parameter_servers": 1,
        "quota_cpus": {"worker 0": args.fast_cpus, "worker 1": args.slow_cpus, "chief": args.service_cpus,
                       "ps 0": args.service_cpus},
        "cfs_period_us": args.period_us, "batch_per_worker": args.batch_size,
        "steps_per_epoch": {"async": 2 * args.steps, "sync": args.steps},
        "images_per_step": {"async": args.batch_size, "sync": 2 * args.batch_size},
        "timed_images": runs["async"][0]["timed_images"], "train_images": runs["async"][0]["train_images"],
        "images": IMAGES,
        "timing": "one fit of 2 equal epochs per job: the first is the warm-up, the second is timed (wall time "
                  "from the end of epoch 1 to the end of epoch 2, both ends waiting for every scheduled step); "
                  "process start-up is not timed",
        "max_in_flight": args.max_in_flight, "rounds": args.rounds, "order": order,
        "images_per_sec": ips, "ratio": ratio,
        "ratio_per_round": {"values": per_round, **_spread(per_round)},
        "target_ratio": TARGET_RATIO, "met": ratio >= TARGET_RATIO,
        "test_accuracy": accuracy, "cpus_used": cpus, "images_per_cpu_second": per_cpu,
        "cpu_note": "cpus_used: CPU time of each process (its cgroup's cpuacct.usage) during the timed epoch / the "
                    "epoch's wall time; images_per_cpu_second: timed images / CPU time of all the job's processes "
                    "(chief and parameter server included)",
        "runs": runs, "cgroups": paths,
    }


def report(record: dict) -> None:
    ips, acc = record["images_per_sec"], record["test_accuracy"]
    q = record["quota_cpus"]
    print(f"\n2 workers under CPU quotas {q['worker 0']:g} and {q['worker 1']:g} CPU, batch "
          f"{record['batch_per_worker']} per worker step, {record['timed_images']} images timed, median of "
          f"{record['rounds']} rounds (min-max):")
    for m in MODES:
        v, a = ips[m], acc[m]
        print(f"  {m:5s}: {v['median']:6.0f} images/s ({v['min']:.0f}-{v['max']:.0f}), test accuracy "
              f"{a['median']:.4f} ({a['min']:.4f}-{a['max']:.4f}) after {record['train_images']} images")
    rr = record["ratio_per_round"]
    print(f"  async / sync = {record['ratio']:.2f} (per round {rr['min']:.2f}-{rr['max']:.2f}); target >= "
          f"{record['target_ratio']:g}: {'PASS' if record['met'] else 'MISS'}")
    for m, used in record["cpus_used"].items():
        print(f"  CPUs used during the timed epoch, {m}: " + ", ".join(f"{n} {c:.2f}" for n, c in used.items())
              + f"; {record['images_per_cpu_second'][m]['median']:.0f} images per CPU-second of all its processes")


def plot(record: dict, path: str) -> None:
    from benchmarks.common import save_figure
    from tfdist.plots import pyplot

    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [1, 1.3]})
    ips, acc = record["images_per_sec"], record["test_accuracy"]
    medians = [ips[m]["median"] for m in MODES]
    errors = [[ips[m]["median"] - ips[m]["min"] for m in MODES], [ips[m]["max"] - ips[m]["median"] for m in MODES]]
    labels = ["async\n(ParameterServerStrategy)", "sync\n(MultiWorkerMirrored)"]
    bars = ax.bar(labels, medians, yerr=errors, capsize=6, color=["tab:green", "tab:gray"])
    for bar, m in zip(bars, MODES):
        ax.annotate(f"{ips[m]['median']:.0f}/s\nacc {acc[m]['median']:.3f}", (bar.get_x() + bar.get_width() / 2,
                    bar.get_height()), ha="center", va="bottom", fontsize=8, xytext=(0, 8), textcoords="offset points")
    for k, m in enumerate(MODES):
        values = [r["images_per_sec"] for r in record["runs"][m]]
        ax.scatter([k] * len(values), values, color="black", s=10, zorder=3, label="rounds" if k == 0 else None)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_ylim(0, max(ips[m]["max"] for m in MODES) * 1.35)
    ax.set_ylabel("training images / s (median, min-max)")
    q = record["quota_cpus"]
    ax.set_title(f"async / sync = {record['ratio']:.2f} (target ≥ {record['target_ratio']:g})\n"
                 f"workers at {q['worker 0']:g} and {q['worker 1']:g} CPU", fontsize=10)
    names = ["worker 0", "worker 1", "chief", "ps 0"]
    width = 0.38
    for k, m in enumerate(MODES):
        used = record["cpus_used"].get(m, {})
        ax2.bar([i + (k - 0.5) * width for i in range(len(names))], [used.get(n, 0.0) for n in names], width,
                label=m, color=["tab:green", "tab:gray"][k])
    for i, n in enumerate(names[:2]):
        ax2.plot([i - 0.45, i + 0.45], [q[n]] * 2, "k--", lw=1, label="quota" if i == 0 else None)
    ax2.set_xticks(range(len(names)), names)
    ax2.set_ylabel("CPUs busy during the timed epoch")
    ax2.set_title("where the CPU goes (median over rounds)", fontsize=10)
    ax2.legend(fontsize=8)
    save_figure(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.straggler", description=HELP)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
