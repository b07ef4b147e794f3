"""`tfdist bench allreduce --backend horovod`: bus bandwidth of raw Horovod, HorovodStrategy's gradient path, mpi4py.

Runs itself as 2 ranks (mpirun; then again under tfdist's launcher with Horovod's Gloo controller) and
measures, interleaved in one run, at each size: raw `hvd.allreduce` of one float32 tensor called from Python
(`horovod`), 10 chained `hvd.allreduce` inside one tf.function as a training step runs them (`horovod-step`,
time per all-reduce), the reduction of a Keras 3 fit step under `tfdist.HorovodStrategy`
(`replica_context.all_reduce(SUM)` on a list of gradient-shaped tensors totalling that size, as the optimizer
does), and mpi4py `Allreduce` on NumPy buffers beside Horovod. The oracle, `mpi4py`, is timed on the same ranks
before Horovod starts (its background thread negotiates over MPI every cycle and slows MPI traffic beside it).
Bus bandwidth = 2(N-1)/N x bytes / time (median of `iters` x `rounds`; each round's median gives the spread).
A timed call fetches one element of each result; the whole results are checked after the timing.

Standalone: `python -m benchmarks.allreduce_horovod --sizes-mb 1 16 64 --json out/allreduce_horovod.json`
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

NAME = "allreduce-horovod"
HELP = "all-reduce bus bandwidth: raw Horovod vs HorovodStrategy's gradient path vs mpi4py (2 ranks)"
TARGET_RATIO = 0.9  # HorovodStrategy >= 0.9 x raw Horovod at 16 MB
SMALL_TARGET = 0.5  # Horovod in a step >= 0.5 x mpi4py's bus bandwidth at 1 MB


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options beyond sizes_mb, iters and json (which `tfdist bench allreduce` defines)."""
    p.add_argument("--np", type=int, default=2, help="ranks (processes) to run (default 2)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per engine and size (default 3)")
    p.add_argument("--no-gloo", action="store_true", help="skip the second run under Horovod's Gloo controller")
    p.add_argument("--cycle-time-ms", type=float, default=None,
                   help="HOROVOD_CYCLE_TIME of the ranks (Horovod's default: 1 ms); sets how long an all-reduce "
                        "can wait for Horovod's background thread, which dominates small messages")


def _base_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16, 64], help="message sizes in MB")
    p.add_argument("--iters", type=int, default=10, help="timed all-reduces per engine, size and round")
    p.add_argument("--json", default="bench_allreduce_horovod.json", help="where to write the JSON record")


def _grad_shapes(total_floats: int) -> list[list[int]]:
    # A CNN-like gradient list: a few large kernels, a few small ones and biases, summing exactly
    # to `total_floats` (4 bytes each).
    shares = [0.55, 0.25, 0.12, 0.05, 0.02]
    sizes = [max(1, int(total_floats * s)) for s in shares]
    biases = [128, 64, 32, 10]
    sizes.append(total_floats - sum(sizes) - sum(biases))
    shapes = [[n // 64, 64] if n % 64 == 0 and n >= 64 else [n] for n in sizes] + [[b] for b in biases]
    assert sum(math.prod(s) for s in shapes) == total_floats
    return shapes


STEP_CHAIN = 10  # all-reduces per call of the "in a step" engine


def _mpi4py_alone(args: argparse.Namespace) -> tuple[object, dict[str, list[float]]]:
    """mpi4py `Allreduce` timed on these ranks before Horovod starts (COMM_WORLD, or None off mpirun).

    Not interleaved with Horovod's engines: once Horovod runs, its background thread negotiates over MPI every cycle
    (HOROVOD_CYCLE_TIME), which slows mpi4py's Allreduce beside it (the `mpi4py-beside-horovod` engine shows by how
    much). The oracle is what MPI does here on its own."""
    import numpy as np

    if "OMPI_COMM_WORLD_SIZE" not in os.environ and "PMI_SIZE" not in os.environ:
        return None, {}
    try:
        from mpi4py import MPI
    except ImportError:
        return None, {}
    comm, timings = MPI.COMM_WORLD, {}
    for size_mb in args.sizes_mb:
        send = np.full(int(size_mb * 1024 * 1024 / 4), comm.Get_rank() + 1, np.float32)
        recv = np.empty_like(send)
        comm.Allreduce(send, recv)
        seconds = []
        for _ in range(args.rounds):
            comm.Barrier()
            for _ in range(args.iters):
                start = time.perf_counter()
                comm.Allreduce(send, recv)
                seconds.append(time.perf_counter() - start)
        timings[str(size_mb)] = seconds
    return comm, timings


def _worker(args: argparse.Namespace) -> None:
    """One rank: measure every engine at every size, rank 0 writes the raw timings."""
    import numpy as np

    comm, alone = _mpi4py_alone(args)  # first: before TensorFlow's and Horovod's threads exist
    import tensorflow as tf

    import tfdist
    from benchmarks.common import interleaved
    from tfdist.comm.horovod import horovod

    tf.config.threading.set_inter_op_parallelism_threads(2)
    strategy = tfdist.HorovodStrategy()
    hvd = horovod()
    n = hvd.size()
    if not hvd.mpi_enabled():
        comm = None

    @tf.function
    def raw(x):
        return hvd.allreduce(x, op=hvd.Sum)

    @tf.function
    def in_a_step(x):
        # STEP_CHAIN all-reduces, each waiting for the one before, inside one graph as a training step runs
        # them: no Python, no eager dispatch between them. Sum, as the other engines: Average would add a scaling
        # pass over the buffer (Horovod's ScaleBuffer, in a perf profile). The values grow by n per link: exact.
        for i in range(STEP_CHAIN):
            x = hvd.allreduce(x, op=hvd.Sum, name=f"bench_chain_{i}")
        return x

    @tf.function
    def strategy_step(grads):
        def step(gs):  # what Keras 3's optimizer does: one all_reduce(SUM) over all gradients
            return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, gs)
        return strategy.run(step, args=(grads,))

    def barrier():
        hvd.allreduce(tf.zeros([1]), op=hvd.Sum, name="bench_barrier")

    timings: dict[str, dict[str, list[float]]] = {}
    for size_mb in args.sizes_mb:
        floats = int(size_mb * 1024 * 1024 / 4)
        # Every rank sends rank + 1 everywhere: each engine's result must be n(n+1)/2 everywhere (checked below).
        x = tf.fill([floats], float(hvd.rank() + 1))
        grads = [tf.fill(s, float(hvd.rank() + 1)) for s in _grad_shapes(floats)]
        send = np.full(floats, hvd.rank() + 1, np.float32)
        recv = np.empty_like(send)
        # Each timed call fetches one element per result, enough to wait for it (as the TF benchmark does): a
        # whole result's copy into NumPy is host memory traffic, not communication (256 MB: 0.85 vs 0.94 x a
        # 1 Gbit/s link). The whole results are checked after the timing.
        engines = {
            "horovod": (lambda: raw(x)[-1].numpy(), 1),
            "horovod-step": (lambda: in_a_step(x)[-1].numpy(), STEP_CHAIN),
            "strategy": (lambda: [g[-1].numpy() for g in strategy_step(grads)], 1),
        }
        if comm is not None:
            engines["mpi4py-beside-horovod"] = (lambda: comm.Allreduce(send, recv), 1)
        for fn, _ in engines.values():  # trace and warm up, identical order on all ranks
            fn()
            fn()
        per_engine = {name: [] for name in engines}

        def timed(name: str):
            def run() -> None:
                fn, count = engines[name]
                barrier()
                for _ in range(args.iters):
                    start = time.perf_counter()
                    fn()
                    per_engine[name].append((time.perf_counter() - start) / count)
            return run

        interleaved({name: timed(name) for name in engines}, args.rounds)
        if str(size_mb) in alone:
            per_engine["mpi4py"] = alone[str(size_mb)]
        timings[str(size_mb)] = per_engine
        _check_results(size_mb, n, raw(x).numpy(), [g.numpy() for g in strategy_step(grads)],
                       recv if comm is not None else None)
        chained, want = in_a_step(x).numpy(), n * (n + 1) / 2 * n ** (STEP_CHAIN - 1)
        if chained.min() != want or chained.max() != want:
            raise RuntimeError(f"{STEP_CHAIN} chained hvd.allreduce(Sum) returned "
                               f"{sorted({float(chained.min()), float(chained.max())})}, expected {want} everywhere")
    if hvd.rank() == 0:
        with open(args.json, "w") as f:
            json.dump({"ranks": n, "controller": "mpi" if hvd.mpi_enabled() else "gloo", "timings": timings,
                       "iters": args.iters, "rounds": args.rounds,
                       "cycle_time_ms": float(os.environ["HOROVOD_CYCLE_TIME"])
                       if "HOROVOD_CYCLE_TIME" in os.environ else None,
                       "fusion_threshold_bytes": int(os.environ["HOROVOD_FUSION_THRESHOLD"])
                       if "HOROVOD_FUSION_THRESHOLD" in os.environ else None}, f)


def _cycle_text(cycle_time_ms: float | None) -> str:
    return "Horovod's default (1 ms)" if cycle_time_ms is None else f"{cycle_time_ms:g} ms"


def _check_results(size_mb: float, n: int, raw, strategy: list, mpi4py) -> None:
    """Each engine's last result: every element n(n+1)/2 (ranks sent rank + 1), or RuntimeError naming it."""
    want = n * (n + 1) / 2
    results = {"hvd.allreduce": [raw], "HorovodStrategy": strategy}
    if mpi4py is not None:
        results["mpi4py"] = [mpi4py]
    for engine, arrays in results.items():
        if any(a.min() != want or a.max() != want for a in arrays):
            got = sorted({float(a.min()) for a in arrays} | {float(a.max()) for a in arrays})
            raise RuntimeError(f"{engine} all-reduce of {size_mb:g} MB returned values {got}, expected {want} "
                               f"everywhere")


def _launch(args: argparse.Namespace, controller: str, out: str, link_rate: str | None = None) -> dict:
    """Runs the ranks under `controller` ("mpi": mpirun; "gloo": tfdist's launcher with Horovod's Gloo
    rendezvous, on emulated nodes linked at `link_rate` if given) and returns what rank 0 wrote to `out`."""
    from benchmarks.processes import TIMED_OUT, module_command, run_workers, sweep_timeout_s
    from tfdist.errors import TfdistError

    cmd = module_command("benchmarks.allreduce_horovod", worker=True, sizes_mb=args.sizes_mb, iters=args.iters,
                         rounds=args.rounds, json=out)
    # Per size, each engine runs 2 warm-up calls and `iters` per round: STEP_CHAIN all-reduces for the in-a-step
    # engine, one each for raw Horovod, the strategy and mpi4py (under mpirun).
    per_size = (2 + args.iters * args.rounds) * (STEP_CHAIN + 3)
    launcher = "mpirun" if controller == "mpi" else "horovod"
    # faulthandler: a rank that dies of a signal (a SIGSEGV at start-up, say) prints its Python stacks.
    env = {"PYTHONFAULTHANDLER": "1"}
    if getattr(args, "cycle_time_ms", None) is not None:
        env["HOROVOD_CYCLE_TIME"] = f"{args.cycle_time_ms:g}"
    timeout_s = sweep_timeout_s(args.sizes_mb, args.np, per_size, link_rate)
    code = run_workers(cmd, args.np, launcher=launcher, mpirun_options=["--oversubscribe"], env=env,
                       link_rate=link_rate, timeout_s=timeout_s)
    if code != 0:
        signal = f" (killed by signal {code - 128}; the ranks' stacks are above)" if code > 128 else ""
        timed_out = (f" (over its {timeout_s:.0f} s limit, sized from --sizes-mb, --iters and --rounds)"
                     if code == TIMED_OUT else "")
        raise TfdistError(f"benchmark ranks failed under {launcher}: exit code {code}{signal}{timed_out}")
    with open(out) as f:
        return json.load(f)


def run(args: argparse.Namespace) -> dict:
    """Launches the ranks, prints the table and ratios, writes JSON; returns the record."""
    import statistics

    from benchmarks.allreduce_plot import plot, png_path
    from benchmarks.common import bus_bandwidth, machine, write_json
    from benchmarks.rounds import spread

    if getattr(args, "link_rates", None):
        return run_links(args)
    for name, default in (("np", 2), ("rounds", 3), ("no_gloo", False)):
        if not hasattr(args, name):
            setattr(args, name, default)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="tfdist-bench-") as tmp:
        for controller in ("mpi",) + (() if args.no_gloo else ("gloo",)):
            runs[controller] = _launch(args, controller, os.path.join(tmp, f"{controller}.json"))
    n = args.np
    results: dict[str, dict[str, dict]] = {}
    for controller, data in runs.items():
        for size, per_engine in data["timings"].items():
            for engine, seconds in per_engine.items():
                label = engine if engine.startswith("mpi4py") else f"{engine}-{controller}"
                size = f"{float(size):g}"
                t = statistics.median(seconds)
                nbytes = float(size) * 1024 * 1024
                # each round's median: the spread printed beside the figure
                per_round = [statistics.median(seconds[i:i + data["iters"]])
                             for i in range(0, len(seconds), data["iters"])] if data.get("iters") else [t]
                results.setdefault(label, {})[size] = {
                    "median_ms": 1000 * t, "busbw_gbps": bus_bandwidth(nbytes, t, n) / 1e9, "samples": len(seconds),
                    "round_busbw_gbps": spread([bus_bandwidth(nbytes, r, n) / 1e9 for r in per_round])}
    sizes = [f"{float(s):g}" for s in args.sizes_mb]
    print(f"all-reduce bus bandwidth, {n} ranks, float32, median of {args.iters} x {args.rounds} rounds (GB/s)")
    print(f"{'engine':26s}" + "".join(f"{s + ' MB (min-max of rounds)':>30s}" for s in sizes))
    for label, per_size in results.items():
        cells = [f"{per_size[s]['busbw_gbps']:.2f} ({per_size[s]['round_busbw_gbps']['min']:.2f}-"
                 f"{per_size[s]['round_busbw_gbps']['max']:.2f})" for s in sizes]
        print(f"{label:26s}" + "".join(f"{c:>30s}" for c in cells))
    ratios = {}
    for controller in runs:
        raw, ours = results.get(f"horovod-{controller}"), results.get(f"strategy-{controller}")
        if raw and ours:
            ratios[f"strategy/horovod ({controller})"] = {
                s: ours[s]["busbw_gbps"] / raw[s]["busbw_gbps"] for s in sizes}
    if "mpi4py" in results:
        for label in ("horovod-mpi", "horovod-step-mpi", "strategy-mpi", "mpi4py-beside-horovod",
                      "horovod-gloo", "horovod-step-gloo", "strategy-gloo"):
            if label in results:
                ratios[f"{label}/mpi4py"] = {
                    s: results[label][s]["busbw_gbps"] / results["mpi4py"][s]["busbw_gbps"] for s in sizes}
    print("ratios:")
    for name, per_size in ratios.items():
        print(f"  {name:30s}" + "".join(f"{per_size[s]:12.2f}" for s in sizes))
    key = "16" if "16" in sizes else None
    verdict = None
    if key and "strategy/horovod (mpi)" in ratios:
        r = ratios["strategy/horovod (mpi)"][key]
        verdict = r >= TARGET_RATIO
        print(f"HorovodStrategy / raw Horovod at 16 MB (MPI) = {r:.3f} (target >= {TARGET_RATIO}): "
              f"{'PASS' if verdict else 'MISS'}")
    small = None
    if "1" in sizes and "horovod-step-mpi/mpi4py" in ratios:
        small = ratios["horovod-step-mpi/mpi4py"]["1"]
        print(f"Horovod at 1 MB in a step / mpi4py alone (MPI) = {small:.3f} (target >= {SMALL_TARGET}): "
              f"{'PASS' if small >= SMALL_TARGET else 'MISS'}"
              f"; cycle time {_cycle_text(runs['mpi'].get('cycle_time_ms'))}")
    record = {"benchmark": "allreduce", "backend": "horovod", "ranks": n, "sizes_mb": args.sizes_mb,
              "cycle_time_ms": {c: r.get("cycle_time_ms") for c, r in runs.items()},
              "horovod_step_over_mpi4py_1mb": small, "target_horovod_over_mpi4py_1mb": SMALL_TARGET,
              "fusion_threshold_bytes": {c: r.get("fusion_threshold_bytes") for c, r in runs.items()},
              "iters": args.iters, "rounds": args.rounds, "results": results, "ratios": ratios,
              "target_strategy_over_horovod_16mb": TARGET_RATIO, "pass": verdict, "machine": machine()}
    write_json(args.json, record)
    if args.json:
        plot(record, png_path(args.json))
    return record


def run_links(args: argparse.Namespace) -> dict:
    """`--link-rates`: the ranks on emulated nodes (Gloo through tfdist's launcher: mpirun cannot start a rank per
    network namespace), one run per rate, with raw TCP over the same link as the ceiling. Writes JSON, returns it."""
    import statistics

    from benchmarks.allreduce_plot import plot, png_path
    from benchmarks.allreduce_tcp import tcp_both_ways
    from benchmarks.common import bus_bandwidth, machine, write_json
    from tfdist.cluster.emulated_network import parse_rate, tbf_burst_bytes

    for name, default in (("np", 2), ("rounds", 3)):
        if not hasattr(args, name):
            setattr(args, name, default)
    links = []
    for rate in args.link_rates:
        with tempfile.TemporaryDirectory(prefix="tfdist-bench-") as tmp:
            data = _launch(args, "gloo", os.path.join(tmp, "gloo.json"), link_rate=rate)
        link = parse_rate(rate)
        results: dict[str, dict[str, dict]] = {}
        for size, per_engine in data["timings"].items():
            nbytes = float(size) * 1024 * 1024
            for engine, seconds in per_engine.items():
                t = statistics.median(seconds)
                busbw = bus_bandwidth(nbytes, t, args.np)
                results.setdefault(f"{engine}-gloo", {})[f"{float(size):g}"] = {
                    "median_ms": 1000 * t, "busbw_gbps": busbw / 1e9, "busbw_over_link": busbw * 8 / link,
                    "samples": len(seconds)}
        tcp = tcp_both_ways(rate, int(max(args.sizes_mb) * 2**20))
        links.append({"link_rate": rate, "tbf_burst_bytes": tbf_burst_bytes(link), "results": results, "tcp": tcp})
        print(f"link {rate}: bus bandwidth / link rate, {args.np} ranks on emulated nodes, Gloo, median of "
              f"{args.iters} x {args.rounds} rounds")
        sizes = [f"{float(s):g}" for s in args.sizes_mb]
        print(f"{'engine':22s}" + "".join(f"{s + ' MB':>10s}" for s in sizes))
        for label, per_size in results.items():
            print(f"{label:22s}" + "".join(f"{per_size[s]['busbw_over_link']:10.2f}" for s in sizes))
        print(f"{'raw TCP, both ways':22s}{tcp['goodput_over_link']:10.2f}  ({max(args.sizes_mb):g} MB each way)")
    record = {"benchmark": "allreduce", "backend": "horovod", "controller": "gloo", "ranks": args.np,
              "sizes_mb": args.sizes_mb, "iters": args.iters, "rounds": args.rounds, "links": links,
              "busbw_formula": "2(N-1)/N * bytes / median time", "machine": machine()}
    write_json(args.json, record)
    if args.json:
        plot(record, png_path(args.json))
    return record


def _all_arguments(p: argparse.ArgumentParser) -> None:
    _base_arguments(p)
    add_arguments(p)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.processes import worker_or_driver_main

    return worker_or_driver_main("python -m benchmarks.allreduce_horovod", HELP, _all_arguments,
                                 _worker, run, argv)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
