"""Starting benchmark workers: N local processes of one command, and the `python -m` entry of the
benchmarks that start copies of themselves."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

from tfdist.cluster.launcher import launch
from tfdist.errors import ConfigError

LAUNCHERS = ("tf", "horovod", "mpirun")
TIMEOUT_S = 900.0
TIMED_OUT = 124  # what tfdist.cluster.launcher.launch returns on a timeout


def sweep_timeout_s(sizes_mb: Sequence[float], n: int, all_reduces_per_size: int, link_rate: str | None) -> float:
    """The time limit of a launch whose `n` ranks run `all_reduces_per_size` ring all-reduces of each size (each
    sends 2(n-1)/n of the tensor over every node's link): TIMEOUT_S for start-up and slack, plus three times that
    wire time at `link_rate` (loopback: taken as 1 Gbit/s, slower than it runs here), so that a long sweep is not
    cut off with its results."""
    from tfdist.cluster.emulated_network import parse_rate

    wire_bytes = sum(mb * 2**20 for mb in sizes_mb) * 2 * (n - 1) / n * all_reduces_per_size
    return TIMEOUT_S + 3.0 * wire_bytes * 8.0 / (parse_rate(link_rate) if link_rate else 1e9)


def run_workers(command: Sequence[str], n: int, *, launcher: str = "tf", env: Mapping[str, str] | None = None,
                mpirun_options: Sequence[str] = (), out: TextIO | None = None,
                timeout_s: float = TIMEOUT_S, link_rate: str | None = None) -> int:
    """Runs `command` as `n` local processes; returns the first non-zero exit code, 0 if all succeed.

    launcher "tf" (TF_CONFIG per rank) and "horovod" (Horovod's Gloo rendezvous) go through
    tfdist.cluster.launcher.launch, which prefixes each output line with its rank; "mpirun" hands the
    processes to OpenMPI (Horovod's MPI controller, mpi4py), with `mpirun_options` before the command.
    `env` is added to this process's environment; `out` receives the workers' output (default stdout).
    `link_rate` (launcher "tf"): each process on an emulated node linked at that rate (root only).
    """
    env = {"TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    if launcher == "mpirun":
        return _mpirun(command, n, env, mpirun_options, out, timeout_s)
    if launcher not in LAUNCHERS:
        raise ConfigError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}.")
    return launch(list(command), n, backend=launcher, env=env, out=out, timeout_s=timeout_s, link_rate=link_rate)


def _mpirun(command: Sequence[str], n: int, env: Mapping[str, str], options: Sequence[str],
            out: TextIO | None, timeout_s: float) -> int:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise ConfigError("mpirun is not on PATH; install OpenMPI (apt-get install openmpi-bin libopenmpi-dev).")
    # OpenMPI refuses to start as root (as in containers) unless both variables say so.
    env = {**os.environ, **env, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    pipe = {} if out is None else {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    try:
        proc = subprocess.run([mpirun, "-np", str(n), *options, *command], env=env, timeout=timeout_s, **pipe)
    except subprocess.TimeoutExpired:
        return TIMED_OUT
    if out is not None:
        out.write(proc.stdout)
    return proc.returncode


def module_command(module: str, **options: object) -> list[str]:
    """`python -m module --name value ...`, the command of a benchmark's worker processes.

    Underscores in names become dashes; a list gives one value each, True a bare flag, False/None nothing.
    """
    command = [sys.executable, "-m", module]
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            command.append(flag)
        elif isinstance(value, (list, tuple)):
            command += [flag, *map(str, value)]
        elif value is not None and value is not False:
            command += [flag, str(value)]
    return command


def worker_or_driver_main(prog: str, description: str, add_arguments: Callable[[argparse.ArgumentParser], None],
                          worker: Callable[[argparse.Namespace], object],
                          driver: Callable[[argparse.Namespace], object], argv: list[str] | None = None) -> int:
    """`python -m` entry of a benchmark that starts copies of itself: with --worker it is one of those
    copies and runs `worker(args)`; without, it drives the benchmark (`driver(args)`)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(p)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    (worker if args.worker else driver)(args)
    return 0
