"""`tfdist bench NAME`: benchmarks that print ratios side by side and write JSON."""

from __future__ import annotations

import argparse
import importlib

# Benchmark modules under tfdist.bench; each has NAME, HELP, add_arguments(parser) and run(args).
BENCHMARKS = ["overhead", "allreduce", "scaling", "zero", "pipeline", "straggler", "epoch_boundary", "ddp", "network_scaling", "tensor_parallel", "zero_capacity", "tensor_parallel_zero"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark", description="Run a benchmark; results go to stdout and JSON.")
    benches = p.add_subparsers(dest="benchmark", required=True)
    for name in BENCHMARKS:
        module = importlib.import_module(f"tfdist.bench.{name}")
        bp = benches.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(bp)
        bp.set_defaults(run=module.run)
