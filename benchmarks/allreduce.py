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
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved rounds per engine and size (tf: tfdist's ring vs TF's default ring)")
    p.add_argument("--ring-piece-mb", type=float, default=2.0,
                   help="tf: also time tfdist's ring with MultiWorkerMirroredStrategy(ring_piece_mb=...) (default 2)")
    p.add_argument("-n", "--num-workers", type=int, default=2, help="processes (default 2)")
    p.add_argument("--json", default="bench_allreduce.json", help="where to write the JSON record")
    p.add_argument("--link-rates", nargs="+", default=None, metavar="RATE",
                   help="run on emulated nodes linked at each RATE (e.g. 1gbit 10gbit; root only) and report bus "
                        "bandwidth / link rate, next to raw TCP over the same link (--backend horovod: Gloo)")
    horovod = p.add_argument_group("--backend horovod", "raw hvd.allreduce vs HorovodStrategy's gradient path "
                                   "vs mpi4py, under mpirun and then Horovod's Gloo controller")
    horovod.add_argument("--no-gloo", action="store_true", help="skip the run under Horovod's Gloo controller")
    horovod.add_argument("--cycle-time-ms", type=float, default=None,
                         help="HOROVOD_CYCLE_TIME of the ranks (Horovod's default 1 ms; small messages wait for it)")


def run(args: argparse.Namespace) -> int:
    from tfdist.errors import ConfigError

    if args.iters < 1 or args.num_workers < 2 or any(s <= 0 for s in args.sizes_mb):
        raise ConfigError(f"need --iters >= 1, -n >= 2 and sizes > 0; got --iters {args.iters}, "
                          f"-n {args.num_workers}, --sizes-mb {args.sizes_mb}.")
    args.rounds = getattr(args, "rounds", 3)
    if args.rounds < 1:
        raise ConfigError(f"--rounds must be >= 1 (interleaved rounds per engine and size), got {args.rounds}.")
    args.ring_piece_mb = getattr(args, "ring_piece_mb", 2.0)
    if not args.ring_piece_mb >= 0.25:
        raise ConfigError(f"--ring-piece-mb must be >= 0.25 (a size in MB; 2 suits 1 Gbit/s), got {args.ring_piece_mb:g}.")
    if getattr(args, "cycle_time_ms", None) is not None and args.cycle_time_ms < 0:
        raise ConfigError(f"--cycle-time-ms must be >= 0 (Horovod's default is 1), got {args.cycle_time_ms:g}.")
    if args.backend == "horovod":
        try:
            module = importlib.import_module("benchmarks.allreduce_horovod")
        except ImportError as err:
            raise ConfigError(f"--backend horovod needs benchmarks.allreduce_horovod and Horovod ({err}); "
                              "install the horovod extra (make horovod) or use --backend tf.") from None
        args.np = args.num_workers
        module.run(args)  # prints its side-by-side table and ratios, writes the JSON
        return 0
    if args.link_rates:
        from benchmarks.allreduce_tcp import tcp_both_ways
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
    from benchmarks.allreduce_plot import plot, png_path
    from benchmarks.common import write_json

    write_json(args.json, record)
    if args.json:
        plot(record, png_path(args.json))
    return 0


def _run_tf(args: argparse.Namespace, link_rate: str | None = None) -> dict:
    from benchmarks.common import machine
    from benchmarks.processes import module_command, run_workers, sweep_timeout_s
    from tfdist.errors import ConfigError

    n = args.num_workers
    per_size = 3 * (args.warmup + args.iters * args.rounds)  # three engines, each `warmup` + `iters` per round
    with tempfile.TemporaryDirectory(prefix="tfdist-allreduce-") as tmp:
        result_path = os.path.join(tmp, "rank0.json")
        cmd = module_command("benchmarks.allreduce", worker=result_path, iters=args.iters, warmup=args.warmup,
                             rounds=args.rounds, sizes_mb=args.sizes_mb, ring_piece_mb=args.ring_piece_mb)
        log = io.StringIO()
        code = run_workers(cmd, n, launcher="tf", out=log, link_rate=link_rate,
                           timeout_s=sweep_timeout_s(args.sizes_mb, n, per_size, link_rate))
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
            r["stock_busbw_over_link"] = r["stock_busbw_gbps"] * 8e9 / parse_rate(link_rate)
            r["pieces_busbw_over_link"] = r["pieces_busbw_gbps"] * 8e9 / parse_rate(link_rate)
    return {"benchmark": NAME, "backend": "tf",
            "engine": "tfdist.MultiWorkerMirroredStrategy, RING over gRPC (subdivided)",
            "stock_engine": "TF's default ring: CollectiveReduceV2 with max_subdivs_per_device=-1",
            "pieces_engine": f"tfdist.MultiWorkerMirroredStrategy(ring_piece_mb={args.ring_piece_mb:g})",
            "ring_piece_mb": args.ring_piece_mb,
            "rounds": args.rounds,
            "link_rate": link_rate or "loopback", "tbf_burst_bytes": burst,
            "num_workers": args.num_workers, "dtype": "float32", "iters": args.iters, "warmup": args.warmup,
            "busbw_formula": "2(N-1)/N * bytes / median time", "results": results, "machine": machine()}


def _report(record: dict) -> None:
    print(f"all-reduce, {record.get('engine', record.get('backend'))}, {record.get('num_workers')} processes, "
          f"median of {record.get('iters')} x {record.get('rounds')} interleaved rounds; beside it "
          f"{record.get('pieces_engine', 'pieces')} and TF's default ring")
    link = record.get("link_rate", "loopback")
    print(f"link: {link}")
    on_link = link != "loopback"
    print(f"{'size':>8s} {'median':>10s} {'busbw':>11s}" + ("  busbw/link" if on_link else "")
          + f" {'pieces':>10s}" + (" pieces/link" if on_link else "")
          + f" {'stock TF':>10s}" + (" stock/link" if on_link else "") + "  tfdist speedup (min-max of rounds)")
    for r in record.get("results", []):
        share = f"  {r['busbw_over_link']:10.2f}" if on_link else ""
        stock_share = f" {r['stock_busbw_over_link']:10.2f}" if on_link else ""
        pieces_share = f" {r['pieces_busbw_over_link']:11.2f}" if on_link else ""
        ratio = r["speedup_over_stock"]
        print(f"{r['size_mb']:6g} MB {r['median_ms']:8.2f} ms {r['busbw_gbps']:7.3f} GB/s{share} "
              f"{r['pieces_median_ms']:7.2f} ms{pieces_share} {r['stock_median_ms']:7.2f} ms{stock_share}  "
              f"{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f}); pieces vs whole "
              f"{r['pieces_speedup']['median']:.2f} ({r['pieces_speedup']['min']:.2f}-{r['pieces_speedup']['max']:.2f})")
    if "tcp" in record:
        tcp = record["tcp"]
        print(f"raw TCP over the same link, both ways, {tcp['bytes'] / 2**20:g} MB: "
              f"{tcp['goodput_over_link']:.2f} x link")


# The stock engine's own collective group: above every strategy's keys (multiples of 100,000) and below
# tfdist.comm's (from 2**30).
STOCK_GROUP_KEY = (1 << 30) - 1


def _worker(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", required=True)
    p.add_argument("--iters", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--sizes-mb", type=float, nargs="+", required=True)
    p.add_argument("--ring-piece-mb", type=float, required=True)
    args = p.parse_args(argv)

    import tfdist

    strategy = tfdist.MultiWorkerMirroredStrategy(communication="ring", timeout_s=300)  # first: before any op
    import tensorflow as tf

    from benchmarks.common import bus_bandwidth, interleaved
    from benchmarks.rounds import spread
    from tfdist._compat.ring import ring_pieces

    n = tfdist.cluster.world_size(strategy)
    device = strategy.extended.worker_devices[0]
    instance = [0]
    results = []
    for size_mb in args.sizes_mb:
        count = int(size_mb * 2**20) // 4
        with strategy.scope():  # one copy per worker, made once: the timed step only reduces
            value = tf.Variable(tf.ones([count], tf.float32), trainable=False)
        with tf.device(device):
            local = tf.ones([count], tf.float32)

        def replica():
            out = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, value.read_value())
            return out[0] + out[-1]  # a scalar to fetch: syncs on the whole result, copies nothing big

        allreduce = tf.function(lambda: strategy.run(replica))
        pieces = tf.function(lambda: strategy.run(replica))  # traced below with ring_piece_mb set

        @tf.function
        def stock(key):
            # TF's own default: the ring sends each worker's share as one RPC (max_subdivs_per_device=-1, what
            # stock MultiWorkerMirroredStrategy runs)
            with tf.device(device):
                out = tf.raw_ops.CollectiveReduceV2(
                    input=local, group_size=n, group_key=STOCK_GROUP_KEY, instance_key=key, ordering_token=[],
                    merge_op="Add", final_op="Id", timeout_seconds=300.0, max_subdivs_per_device=-1)
                return out[0] + out[-1]

        def tfdist_once() -> float:
            return strategy.experimental_local_results(allreduce())[0].numpy()

        def pieces_once() -> float:
            return strategy.experimental_local_results(pieces())[0].numpy()

        with ring_pieces(strategy.extended, int(args.ring_piece_mb * 2**20)):
            pieces.get_concrete_function()  # traced as MultiWorkerMirroredStrategy(ring_piece_mb=...) would

        def stock_once() -> float:
            instance[0] += 1  # the same sequence on every worker
            return stock(tf.constant(instance[0])).numpy()

        engines = {"tfdist": tfdist_once, "pieces": pieces_once, "stock": stock_once}
        seconds: dict[str, list[list[float]]] = {name: [] for name in engines}
        for fn in engines.values():
            for _ in range(args.warmup):
                fn()

        def timed(name: str):
            def run() -> None:
                times = []
                for _ in range(args.iters):
                    start = time.perf_counter()
                    got = engines[name]()
                    times.append(time.perf_counter() - start)
                    if got != 2 * n:  # every element sums to n
                        raise RuntimeError(f"{name} all-reduce returned {got / 2}, expected {n}")
                seconds[name].append(times)
            return run

        interleaved({name: timed(name) for name in engines}, args.rounds)
        nbytes = count * 4
        entry = {"size_mb": size_mb, "bytes": nbytes}
        for name, rounds in seconds.items():
            flat = [t for times in rounds for t in times]
            median = statistics.median(flat)
            prefix = "" if name == "tfdist" else f"{name}_"
            entry.update({f"{prefix}median_ms": 1000 * median, f"{prefix}min_ms": 1000 * min(flat),
                          f"{prefix}busbw_gbps": bus_bandwidth(nbytes, median, n) / 1e9})
            if name == "tfdist":
                entry["algbw_gbps"] = nbytes / median / 1e9
        # tfdist's ring (subdivided) over TF's default, per round: how much the subdivision buys
        entry["speedup_over_stock"] = spread([statistics.median(s) / statistics.median(t)
                                              for t, s in zip(seconds["tfdist"], seconds["stock"])])
        # ring_piece_mb over the default, per round (> 1: pieces faster)
        entry["pieces_speedup"] = spread([statistics.median(t) / statistics.median(p)
                                          for t, p in zip(seconds["tfdist"], seconds["pieces"])])
        results.append(entry)
        if tfdist.cluster.is_chief(strategy):
            print(f"{size_mb:g} MB: median {entry['median_ms']:.2f} ms (pieces {entry['pieces_median_ms']:.2f} ms, "
                  f"stock TF {entry['stock_median_ms']:.2f} ms)",
                  flush=True)
    if tfdist.cluster.is_chief(strategy):
        with open(args.worker, "w") as f:
            json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
