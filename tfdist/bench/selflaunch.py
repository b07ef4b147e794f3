"""Entry point of benchmarks that relaunch themselves as workers under mpirun/horovodrun (no TF import)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable


def worker_or_driver_main(prog: str, description: str, add_arguments: Callable[[argparse.ArgumentParser], None],
                          role_env: str, worker: Callable, driver: Callable, argv: list[str] | None = None) -> int:
    """`python -m tfdist.bench.X` entry point of a benchmark that relaunches itself under mpirun/horovodrun.

    The driver starts the launcher with `role_env=worker` in the environment; each launched copy of
    the module then runs `worker(args)` instead of driving again.
    """
    p = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(p)
    args = p.parse_args(argv)
    (worker if os.environ.get(role_env) == "worker" else driver)(args)
    return 0
