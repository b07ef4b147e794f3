"""tfdist.comm, the collectives for users: every operation on both backends, with real processes.

Each multi-process test starts the processes once and runs a batch of scenarios (tests/comm_api_worker.py),
then checks every result against NumPy computed from every rank's known inputs, and, under mpirun,
against mpi4py running the same operations (the oracle). The worked example of docs/comm.md (parameter
averaging) runs as written.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

import tfdist.comm as comm
from tfdist.comm import state
from tfdist.comm.arguments import as_tensor
from tfdist.comm.program_order import ProgramOrder
from tfdist.comm.startup import choose_backend, cluster_config
from tfdist.comm.wire import encode_move, encode_reduce
from tfdist.errors import ConfigError

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import comm_api_worker as worker  # noqa: E402

WORKER = str(HERE / "comm_api_worker.py")
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2",
       "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ["PYTHONPATH"]]), "OMPI_ALLOW_RUN_AS_ROOT": "1",
       "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
LAUNCHER_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "TF_CONFIG", "SLURM_NTASKS",
                 "SLURM_STEP_NUM_TASKS")


def _horovod_available() -> bool:
    try:
        import horovod.tensorflow  # noqa: F401
    except ImportError:
        return False
    return True


needs_horovod = pytest.mark.skipif(not _horovod_available(), reason="Horovod is not installed (make horovod)")


# -- running the worker ------------------------------------------------------------------------
def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    return {**env, **ENV}


def run_launch(tmp_path: Path, n: int, scenarios: str, backend: str = "tf") -> str:
    """Runs the worker as n processes through tfdist's launcher; returns the output (fails on a bad exit)."""
    from tfdist.cluster.launcher import launch

    out = io.StringIO()
    saved = {k: os.environ.pop(k) for k in LAUNCHER_VARS if k in os.environ}
    try:
        code = launch([sys.executable, WORKER, str(tmp_path), "tf" if backend == "tf" else "horovod", scenarios], n,
                      backend=backend, env=ENV, out=out, timeout_s=300)
    finally:
        os.environ.update(saved)
    assert code == 0, out.getvalue()[-6000:]
    return out.getvalue()


def run_mpirun(tmp_path: Path, n: int, scenarios: str) -> str:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun is not installed (apt-get install openmpi-bin)")
    cmd = [mpirun, "-np", str(n), "--oversubscribe", sys.executable, WORKER, str(tmp_path), "horovod", scenarios]
    proc = subprocess.Popen(cmd, env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out = proc.communicate(timeout=170)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-6000:]
    return out


def load(tmp_path: Path, n: int) -> tuple[list[dict], list[dict[str, np.ndarray]]]:
    notes, results = [], []
    for r in range(n):
        notes.append(json.loads((tmp_path / f"rank{r}.json").read_text()))
        with np.load(tmp_path / f"rank{r}.npz") as f:
            results.append({k: f[k] for k in f.files})
    return notes, results


# -- expected results, from every rank's inputs ---------------------------------------------------
def _same(got: np.ndarray, want: np.ndarray, dtype: str, what: str) -> None:
    want = np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if dtype in ("float16", "bfloat16"):
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-2, err_msg=what)
    elif dtype.startswith(("float", "complex")):
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=what)
    else:
        np.testing.assert_array_equal(got, want.astype(got.dtype), err_msg=what)


def _reduce(xs: list[np.ndarray], op: str, dtype: str) -> np.ndarray:
    n = len(xs)
    stack = np.stack(xs)
    if dtype == "bool":
        return stack.any(0) if op in ("sum", "max") else stack.all(0)
    if op in ("sum", "mean"):
        total = np.sum(stack, axis=0, dtype=stack.dtype)
        if op == "sum":
            return total
        return total / n if stack.dtype.kind in "fc" else total // stack.dtype.type(n)
    return {"max": np.max, "min": np.min, "prod": lambda a, axis: np.prod(a, axis=axis, dtype=a.dtype)}[op](stack,
                                                                                                            axis=0)


def check_ops(results: list[dict], prefix: str, dtypes, n: int) -> int:
    """Checks every `_ops` result of every rank; returns how many arrays were compared."""
    checked = 0
    for dtype in dtypes:
        xs = [worker.value("battery", r, dtype) for r in range(n)]
        blocks = [np.split(x, n) for x in xs]
        for me, got in enumerate(results):
            def same(key, want):
                nonlocal checked
                _same(got[f"{prefix}/{dtype}/{key}"], want, dtype, f"rank {me} {prefix}/{dtype}/{key}")
                checked += 1

            for op in worker.ops_for(dtype):
                same(f"all_reduce/{op}", _reduce(xs, op, dtype))
            same("broadcast", xs[-1])
            same("all_gather", np.concatenate(xs))
            same("all_to_all", np.concatenate([blocks[r][me] for r in range(n)]))
            same("reduce_scatter", np.split(_reduce(xs, "max" if dtype == "bool" else "sum", dtype), n)[me])
    return checked


def check_shapes(results: list[dict], prefix: str, n: int) -> None:
    uneven = np.concatenate([worker.value("uneven", r, "float32", (r + 1, 2)) for r in range(n)])
    battery = [worker.value("battery", r, "float32") for r in range(n)]
    for me, got in enumerate(results):
        _same(got[f"{prefix}/all_gather"], uneven, "float32", f"rank {me} {prefix} all_gather")
        _same(got[f"{prefix}/all_gather_int8"], uneven.astype(np.int8), "int8", f"rank {me} {prefix} int8")
        assert (f"{prefix}/gather" in got) == (me == 0) and (f"{prefix}/reduce" in got) == (me == 1)
        if me == 0:
            _same(got[f"{prefix}/gather"], uneven, "float32", f"{prefix} gather")
        if me == 1:
            _same(got[f"{prefix}/reduce"], np.max(battery, axis=0), "float32", f"{prefix} reduce")
        _same(got[f"{prefix}/scatter"], worker.value("scatter", me, "float64", (me + 1, 2)), "float64", "scatter")
        src = (me - 1) % n
        _same(got[f"{prefix}/recv"], worker.value("p2p", src, "complex64", (src + 2,)), "complex64", "recv")


def check_oracle(results: list[dict]) -> int:
    """Every mpi4py result equals tfdist's result for the same call."""
    compared = 0
    for me, got in enumerate(results):
        for key in [k for k in got if k.startswith("mpi4py/")]:
            mine = key[len("mpi4py/"):]
            dtype = mine.split("/")[1] if mine.startswith("battery/") else "float64"
            _same(got[mine], got[key], dtype, f"rank {me}: tfdist {mine} vs mpi4py")
            compared += 1
    return compared


def check_errors(notes: list[dict], results: list[dict]) -> None:
    n = len(notes)
    for r, note in enumerate(notes):
        _same(results[r]["errors/after"], [n * (n + 1) / 2], "float32", "an all_reduce after the errors")
        e = note["errors"]
        assert "rank 0: float32 (2,); rank 1: int32 (2,)" in e["dtype_mismatch"], e
        assert "rank 0: float32 (2,); rank 1: float32 (4,)" in e["shape_mismatch"], e
        assert "called different collectives (rank 0: all_reduce; rank 1: broadcast" in e["op_mismatch"], e
        assert "all but the first dimension" in e["gather_trailing"], e
        assert "rank 0: float32; rank 1: int64" in e["scatter_like"], e
        assert "op must be one of" in e["wrong_op"] and "'avg'" in e["wrong_op"], e
        assert f"root={len(notes)} is not a rank of the group" in e["root_outside"], e
        assert "cannot receive from itself" in e["recv_self"], e
        assert "dtype string" in e["string"], e
        assert "not defined for bool" in e["bool_mean"], e
        assert "multiple of the group size" in e["divisible"], e
        assert "passed different dtypes or shapes" in e["mismatch_function"], e
        if r == 1:
            assert "piece for this rank has shape (1,); like= expects (5,)" in e["scatter_shape"], e
            assert "rank 0 sent float32 (2,); like= expects int32" in e["recv_like"], e
        else:
            assert e["scatter_shape"] == "no error" and e.get("recv_like", "no error") == "no error", e
        assert all(m.startswith("ConfigError") for k, m in e.items() if e[k] != "no error"
                   and k != "mismatch_function"), e


def check_timeout(notes: list[dict], aborted: bool = False) -> None:
    """The ranks after rank 0 gave up after timeout_s with a clear error; `aborted`: through tfdist's own abort
    (comm.deadline), not TensorFlow's timer, whose race can kill the process instead."""
    for note in notes[1:]:
        assert note["timeout"].startswith("CollectiveError"), note["timeout"]
        if aborted:
            assert "aborted by: tfdist: a collective waited longer than timeout_s" in note["timeout"], note["timeout"]
        assert "timeout_s" in note["timeout"] and "same order" in note["timeout"], note["timeout"]
        # No time bound here (shared machines): a hang would end in the launcher's timeout and a bad exit.
        assert note["timeout_after_s"] >= worker.TIMEOUT_S * 0.9, note  # it waited timeout_s, then gave up


# -- in one process ------------------------------------------------------------------------------
def test_before_init_every_call_says_to_call_init(monkeypatch):
    monkeypatch.setattr(state.STATE, "backend", None)
    for call in (comm.rank, comm.size, lambda: comm.all_reduce(tf.ones([2])), comm.barrier,
                 lambda: comm.new_group([0])):
        with pytest.raises(ConfigError, match=r"call tfdist.comm.init\(\) first"):
            call()
    assert not comm.is_initialized()


def test_a_plain_process_is_a_world_of_one(monkeypatch):
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(state.STATE, "backend", None)
    with pytest.raises(ConfigError, match="backend must be 'auto', 'tf' or 'horovod'"):
        comm.init("nccl")
    with pytest.raises(ConfigError, match="timeout_s must be"):
        comm.init(timeout_s=0)
    comm.init()
    assert (comm.rank(), comm.size(), comm.local_rank(), comm.get_backend()) == (0, 1, 0, "tf")
    x = tf.constant([[1, 2], [3, 4]], tf.int8)
    assert comm.all_reduce(x, "mean").numpy().tolist() == [[1, 2], [3, 4]]
    assert comm.all_gather(tf.constant(7.0)).numpy().tolist() == [7.0]
    assert comm.reduce(x, root=0).dtype == tf.int8
    assert comm.scatter([x]).numpy().tolist() == [[1, 2], [3, 4]]
    assert comm.reduce_scatter(tf.ones([4], tf.complex64), "prod").shape == (4,)
    assert tf.function(lambda t: comm.broadcast(t, root=0))(tf.ones([3], tf.uint64)).dtype == tf.uint64
    comm.barrier()
    with pytest.raises(ConfigError, match="op must be one of"):
        comm.all_reduce(x, "average")
    with pytest.raises(ConfigError, match="root=1 is not a rank"):
        comm.gather(x, root=1)
    with pytest.raises(ConfigError, match="src=0 is this process"):
        comm.recv(0, like=tf.float32)
    with pytest.raises(ConfigError, match="dst=3 is not a rank of the job"):
        comm.send(x, dst=3)
    with pytest.raises(ConfigError, match="not defined for complex"):
        comm.all_reduce(tf.ones([2], tf.complex64), "max")
    with pytest.raises(ConfigError, match="ranks must be a non-empty list of ranks 0..0"):
        comm.new_group([0, 1])
    with pytest.raises(ConfigError, match="group must come from tfdist.comm.new_group"):
        comm.all_reduce(x, group=[0])
    with pytest.raises(ConfigError, match="already initialised with the 'tf' backend"):
        comm.init("horovod")
    outsider = comm.Group((1, 2), None, 99)
    with pytest.raises(ConfigError, match=r"this process \(rank 0\) is not in the group of ranks \[1, 2\]"):
        comm.all_reduce(x, group=outsider)


def test_backend_choice_reads_the_launcher(monkeypatch):
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    assert choose_backend("auto", None) == "tf"
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    assert choose_backend("auto", None) == "horovod"
    with pytest.raises(ConfigError, match="Use backend='horovod'"):
        choose_backend("tf", None)
    monkeypatch.delenv("OMPI_COMM_WORLD_RANK")
    monkeypatch.setenv("SLURM_NTASKS", "2")  # a batch script of a 2-task allocation: one process
    assert choose_backend("auto", None) == "tf"
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")  # inside `srun -n 2` without TF_CONFIG
    with pytest.raises(ConfigError, match="SlurmCluster.from_environment"):
        choose_backend("auto", None)
    assert choose_backend("auto", {"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}}) == "tf"
    # the TF backend reads its cluster with the one TF_CONFIG parser; errors name where it came from
    two = {"cluster": {"worker": ["h:1", "h:2"]}, "task": {"type": "worker", "index": 1}}
    assert (cluster_config(two).rank, cluster_config(json.dumps(two)).num_workers) == (1, 2)
    assert cluster_config(None, {}) is None
    with pytest.raises(ConfigError, match=r"cluster= is not a cluster .*job 'ps'"):
        cluster_config({"cluster": {"worker": ["h:1"], "ps": ["h:2"]}, "task": {"type": "worker", "index": 0}})
    with pytest.raises(ConfigError, match="the TF_CONFIG environment variable is not .* not valid JSON"):
        cluster_config(None, {"TF_CONFIG": "{oops"})


def test_every_dtype_round_trips_through_each_backends_wire_types():
    """Moves are bit-exact and reductions' encodings decode to the input, for every dtype on both backends'
    kernels; dtypes the collectives do not carry are an error that names the dtype and the fix."""
    from tfdist.comm.horovod_backend import HorovodBackend
    from tfdist.comm.tf_backend import TFBackend

    for native_move, native_reduce in ((TFBackend.move_dtypes, TFBackend.reduce_dtypes),
                                       (HorovodBackend.move_dtypes, HorovodBackend.reduce_dtypes)):
        for name in worker.DTYPES:
            x = tf.cast(tf.constant(worker.value("battery", 0, name)), name)
            wire, back = encode_move(x, native_move)
            assert wire.dtype in native_move and back(wire).dtype == x.dtype, name
            assert tf.reduce_all(tf.bitcast(back(wire), tf.uint8) == tf.bitcast(x, tf.uint8)) if name != "bool" \
                else tf.reduce_all(back(wire) == x), name
            for op in ("sum", "prod") if name.startswith("complex") else ("sum", "max", "min", "prod"):
                encoded = encode_reduce(x, op, native_reduce, "all_reduce")
                if encoded is not None:  # None: complex prod is gathered instead
                    assert encoded[0].dtype in native_reduce, (name, op)
                    assert tf.reduce_all(encoded[1](encoded[0]) == x), (name, op)
    with pytest.raises(ConfigError, match=r"x has dtype float8_e4m3fn; .* tf.cast\(x, tf.float16\)"):
        as_tensor(tf.cast(tf.zeros([2]), tf.dtypes.experimental.float8_e4m3fn), "all_reduce")


def test_program_order_chains_the_collectives_of_a_function_and_keeps_unused_ones():
    """In a traced function each collective waits for the previous one, and an Assert reads every
    collective's data (Grappler turns a stateless op used only as a control input into a NoOp)."""
    order = ProgramOrder()

    @tf.function
    def step(x):
        a = order(lambda: tf.identity(x, name="first"))
        order(lambda: tf.identity(x, name="second"))  # unused, like a send
        return a

    graph = step.get_concrete_function(tf.TensorSpec([2])).graph
    second = graph.get_operation_by_name("second")
    assert graph.get_operation_by_name("first") in second.control_inputs
    keepers = [op for op in graph.get_operations() if op.type == "Assert"]
    assert len(keepers) == 2 and all(k.inputs[1].op.type == "StridedSlice" for k in keepers)


def test_comm_group_keys_lie_above_every_strategys(monkeypatch):
    """tfdist.comm's TF group keys are constants above the strategies' key bases (and int32), and a
    strategy whose keys would reach them is refused."""
    import itertools

    from tfdist._compat import distribute as tf_distribute
    from tfdist.comm.tf_backend import PAIR_KEY_BASE, WORLD_KEY

    assert tf_distribute.COMM_KEY_BASE < WORLD_KEY < PAIR_KEY_BASE and PAIR_KEY_BASE + 28_000**2 < 2**31
    assert tf_distribute._ServerStrategy._collective_key_base == tf_distribute.COMM_KEY_BASE
    monkeypatch.setattr(tf_distribute, "_key_bases", itertools.count(tf_distribute.COMM_KEY_BASE - 50_000))
    with pytest.raises(RuntimeError, match="would reach tfdist.comm's"):
        tf_distribute.init_strategy(object(), lambda: None)


# -- real processes ------------------------------------------------------------------------------
@pytest.mark.slow
def test_tf_backend_two_processes_every_op_every_dtype(tmp_path):
    run_launch(tmp_path, 2, "battery,function,shapes,errors,timeout")
    notes, results = load(tmp_path, 2)
    assert [(n["rank"], n["size"], n["local_rank"], n["backend"]) for n in notes] == [(0, 2, 0, "tf"), (1, 2, 1, "tf")]
    assert check_ops(results, "battery", worker.DTYPES, 2) == 260  # 15 dtypes x (ops + 4 collectives) x 2 ranks
    check_ops(results, "function", worker.FUNCTION_DTYPES, 2)
    check_shapes(results, "shapes", 2)
    check_shapes(results, "shapes_function", 2)
    check_errors(notes, results)
    check_timeout(notes, aborted=True)


@pytest.mark.slow
def test_tf_backend_three_processes_groups_and_uneven_shapes(tmp_path):
    run_launch(tmp_path, 3, "shapes,groups")
    notes, results = load(tmp_path, 3)
    check_shapes(results, "shapes", 3)
    check_shapes(results, "shapes_function", 3)
    check_groups(notes, results)


def check_groups(notes: list[dict], results: list[dict]) -> None:
    xs = [worker.value("battery", r, "int32") for r in range(3)]
    assert notes[0]["groups"] == {"edges": [[0, 2], 0], "tail": [[1, 2], None]}
    assert notes[2]["groups"] == {"edges": [[0, 2], 1], "tail": [[1, 2], 1]}
    for name, ranks in (("edges", (0, 2)), ("tail", (1, 2))):
        for gr, r in enumerate(ranks):
            got = results[r]
            _same(got[f"groups/{name}/all_reduce"], xs[ranks[0]] + xs[ranks[1]], "int32", f"{name} all_reduce")
            _same(got[f"groups/{name}/broadcast"], xs[ranks[1]], "int32", f"{name} broadcast")
            _same(got[f"groups/{name}/all_gather"], np.concatenate([xs[ranks[0]][:1], xs[ranks[1]][:2]]), "int32",
                  f"{name} all_gather")
            _same(got[f"groups/{name}/reduce_scatter"], np.split(np.minimum(xs[ranks[0]], xs[ranks[1]]), 2)[gr],
                  "int32", f"{name} reduce_scatter")
        outsider = ({0, 1, 2} - set(ranks)).pop()
        assert re.search(rf"ConfigError: .*this process \(rank {outsider}\) is not in the group of ranks "
                         rf"\[{ranks[0]}, {ranks[1]}\]", notes[outsider][f"not_member_{name}"])
    for got in results:
        _same(got["groups/world_after"], sum(xs), "int32", "world all_reduce after the groups")


@needs_horovod
@pytest.mark.slow
def test_horovod_under_mpirun_matches_mpi4py(tmp_path):
    run_mpirun(tmp_path, 2, "battery,function,shapes,errors,timeout")
    notes, results = load(tmp_path, 2)
    assert [(n["rank"], n["size"], n["backend"]) for n in notes] == [(0, 2, "horovod"), (1, 2, "horovod")]
    assert check_oracle(results) > 150  # every operation mpi4py can run, on every MPI dtype
    check_ops(results, "battery", worker.DTYPES, 2)
    check_ops(results, "function", worker.FUNCTION_DTYPES, 2)
    check_shapes(results, "shapes", 2)
    check_shapes(results, "shapes_function", 2)
    check_errors(notes, results)
    check_timeout(notes)


@needs_horovod
@pytest.mark.slow
def test_horovod_gloo_three_processes_groups_and_uneven_shapes(tmp_path):
    run_launch(tmp_path, 3, "shapes,groups", backend="horovod")
    notes, results = load(tmp_path, 3)
    assert {n["backend"] for n in notes} == {"horovod"}
    check_shapes(results, "shapes", 3)
    check_shapes(results, "shapes_function", 3)
    check_groups(notes, results)


def averaging_example() -> str:
    """The python block of the worked example in docs/comm.md."""
    text = (HERE.parent / "docs" / "comm.md").read_text()
    section = text.split("### Worked example: parameter averaging", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_parameter_averaging_example_from_the_docs(tmp_path):
    script = tmp_path / "average.py"
    script.write_text(averaging_example())
    from tfdist.cluster.launcher import launch

    out = io.StringIO()
    saved = {k: os.environ.pop(k) for k in LAUNCHER_VARS if k in os.environ}
    try:
        code = launch([sys.executable, str(script)], 2, env=ENV, out=out, timeout_s=170)
    finally:
        os.environ.update(saved)
    text = out.getvalue()
    assert code == 0, text[-4000:]
    lines = re.findall(r"rank (\d)/2: weights identical on every rank, mean loss ([\d.]+)", text)
    assert sorted(r for r, _ in lines) == ["0", "1"], text[-4000:]
    assert lines[0][1] == lines[1][1] and float(lines[0][1]) < 0.5, lines
