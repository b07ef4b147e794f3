"""`tfdist bench network-scaling`: weak-scaling efficiency of a 10 M-parameter CNN on emulated 1 and 10 Gbit/s links.

Each node is a process in a network namespace of its own whose link is shaped by `tc tbf` at the rate
(`tfdist launch --link-rate`, tfdist.cluster.emulated_network), running tfdist.MultiWorkerMirroredStrategy
(benchmarks.network_scaling_job). Jobs: 1 node (the baseline), then every --nodes count at every --rates rate.
In every job, every variant: `plain` (one all-reduce after the whole backward), `buckets` (--bucket-cap-mb),
`fp16` (buckets sent as float16), `powersgd` (buckets through PowerSGD of rank --powersgd-rank).

A node is a fixed amount of compute: each node's process (and what it starts) sits in a cgroup with a CPU quota of
--cpus-per-node (default 0.5: on 2 cores, 4 nodes cannot each have a core), the 1-node baseline too. So the
efficiency measures communication, not CPU sharing -- as long as the machine has the quotas' CPUs free; the load
average before and after each job is recorded next to its figures.

Per job and variant: images/s (median of --rounds rounds, the variants interleaved ABBA inside each job, min/max
beside), weak-scaling efficiency = images/s at N nodes / (N x images/s of plain at 1 node), and the same against
the variant's own 1-node figure; from a profiler trace of node 0 (benchmarks.ddp_trace): the time its gradient
collectives ran per step and the share of it that overlapped the backward; the gradient bytes per step and the
bytes each node hands to the collectives for them (the hook's cut). Needs root (namespaces, tc, cgroups).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time

from benchmarks.rounds import MIN_ROUNDS, describe, spread

NAME = "network-scaling"
HELP = ("weak-scaling efficiency of a 10 M-parameter CNN, 1 node vs 2 and 4 on emulated 1 and 10 Gbit/s links: "
        "one all-reduce, buckets, fp16, PowerSGD")
VARIANTS = ("plain", "buckets", "fp16", "powersgd")
NOTE = ("every node runs under the same cgroup CPU quota (the 1-node baseline too), so a node is a fixed amount of "
        "compute and the efficiency measures communication, not CPU sharing; the machine must have the quotas' "
        "CPUs free (see load_average)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 4], help="node counts besides the 1-node baseline")
    p.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"], help="link rates (tc style)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="bucket size of the bucketed variants (DDP's 25)")
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--cpus-per-node", type=float, default=0.5, help="CPU quota of every node, the baseline too")
    p.add_argument("--batch-size", type=int, default=256, help="images per node per step (weak scaling)")
    p.add_argument("--dense-units", type=int, default=3200, help="the CNN's dense width (3200: 10.1 M parameters)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant and round (after 1 untimed)")
    p.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    p.add_argument("--profile-steps", type=int, default=3, help="steps per variant traced on node 0 (0: none)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per job")
    p.add_argument("--verbose", action="store_true", help="show the jobs' output")
    p.add_argument("--json", default="bench_network_scaling.json")
    p.add_argument("--png", default="bench_network_scaling.png", help="efficiency and hidden share per variant")


class _Tail:
    """The launcher's `out`: keeps the last lines (for errors), prints them with --verbose."""

    def __init__(self, verbose: bool):
        self.verbose = verbose
        self.lines: collections.deque[str] = collections.deque(maxlen=60)

    def write(self, text: str) -> None:
        for line in text.splitlines():
            self.lines.append(line)
            if self.verbose:
                print(line, flush=True)

    def flush(self) -> None:
        pass


def _check(args: argparse.Namespace) -> None:
    from tfdist.cluster.emulated_network import parse_rate
    from tfdist.errors import ConfigError

    if not args.nodes or min(args.nodes) < 2:
        raise ConfigError(f"--nodes must list node counts >= 2 (the 1-node baseline always runs), got {args.nodes}.")
    for rate in args.rates:
        parse_rate(rate)
    if not 0.01 <= args.cpus_per_node <= (os.cpu_count() or 1):
        raise ConfigError(f"--cpus-per-node must be between 0.01 and {os.cpu_count()} CPUs, got {args.cpus_per_node}.")
    for name, least in (("batch_size", 1), ("steps", 1), ("rounds", 1), ("dense_units", 1), ("powersgd_rank", 1)):
        if getattr(args, name) < least:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= {least}, got {getattr(args, name)}.")
    if not args.bucket_cap_mb > 0:
        raise ConfigError(f"--bucket-cap-mb must be > 0, got {args.bucket_cap_mb}.")


def _problem() -> str | None:
    from benchmarks.cpu_groups import cgroup_problem
    from tfdist.cluster.emulated_network import unavailable_reason

    reason = unavailable_reason()
    if reason:
        return f"emulated nodes cannot be made here: {reason}"
    problem = cgroup_problem()
    return None if problem is None else problem.replace("tfdist bench straggler", f"tfdist bench {NAME}")


def run_job(nodes: int, rate: str | None, args: argparse.Namespace, groups, out_path: str) -> dict:
    """One job of `nodes` nodes (each under its CPU quota) at link `rate` (None: one node, no link); its record."""
    from benchmarks.processes import module_command
    from tfdist.cluster.launcher import launch

    def on_start(procs) -> None:
        for i, proc in enumerate(procs):
            groups.move(f"node {i}", proc.pid)

    cmd = module_command("benchmarks.network_scaling_job", variants=args.variants, bucket_cap_mb=args.bucket_cap_mb,
                         powersgd_rank=args.powersgd_rank, batch_size=args.batch_size, dense_units=args.dense_units,
                         steps=args.steps, rounds=args.rounds, profile_steps=args.profile_steps,
                         timeout=args.timeout, out=out_path)
    tail = _Tail(args.verbose)
    load_before, cpu_before = os.getloadavg(), groups.cpu_seconds()
    start = time.perf_counter()
    code = launch(cmd, nodes, env={"TF_CPP_MIN_LOG_LEVEL": "2"}, out=tail, on_start=on_start,
                  timeout_s=args.timeout, link_rate=rate)
    if code != 0 or not os.path.isfile(out_path):
        last = "\n".join(tail.lines)
        raise RuntimeError(f"the {nodes}-node job at {rate} failed (exit code {code}); its last lines:\n{last}")
    with open(out_path) as f:
        record = json.load(f)
    seconds, cpu_after = time.perf_counter() - start, groups.cpu_seconds()
    record.update(rate=rate, job_seconds=seconds, load_average={"before": list(load_before),
                                                               "after": list(os.getloadavg())})
    # What each node's quota bought: its average CPUs over the whole job (start-up included), from cpuacct.
    record["cpus_used"] = None if cpu_before is None else [
        (cpu_after[f"node {i}"] - cpu_before[f"node {i}"]) / seconds for i in range(nodes)]
    return record


def summarize(jobs: list[dict], args: argparse.Namespace) -> dict:
    """Per job and variant: images/s, efficiencies, trace and bytes, from the jobs' records (baseline first)."""
    base = jobs[0]["variants"]
    base_plain = spread(base["plain"]["images_per_sec"])["median"] if "plain" in base else None
    out = []
    for job in jobs:
        n = job["nodes"]
        row = {"nodes": n, "rate": job["rate"], "load_average": job["load_average"], "job_seconds": job["job_seconds"],
               "cpus_used": job["cpus_used"], "variants": {}}
        for name, v in job["variants"].items():
            ips = spread(v["images_per_sec"])
            own = spread(base[name]["images_per_sec"])["median"]
            step = spread(v["step_ms"])
            row["variants"][name] = {
                "images_per_sec": ips, "step_ms": step,
                "exposed_ms": step["median"] - spread(base[name]["step_ms"])["median"],
                "efficiency": None if base_plain is None else ips["median"] / (n * base_plain),
                "efficiency_vs_own_1_node": ips["median"] / (n * own),
                "communication_ms": None if n == 1 or not v["trace"] else v["trace"]["comm_ms"],
                "hidden_fraction": None if n == 1 or not v["trace"] else v["trace"]["hidden_fraction"],
                "trace_steps": None if not v["trace"] else v["trace"]["steps"],
                "buckets": v["buckets"], "gradient_bytes": v["gradient_bytes"], "sent_bytes": v["sent_bytes"],
                "bytes_cut": v["gradient_bytes"] / v["sent_bytes"],
                "thread_cpu_s_per_step": v.get("thread_cpu_s_per_step"),
            }
        out.append(row)
    return {"parameters": jobs[0]["parameters"], "jobs": out}


def run(args: argparse.Namespace) -> int:
    from benchmarks.common import machine, write_json
    from benchmarks.cpu_groups import CpuGroups

    _check(args)
    problem = _problem()
    if problem:
        print(f"tfdist bench {NAME}: error: {problem}.", file=sys.stderr)
        return 1
    plan = [(1, None)] + [(n, rate) for rate in args.rates for n in sorted(set(args.nodes))]
    print(f"tfdist bench {NAME}: {NOTE}; {args.cpus_per_node} CPU per node.", flush=True)
    jobs = []
    groups = CpuGroups([f"node {i}" for i in range(max(args.nodes))])
    try:
        for i in range(max(args.nodes)):
            groups.set_quota(f"node {i}", args.cpus_per_node)
        with tempfile.TemporaryDirectory(prefix="tfdist-network-scaling-") as tmp:
            for n, rate in plan:
                try:
                    jobs.append(run_job(n, rate, args, groups, os.path.join(tmp, f"{n}-{rate}.json")))
                except RuntimeError as err:
                    print(f"tfdist bench {NAME}: error: {err}", file=sys.stderr)
                    return 1
                _print_job(jobs[-1], jobs[0])
    finally:
        groups.remove()
    result = summarize(jobs, args)
    _print_summary(result)
    record = {
        "benchmark": NAME, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": f"tfdist bench {NAME} " + " ".join(sys.argv[3:] if sys.argv[1:3] == ["bench", NAME]
                                                    else sys.argv[1:]),
        "model": f"tfdist.models.cnn(dense_units={args.dense_units}), SGD, MNIST 28x28 batches",
        "parameters": result["parameters"], "cpus_per_node": args.cpus_per_node, "note": NOTE,
        "batch_per_node": args.batch_size, "steps_per_round": args.steps, "rounds": args.rounds,
        "bucket_cap_mb": args.bucket_cap_mb, "powersgd_rank": args.powersgd_rank,
        "definitions": {
            "images_per_sec": "timed steps x global batch / their wall time on node 0 (the first step of each fit "
                              "untimed); median, min, max over rounds; variants interleaved ABBA within each job",
            "efficiency": "images/s at N nodes / (N x images/s of 'plain' at 1 node) (weak scaling)",
            "efficiency_vs_own_1_node": "images/s at N nodes / (N x images/s of the same variant at 1 node)",
            "communication_ms": "per step, the time node 0's gradient collectives ran (union of their intervals in "
                                "TF's profiler trace), median over the traced steps",
            "hidden_fraction": "share of communication_ms that overlapped node 0's backward ops",
            "exposed_ms": "median step time at N nodes - the same variant's at 1 node: communication (and waiting) "
                          "the step could not hide",
            "cpus_used": "per node, CPU seconds used (cgroup cpuacct) / the job's wall time, start-up included",
            "sent_bytes": "bytes per node handed to the collectives for one step's gradients (a ring all-reduce "
                          "moves 2(N-1)/N of them over each link)",
        },
        "jobs": result["jobs"], "machine": machine(),
    }
    write_json(args.json, record)
    if args.png:
        _plot(record, args.png)
    return 0


def _print_job(job: dict, base: dict) -> None:
    where = "1 node (baseline)" if job["rate"] is None else f"{job['nodes']} nodes at {job['rate']}"
    load, used = job["load_average"], job["cpus_used"]
    cpus = "" if used is None else ", CPUs used per node " + " ".join(f"{c:.2f}" for c in used)
    print(f"{where}: job {job['job_seconds']:.0f} s, load average {load['before'][0]:.2f} -> {load['after'][0]:.2f}"
          f"{cpus}", flush=True)


def _print_summary(result: dict) -> None:
    print(f"CNN of {result['parameters']:,} parameters")
    for job in result["jobs"]:
        where = "1 node" if job["rate"] is None else f"{job['nodes']} nodes, {job['rate']}"
        for name, v in job["variants"].items():
            eff = "" if v["efficiency"] is None else f"; efficiency {v['efficiency']:.2f}"
            hidden = "" if v["hidden_fraction"] is None else (
                f"; comm {v['communication_ms']:.0f} ms/step, {100 * v['hidden_fraction']:.0f}% hidden, "
                f"{v['exposed_ms']:.0f} ms exposed")
            print(f"{where:16s} {name:9s} images/s {describe(v['images_per_sec'], '{:.1f}')}{eff}{hidden}; "
                  f"bytes sent {v['sent_bytes']:,} of {v['gradient_bytes']:,} ({v['bytes_cut']:.1f}x cut)", flush=True)
            if v.get("thread_cpu_s_per_step"):
                top = list(v["thread_cpu_s_per_step"].items())[:4]
                print(f"{'':16s} {'':9s} node 0's CPU s/step by thread: "
                      + ", ".join(f"{g} {s:.3f}" for g, s in top), flush=True)


def _plot(record: dict, path: str) -> None:
    from tfdist.plots import pyplot

    plt = pyplot()
    jobs = [j for j in record["jobs"] if j["rate"] is not None]
    names = list(jobs[0]["variants"]) if jobs else []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / max(len(names), 1)
    labels = [f"{j['nodes']} nodes\n{j['rate']}" for j in jobs]
    for k, name in enumerate(names):
        xs = [i + k * width for i in range(len(jobs))]
        eff = [j["variants"][name]["efficiency"] or 0.0 for j in jobs]
        hidden = [100 * (j["variants"][name]["hidden_fraction"] or 0.0) for j in jobs]
        axes[0].bar(xs, eff, width, label=name)
        axes[1].bar(xs, hidden, width, label=name)
    for ax, title in ((axes[0], "weak-scaling efficiency (vs 1 node, plain)"),
                      (axes[1], "% of node 0's gradient communication hidden behind the backward")):
        ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(jobs))], labels)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    axes[0].axhline(1.0, color="0.5", lw=0.8)
    fig.suptitle(f"{record['parameters'] / 1e6:.1f} M-parameter CNN, {record['batch_per_node']} images/node/step, "
                 f"{record['cpus_per_node']} CPU per node (cgroup quota), {record['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
