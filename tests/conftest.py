"""Test set-up: 4 logical CPUs for every in-process test, and a runner for isolated subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# OpenMPI ranks (mpirun tests: Horovod's MPI controller, mpi4py) busy-poll while they wait for a peer; on this
# 2-core box the spinning rank took the CPU its peer needed to trace (first tf.function call 27 s instead of
# 8 s). Yielding when idle changes no result, only who gets the CPU; every subprocess inherits it.
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
# One thread per op (TensorFlow's intra-op pool) in every TensorFlow the suite starts: two workers each running
# jobs of 2-5 processes put 4-10 TensorFlows on the 2 cores, and each one's default pool (a thread per core) only
# adds threads that wait for a core and spin. Ops on different devices still run side by side (the inter-op pool
# is left as it is). Measured in docs/benchmarks.md (figures from the test suite).
os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
# TensorFlow's oneDNN CPU kernels and allocator in every TensorFlow the suite starts. TF turns them on by itself
# only on CPUs with AVX-512 VNNI/BF16 or AMX; elsewhere (AVX2 machines) its plain allocator maps and unmaps every
# large tensor: a ZeRO-3 memory trial took 63 CPU-s (23 of them in the kernel) instead of 34. With it every CI
# machine runs the same kernels and allocator, so figures, allocator statistics and tolerances mean the same.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
# The suite runs on logical CPUs, also on a machine with GPUs: the launcher would otherwise give each worker its
# own GPUs (and refuse jobs that want more than there are), and the references are one CPU device. The GPU paths
# have their own check: `make gpu-check`.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

# benchmarks/ is not installed: subprocesses that import it (benchmark workers, jobs that read traces) find it
# in this clone, whatever directory they start in. tests/site holds the suite's sitecustomize: Keras in every
# process the suite starts imports without its optional scikit-learn/pandas/matplotlib integrations (that file
# says why and what it saves).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITE = os.path.join(ROOT, "tests", "site")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (SITE, ROOT, os.environ.get("PYTHONPATH")) if p)

import tfdist  # noqa: E402

# Before any test touches TensorFlow: 4 replicas on one CPU. Tests that need another device count,
# or a TensorFlow that is not yet initialised, run in a subprocess (run_python below).
REPLICAS = 4
tfdist.devices.virtual_cpus(REPLICAS)


# Each pytest worker keeps a zygote: a Python that has imported TensorFlow and Keras and forks the programs of the
# processes the suite starts, which would otherwise each pay that import (tests/site/tfdist_test_zygote.py).
# TFDIST_TEST_ZYGOTE=0 turns it off. The socket's path is set now, before test modules copy os.environ into their
# own environments; the zygote behind it starts with a worker's first test (not in xdist's controller), and
# processes started before it has imported start fresh.
_ZYGOTE_OFF = os.environ.get("TFDIST_TEST_ZYGOTE") == "0"
_ZYGOTE_FOLDER = os.path.join(tempfile.gettempdir(), f"tfdist-zygote-{os.getpid()}")
if _ZYGOTE_OFF:
    os.environ.pop("TFDIST_TEST_ZYGOTE")
else:
    os.environ["TFDIST_TEST_ZYGOTE"] = os.path.join(_ZYGOTE_FOLDER, "socket")
_zygote_cpu_file: str | None = None


@pytest.fixture(scope="module")
def fresh_processes():
    """Every process a module's tests start is a fresh Python, not a fork of the zygote behind a stand-in: for
    tests that read their workers' own state by PID (CPU time, a SIGSTOP they gave themselves), check what a
    fresh process imports, or whose processes join a memory-capped cgroup themselves (a fork's TensorFlow pages
    are charged to the zygote's). Use it as `pytestmark = pytest.mark.usefixtures("fresh_processes")`."""
    os.environ["TFDIST_TEST_FRESH_PROCESS"] = "1"
    yield
    os.environ.pop("TFDIST_TEST_FRESH_PROCESS", None)


@pytest.fixture(scope="session", autouse=True)
def _zygote():
    global _zygote_cpu_file
    if _ZYGOTE_OFF:
        yield
        return
    import shutil

    shutil.rmtree(_ZYGOTE_FOLDER, ignore_errors=True)
    os.makedirs(_ZYGOTE_FOLDER)
    path, _zygote_cpu_file = os.environ["TFDIST_TEST_ZYGOTE"], os.path.join(_ZYGOTE_FOLDER, "cpu")
    env = {k: v for k, v in os.environ.items() if k != "TFDIST_TEST_ZYGOTE"}
    with open(os.path.join(_ZYGOTE_FOLDER, "log"), "wb") as log:
        server = subprocess.Popen([sys.executable, os.path.join(SITE, "tfdist_test_zygote.py"), path,
                                   _zygote_cpu_file], env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                  start_new_session=True)
    try:
        yield
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(_ZYGOTE_FOLDER, ignore_errors=True)


def _zygote_cpu_seconds() -> float:
    try:
        with open(_zygote_cpu_file) as f:
            return float(f.read())
    except (TypeError, OSError, ValueError):
        return 0.0


def run_python(code: str, *args: str, timeout: float = 300, env: dict | None = None, check: bool = True):
    """Runs `code` in a new Python process (TensorFlow not yet started: a fork of the zygote where it can be) and
    returns the CompletedProcess."""
    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env)
    if check and proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}")
    return proc


@pytest.fixture
def python():
    return run_python


@pytest.fixture(scope="session")
def plain_keras():
    """`plain_keras(path)`: the `.keras` file loaded in plain Keras (no tfdist, one device), as a record of its
    weights and optimizer variables (tests/plain_keras.py); one loader process serves the whole session."""
    from plain_keras import PlainKeras

    loader = PlainKeras()
    yield loader.load
    loader.close()


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
# resource markers are read from what a test's code and fixtures name, so a new test is tiered without
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
    text = _source_of(item) + " " + " ".join(getattr(item, "fixturenames", ())).lower()
    return any(word in text for word in words)


def _horovod_built() -> bool:
    import importlib.util

    return importlib.util.find_spec("horovod") is not None


# `make test` runs the suite on two pytest workers (pytest-xdist, --dist loadgroup): on 2 cores a multi-process
# test leaves a core idle while its processes start, wait on each other or wait out a timeout. A test file is one
# unit of work (its module fixtures start each topology once, on one worker); files that share a machine-wide
# resource form one unit: the SLURM daemons, and the memory-cap proofs (each wants several free GiB to itself).
SHARED_UNITS = {
    "slurm": ("test_slurm_jobs.py", "test_slurm_cluster.py", "test_slurm_ps.py", "test_preemption.py",
              "test_elastic.py"),
    "memory": ("test_zero3_cgroup_procs.py", "test_zero3_cgroup.py", "test_ps_embedding.py"),
}
_UNIT_OF = {name: unit for unit, names in SHARED_UNITS.items() for name in names}


# Files whose tests are split between the two workers: each test is its own unit, except the tests named here,
# which share a module fixture and so one unit (the doc blocks: a launch per script; the pages' in-process blocks
# in one process per logical-CPU count).
SPLIT_FILES = {"test_doc_blocks.py": {"test_a_pages_python_blocks_run_in_order": "doc pages"}}


def _unit(item) -> str:
    name = item.path.name
    if name in SPLIT_FILES:
        return SPLIT_FILES[name].get(getattr(item, "originalname", item.name), item.nodeid)
    return _UNIT_OF.get(name, name)


# Units that take longest go first, so that neither worker is left with a long one at the end (longest first is
# the classic rule for packing jobs on two machines; `make test` passes --no-loadscope-reorder so that xdist keeps
# this order). Minutes per unit under two workers, from a `make test` run's TFDIST_TEST_CPU_LOG (rounded; only the
# order matters). Units not listed follow in collection order: the doc blocks' launches (a unit each, under a
# minute) among them, which keeps short units for the end.
UNIT_MINUTES = {
    "memory": 15.3, "test_tensor_parallel_zero.py": 8.4, "slurm": 8.0, "test_zero3.py": 7.6,
    "test_tensor_parallel_horovod.py": 7.1, "doc pages": 6.9, "test_zero_multiworker.py": 6.7,
    "test_tensor_parallel_procs.py": 6.1, "test_tensor_parallel_zero3.py": 5.7, "test_horovod_multiprocess.py": 5.7,
    "test_tensor_parallel_model_procs.py": 5.5, "test_parameter_server.py": 5.4, "test_zero.py": 5.0,
    "test_multiworker_cli.py": 4.8, "test_custom_loop_checkpoint.py": 4.3, "test_epoch_boundary.py": 4.3,
    "test_tensor_parallel_zero_horovod.py": 4.2, "test_zero3_pieces.py": 4.1, "test_buckets.py": 4.0,
    "test_comm_api.py": 3.9, "test_bench_allreduce_horovod_startup.py": 3.9, "test_zero_horovod.py": 3.8,
    "test_zero3_procs.py": 3.7,
    "test_tensor_parallel.py": 3.0, "test_multiworker_faults.py": 3.0, "test_tensor_parallel_clip.py": 2.9,
    "test_multiworker_preemption.py": 2.8, "test_cli.py": 2.5, "test_custom_loop.py": 2.3,
    "test_keras_distribution.py": 2.0, "test_pipeline.py": 1.7, "04_zero_cnn.ipynb": 1.6,
    "07_parameter_server.ipynb": 1.6, "test_bench_zero.py": 1.5, "test_bench_straggler.py": 1.3,
    "test_gpu_check.py": 1.3, "05_layer_placement_cnn.ipynb": 1.3, "test_keras_twins.py": 1.2,
    "test_tensor_parallel_pipeline.py": 1.2, "test_multiworker.py": 1.2, "test_bench_allreduce_links.py": 1.2,
    "test_mirrored.py": 1.1, "test_bench_network_scaling.py": 1.1, "02_multiworker_cnn.ipynb": 1.1,
    "test_horovod.py": 1.0, "test_launch_nodes.py": 0.9, "test_uneven_data.py": 0.9, "test_train_zero.py": 0.9,
    "test_migration.py": 0.9, "test_comm_hooks.py": 0.8, "06_tensor_parallel.ipynb": 0.8, "test_placement.py": 0.7,
    "test_zero_checkpoint.py": 0.7, "test_cli_fast.py": 0.6, "test_zero_gradient_forms.py": 0.6,
}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the groups into the "@unit" the scheduler reads
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


@pytest.hookimpl(optionalhook=True)  # xdist's hook: unknown to pytest without it (`-p no:xdist`)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` that survives a dead pytest worker (tests/xdist_scheduler.py): without it, a test that
    crashes its worker can leave the whole run waiting until CI's time limit."""
    if config.getvalue("dist") == "loadgroup":
        from xdist_scheduler import CrashSafeLoadGroupScheduling

        return CrashSafeLoadGroupScheduling(config, log)
    return None


# `TFDIST_TEST_CPU_LOG=FILE make test`: one JSON line per test phase with the CPU seconds it cost, the pytest
# worker's own and those of every process it started and reaped (jobs, launchers and their ranks). The suite is
# CPU-bound on 2 cores, so these seconds, not the durations, say where its time goes.
_CPU_LOG = os.environ.get("TFDIST_TEST_CPU_LOG")


def _cpu_seconds() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + _zygote_cpu_seconds()


def _cpu_logged(phase: str):
    @pytest.hookimpl(hookwrapper=True)
    def hook(item, *args):
        if not _CPU_LOG:
            yield
            return
        import json
        import time

        cpu, wall = _cpu_seconds(), time.monotonic()
        yield
        with open(_CPU_LOG, "a") as f:
            f.write(json.dumps({"test": item.nodeid, "phase": phase, "unit": _unit(item),
                                "cpu_s": round(_cpu_seconds() - cpu, 2),
                                "wall_s": round(time.monotonic() - wall, 2)}) + "\n")
    return hook


pytest_runtest_setup = _cpu_logged("setup")
pytest_runtest_call = _cpu_logged("call")
pytest_runtest_teardown = _cpu_logged("teardown")
