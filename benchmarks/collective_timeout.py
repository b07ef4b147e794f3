"""`tfdist bench collective-timeout`: how a collective whose peer is alive but absent ends, with TensorFlow's own
op timeout (`timeout_seconds`) and with tfdist's bound (`tfdist.comm.deadline`: no op timeout, a timer that aborts
the process's collectives).

Each launch is 2 processes (`tfdist launch -n 2`, TF backend). Both run one all-reduce (the group is then resolved),
then rank 1 starts a second one that rank 0 never joins: rank 0 sleeps past the timeout and exits. Rank 1 prints how
its all-reduce ended. A launch counts as *raised* (rank 1 printed its DeadlineExceededError), *crashed* (a worker was
killed by a signal: TensorFlow's race after its own timeout, see docs/design.md) or *other*. `--concurrent` launches
run at once (load makes the race likelier), modes alternate round by round.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

NAME = "collective-timeout"
HELP = ("a collective whose peer is alive but absent: how often TensorFlow's op timeout and tfdist's abort end in "
        "a clear error or in a crash (interleaved rounds of concurrent 2-process launches)")
MODES = ("tf-timer", "abort")
MODULE = "benchmarks.collective_timeout"
GROUP_KEY = 0x7E_0000  # a group of its own, far from tfdist's and the strategies' keys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=10, help="rounds; each runs every mode once (default 10)")
    p.add_argument("--concurrent", type=int, default=2, help="launches at once per mode and round (default 2)")
    p.add_argument("--timeout-s", type=float, default=6.0, help="the collective's bound, seconds (default 6)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="timeout paths to compare")
    p.add_argument("--json", default="bench_collective_timeout.json", help="where to write the JSON record")
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # a worker's timeout path


def _worker(args: argparse.Namespace) -> None:
    import tfdist.comm as comm

    comm.init("tf", timeout_s=60)  # joins the job and starts the server; the ops below are raw ones
    import tensorflow as tf

    from tfdist.comm.deadline import bounded

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    device = f"/job:{resolver.task_type}/replica:0/task:{resolver.task_id}/device:CPU:0"
    timer = args.timeout_s if args.mode == "tf-timer" else 0.0

    def all_reduce(instance: int) -> tf.Tensor:
        with tf.device(device):
            return tf.raw_ops.CollectiveReduceV2(
                input=tf.ones([2]), group_size=2, group_key=GROUP_KEY, instance_key=instance, ordering_token=[],
                merge_op="Add", final_op="Id", timeout_seconds=timer)

    all_reduce(1)
    if comm.rank() == 0:
        time.sleep(args.timeout_s + 4.0)  # alive, but never joins the second all-reduce
        os._exit(0)  # no shutdown handshake: the peer's collectives are aborted
    began = time.monotonic()
    try:
        bounded(None if args.mode == "tf-timer" else args.timeout_s, lambda: all_reduce(2))
        print("NO ERROR", flush=True)
    except tf.errors.OpError as err:
        print(f"RAISED after {time.monotonic() - began:.2f} s: {type(err).__name__}", flush=True)
    time.sleep(1.5)  # TensorFlow's threads finish what the timeout started; a crash shows here
    os._exit(0)


def _launch(mode: str, timeout_s: float) -> dict:
    from benchmarks.processes import module_command, run_workers

    out = io.StringIO()
    command = module_command(MODULE, worker=True, mode=mode, timeout_s=timeout_s)
    code = run_workers(command, 2, out=out, timeout_s=timeout_s + 120.0)
    log = out.getvalue()
    raised = re.search(r"^\[1\] RAISED after ([\d.]+) s", log, re.M)
    killed = re.search(r"^\[launch\] worker \d+ \(pid \d+\) was killed by (SIG\w+)", log, re.M)
    outcome = "crashed" if killed else "raised" if raised and code == 0 else "other"
    return {"outcome": outcome, "exit": code, "signal": killed.group(1) if killed else None,
            "error_after_s": float(raised.group(1)) if raised else None,
            "log_tail": log[-1500:] if outcome == "other" else None}


def _driver(args: argparse.Namespace) -> dict:
    from benchmarks.common import machine, write_json

    launches: dict[str, list[dict]] = {mode: [] for mode in args.modes}
    with ThreadPoolExecutor(args.concurrent) as pool:
        for r in range(args.rounds):
            for mode in args.modes if r % 2 == 0 else reversed(args.modes):
                launches[mode] += pool.map(lambda _: _launch(mode, args.timeout_s), range(args.concurrent))
                counts = {o: sum(x["outcome"] == o for x in launches[mode]) for o in ("raised", "crashed", "other")}
                print(f"round {r + 1}/{args.rounds} {mode:8s}: {counts}", flush=True)
    summary = {}
    for mode, runs in launches.items():
        counts = {o: sum(x["outcome"] == o for x in runs) for o in ("raised", "crashed", "other")}
        after = [x["error_after_s"] for x in runs if x["error_after_s"] is not None]
        summary[mode] = {**counts, "launches": len(runs),
                         "error_after_s_median": statistics.median(after) if after else None}
        print(f"{mode:8s}: {len(runs)} launches, {counts['raised']} raised the error "
              f"(median after {summary[mode]['error_after_s_median']} s), {counts['crashed']} crashed, "
              f"{counts['other']} other")
    record = {"benchmark": NAME, "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "rounds": args.rounds, "concurrent": args.concurrent, "timeout_s": args.timeout_s,
              "summary": summary, "launches": launches}
    write_json(args.json, record)
    return record


def run(args: argparse.Namespace) -> int:
    if args.mode:
        _worker(args)
    else:
        _driver(args)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=HELP)
    add_arguments(parser)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    sys.exit(run(parser.parse_args()))
