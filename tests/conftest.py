"""Test set-up: 4 logical CPUs for every in-process test, and a runner for isolated subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# OpenMPI ranks (mpirun tests: Horovod's MPI controller, mpi4py) busy-poll while they wait for a peer; on this
# 2-core box the spinning rank took the CPU its peer needed to trace (first tf.function call 27 s instead of
# 8 s). Yielding when idle changes no result, only who gets the CPU; every subprocess inherits it.
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")

# benchmarks/ is not installed: subprocesses that import it (benchmark workers, jobs that read traces) find it
# in this clone, whatever directory they start in.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)

import tfdist  # noqa: E402

# Before any test touches TensorFlow: 4 replicas on one CPU. Tests that need another device count,
# or a TensorFlow that is not yet initialised, run in a subprocess (run_python below).
REPLICAS = 4
tfdist.devices.virtual_cpus(REPLICAS)


def run_python(code: str, *args: str, timeout: float = 300, env: dict | None = None, check: bool = True):
    """Runs `code` in a fresh Python (fresh TensorFlow) and returns the CompletedProcess."""
    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env)
    if check and proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}")
    return proc


@pytest.fixture
def python():
    return run_python


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A SLURM cluster on this machine (tests/slurm_harness.py) for one test module; skips with the reason
    where it cannot run (not root, no slurm-wlm)."""
    from slurm_harness import SlurmHarness, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    harness = SlurmHarness(tmp_path_factory.mktemp("slurm"))
    try:
        harness.start()
        yield harness
    finally:
        harness.stop()  # every daemon by PID, namespaces removed, even when a test failed


# --- tiers ------------------------------------------------------------------------------------------------
# Every test is in-process unless marked: `slow` (starts processes or runs long), `horovod` (needs the Horovod
# build), `root` (starts daemons, network namespaces or cgroups). `make quick` deselects all three. The two
# resource markers are read from what a test (and its module's helpers) names, so a new test is tiered without
# anyone remembering to; a test that needs neither but names them is only skipped where they are missing.
_HOROVOD_WORDS = ("horovod", "hvd.", "mpirun", "mpi4py")
_ROOT_WORDS = ("slurm", "cgroup", "emulatednetwork", "emulated_network", "link_rate", "netns", "geteuid")


def _source_of(item) -> str:
    import inspect

    try:
        return inspect.getsource(item.function).lower()
    except (OSError, TypeError, AttributeError):
        return ""


def _uses(item, words) -> bool:
    text = _source_of(item) + " " + " ".join(item.fixturenames).lower()
    return any(word in text for word in words)


def _horovod_built() -> bool:
    import importlib.util

    return importlib.util.find_spec("horovod") is not None


# `make test` runs the suite on two pytest workers (pytest-xdist, --dist loadgroup): on 2 cores a multi-process
# test leaves a core idle while its processes start, wait on each other or wait out a timeout. A test file is one
# unit of work (its module fixtures start each topology once, on one worker); files that share a machine-wide
# resource form one unit: the SLURM daemons.
SHARED_UNITS = {
    "slurm": ("test_slurm_jobs.py", "test_slurm_cluster.py", "test_slurm_ps.py", "test_preemption.py",
              "test_elastic.py"),
}
_UNIT_OF = {name: unit for unit, names in SHARED_UNITS.items() for name in names}


def _unit(item) -> str:
    name = item.path.name
    return _UNIT_OF.get(name, name)


# Units that take longest go first, so that neither worker is left with a long one at the end (longest first is
# the classic rule for packing jobs on two machines). Minutes per unit, from `make test`'s --durations (rounded;
# only the order matters). Units not listed follow in collection order.
UNIT_MINUTES: dict[str, float] = {}


def pytest_collection_modifyitems(config, items):
    have_horovod = _horovod_built()
    position = {unit: i for i, unit in enumerate(dict.fromkeys(_unit(item) for item in items))}
    items.sort(key=lambda item: (-UNIT_MINUTES.get(_unit(item), 0.0), position[_unit(item)]))
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_unit(item)))
        if _uses(item, _HOROVOD_WORDS):
            item.add_marker(pytest.mark.horovod)
            if not have_horovod:
                item.add_marker(pytest.mark.skip(reason="needs the Horovod build: make horovod"))
        if _uses(item, _ROOT_WORDS):
            item.add_marker(pytest.mark.root)
