"""`tfdist bench allreduce`: all-reduce bus bandwidth between local processes (TF RING over gRPC, or Horovod)."""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import statistics
import sys
import tempfile
import time

NAME = "allreduce"
HELP = "all-reduce bus bandwidth between local processes: TF MultiWorkerMirroredStrategy RING (gRPC) or Horovod"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="tf", choices=("tf", "horovod"),
                   help="tf: MultiWorkerMirroredStrategy RING over gRPC; horovod: hvd.allreduce")
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1.0, 16.0, 64.0], help="tensor sizes in MiB")
    p.add_argument("--iters", type=int, default=10, help="timed all-reduces per size (the median is reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed all-reduces per size first")
    p.add_argument("-n", "--num-workers", type=int, default=2, help="processes (default 2)")
    p.add_argument("--json", default="bench_allreduce.json", help="where to write the JSON record")
    p.add_argument("--link-rates", nargs="+", default=None, metavar="RATE",
                   help="run on emulated nodes linked at each RATE (e.g. 1gbit 10gbit; root only) and report bus "
                        "bandwidth / link rate, next to raw TCP over the same link (--backend horovod: Gloo)")
    horovod = p.add_argument_group("--backend horovod", "raw hvd.allreduce vs HorovodStrategy's gradient path "
                                   "vs mpi4py, under mpirun and then Horovod's Gloo controller")
    horovod.add_argument("--rounds", type=int, default=3, help="interleaved rounds per engine and size")
    horovod.add_argument("--no-gloo", action="store_true", help="skip the run under Horovod's Gloo controller")
    horovod.add_argument("--cycle-time-ms", type=float, default=None,
                         help="HOROVOD_CYCLE_TIME of the ranks (Horovod's default 1 ms; small messages wait for it)")


def run(args: argparse.Namespace) -> int:
    from tfdist.errors import ConfigError

    if args.iters < 1 or args.num_workers < 2 or any(s <= 0 for s in args.sizes_mb):
        raise ConfigError(f"need --iters >= 1, -n >= 2 and sizes > 0; got --iters {args.iters}, "
                          f"-n {args.num_workers}, --sizes-mb {args.sizes_mb}.")
    if args.backend == "horovod":
        try:
            module = importlib.import_module("tfdist.bench.allreduce_horovod")
        except ImportError as err:
            raise ConfigError(f"--backend horovod needs tfdist.bench.allreduce_horovod and Horovod ({err}); "
                              "install the horovod extra (make horovod) or use --backend tf.") from None
        args.np = args.num_workers
        module.run(args)  # prints its side-by-side table and ratios, writes the JSON
        return 0
    if args.link_rates:
        from tfdist.bench.allreduce_tcp import tcp_both_ways
        from tfdist.cluster.emulated_network import parse_rate

        for rate in args.link_rates:
            parse_rate(rate)  # a bad rate fails before any worker starts
        links = []
        for rate in args.link_rates:
            link = _run_tf(args, rate)
            link["tcp"] = tcp_both_ways(rate, int(max(args.sizes_mb) * 2**20))  # the ceiling on the same link
            links.append(link)
        record = {"benchmark": NAME, "backend": "tf", "links": links}
        for link in record["links"]:
            _report(link)
    else:
        record = _run_tf(args)
        _report(record)
    from tfdist.bench.common import write_json

    write_json(args.json, record)
    return 0


def _run_tf(args: argparse.Namespace, link_rate: str | None = None) -> dict:
    from tfdist.bench.common import machine
    from tfdist.bench.processes import module_command, run_workers
    from tfdist.errors import ConfigError

    with tempfile.TemporaryDirectory(prefix="tfdist-allreduce-") as tmp:
        result_path = os.path.join(tmp, "rank0.json")
        cmd = module_command("tfdist.bench.allreduce", worker=result_path, iters=args.iters, warmup=args.warmup,
                             sizes_mb=args.sizes_mb)
        log = io.StringIO()
        code = run_workers(cmd, args.num_workers, launcher="tf", out=log, link_rate=link_rate)
        if code != 0 or not os.path.exists(result_path):
            raise ConfigError(f"all-reduce workers failed (exit code {code}):\n{log.getvalue()[-3000:]}")
        with open(result_path) as f:
            results = json.load(f)
    burst = None
    if link_rate is not None:
        from tfdist.cluster.emulated_network import parse_rate, tbf_burst_bytes

        burst = tbf_burst_bytes(parse_rate(link_rate))

        for r in results:  # bus bandwidth as a share of each node's link: what a ring can at most carry
            r["busbw_over_link"] = r["busbw_gbps"] * 8e9 / parse_rate(link_rate)
    return {"benchmark": NAME, "backend": "tf", "engine": "tf.distribute.MultiWorkerMirroredStrategy, RING over gRPC",
            "link_rate": link_rate or "loopback", "tbf_burst_bytes": burst,
            "num_workers": args.num_workers, "dtype": "float32", "iters": args.iters, "warmup": args.warmup,
            "busbw_formula": "2(N-1)/N * bytes / median time", "results": results, "machine": machine()}


def _report(record: dict) -> None:
    print(f"all-reduce, {record.get('engine', record.get('backend'))}, {record.get('num_workers')} processes, "
          f"median of {record.get('iters')}")
    link = record.get("link_rate", "loopback")
    print(f"link: {link}")
    print(f"{'size':>8s} {'median':>10s} {'busbw':>11s}" + ("  busbw/link" if link != "loopback" else ""))
    for r in record.get("results", []):
        share = f"  {r['busbw_over_link']:10.2f}" if "busbw_over_link" in r else ""
        print(f"{r['size_mb']:6g} MB {r['median_ms']:8.2f} ms {r['busbw_gbps']:7.3f} GB/s{share}")
    if "tcp" in record:
        tcp = record["tcp"]
        print(f"raw TCP over the same link, both ways, {tcp['bytes'] / 2**20:g} MB: "
              f"{tcp['goodput_over_link']:.2f} x link")


def _worker(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", required=True)
    p.add_argument("--iters", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--sizes-mb", type=float, nargs="+", required=True)
    args = p.parse_args(argv)

    import tfdist

    strategy = tfdist.MultiWorkerMirroredStrategy(communication="ring", timeout_s=300)  # first: before any op
    import tensorflow as tf

    from tfdist.bench.common import bus_bandwidth

    n = tfdist.cluster.world_size(strategy)
    results = []
    for size_mb in args.sizes_mb:
        count = int(size_mb * 2**20) // 4
        with strategy.scope():  # one copy per worker, made once: the timed step only reduces
            value = tf.Variable(tf.ones([count], tf.float32), trainable=False)

        @tf.function
        def allreduce():
            def replica():
                out = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, value.read_value())
                return out[0] + out[-1]  # a scalar to fetch: syncs on the whole result, copies nothing big

            return strategy.run(replica)

        def once() -> float:
            start = time.perf_counter()
            got = strategy.experimental_local_results(allreduce())[0].numpy()
            seconds = time.perf_counter() - start
            if got != 2 * n:  # every element sums to n
                raise RuntimeError(f"all-reduce returned {got / 2}, expected {n}")
            return seconds

        for _ in range(args.warmup):
            once()
        times = [once() for _ in range(args.iters)]
        median = statistics.median(times)
        nbytes = count * 4
        results.append({"size_mb": size_mb, "bytes": nbytes, "median_ms": 1000 * median,
                        "min_ms": 1000 * min(times), "busbw_gbps": bus_bandwidth(nbytes, median, n) / 1e9,
                        "algbw_gbps": nbytes / median / 1e9})
        if tfdist.cluster.is_chief(strategy):
            print(f"{size_mb:g} MB: median {1000 * median:.2f} ms", flush=True)
    if tfdist.cluster.is_chief(strategy):
        with open(args.worker, "w") as f:
            json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
