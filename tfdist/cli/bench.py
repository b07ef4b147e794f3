"""`tfdist bench NAME`: the benchmarks of the source tree tfdist was installed from.

The benchmarks are not part of the installed package: they live in `benchmarks/` beside `tfdist/` in a clone
(an editable install, `pip install -e .`, as `make setup` does). This command finds them there; from a wheel it
says where to get them.
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import sys

# Benchmark modules of benchmarks/; each has NAME, HELP, add_arguments(parser) and run(args).
BENCHMARKS = ["overhead", "allreduce", "scaling", "zero", "pipeline", "straggler", "epoch_boundary", "ddp",
              "network_scaling", "tensor_parallel", "zero_capacity", "tensor_parallel_zero", "gpu_check",
              "collective_timeout", "autograph_trace", "ps_checkpoint"]
SOURCE_TREE = pathlib.Path(__file__).resolve().parents[2]


def benchmarks_available() -> bool:
    """True where the source tree beside this tfdist has benchmarks/ (it is then put on sys.path)."""
    if not (SOURCE_TREE / "benchmarks" / "__init__.py").is_file():
        return False
    if str(SOURCE_TREE) not in sys.path:
        sys.path.insert(0, str(SOURCE_TREE))
    return True


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark (from a clone of tfdist)",
                       description="Run a benchmark of the source tree; results go to stdout and JSON.")
    if not benchmarks_available():
        p.set_defaults(run=_missing)
        return
    benches = p.add_subparsers(dest="benchmark", required=True)
    for name in BENCHMARKS:
        module = importlib.import_module(f"benchmarks.{name}")
        bp = benches.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(bp)
        bp.set_defaults(run=module.run)


def _missing(args: argparse.Namespace) -> int:
    from tfdist.errors import ConfigError

    raise ConfigError(f"the benchmarks are not installed with tfdist: no benchmarks/ beside {SOURCE_TREE / 'tfdist'}. "
                      "Clone the tfdist repository, `pip install -e .` from it, and run `tfdist bench` there "
                      "(or `python -m benchmarks NAME` from the clone's root).")
