"""One process of tests/test_comm_api.py: runs tfdist.comm collectives and saves what every call returned.

Usage: python comm_api_worker.py OUT_DIR BACKEND SCENARIO[,SCENARIO...]

Scenarios: 'battery' (every op x every dtype, eagerly), 'function' (the same inside tf.function),
'shapes' (per-rank shapes: all_gather, gather, reduce, scatter, send/recv ring), 'groups' (new_group,
needs 3 processes), 'errors' (bad calls: clear errors, and the job goes on), 'timeout' (rank 0 skips a
collective: the others fail after timeout_s instead of hanging; must be last). Under mpirun the same
operations also run through mpi4py (the oracle), saved as 'mpi4py/...' next to tfdist's results.

Inputs are a function of (name, rank) only (`value`), so the test recomputes every expected result.
"""

from __future__ import annotations

import json
import os
import sys
import time
import zlib

import numpy as np

DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "uint16", "int32", "int64",
          "uint32", "uint64", "complex64", "complex128", "bool")
# inside tf.function: native, bitcast (16 bytes as two words), cast to int32
FUNCTION_DTYPES = ("float32", "complex128", "bool")
SHAPE = (6, 2)  # first dimension divisible by 1, 2 and 3 processes
TIMEOUT_S = 10.0


def ops_for(dtype: str) -> tuple[str, ...]:
    if dtype == "bool":
        return ("sum", "max", "min", "prod")
    if dtype.startswith("complex"):
        return ("sum", "mean", "prod")
    return ("sum", "mean", "max", "min", "prod")


def value(name: str, rank: int, dtype: str, shape=SHAPE) -> np.ndarray:
    """Rank `rank`'s input called `name`: small integers (exact in every dtype), as `dtype` (bfloat16 as float32)."""
    rng = np.random.default_rng(zlib.crc32(f"{name}/{rank}".encode()))
    ints = rng.integers(1, 4, size=shape)
    if dtype == "bool":
        return ints % 2 == 0
    if dtype.startswith("complex"):
        return (ints + 1j * rng.integers(-2, 3, size=shape)).astype(dtype)
    if dtype == "uint64":  # above 2**63: max/min must compare as unsigned
        return (np.uint64(2**63) * (ints % 2).astype(np.uint64) + ints.astype(np.uint64))
    return ints.astype("float32" if dtype == "bfloat16" else dtype)


def main() -> None:
    out_dir, backend, scenarios = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    mpi = None
    if os.environ.get("OMPI_COMM_WORLD_RANK") and "HOROVOD_RANK" not in os.environ:
        from mpi4py import MPI  # the oracle; initialises MPI before Horovod does (Horovod then reuses it)

        mpi = MPI
    import tensorflow as tf

    import tfdist.comm as comm

    start = time.monotonic()
    comm.init(backend, timeout_s=TIMEOUT_S)
    results: dict[str, np.ndarray] = {}
    notes: dict = {"rank": comm.rank(), "size": comm.size(), "local_rank": comm.local_rank(),
                   "backend": comm.get_backend(), "init_s": time.monotonic() - start}

    def save():
        np.savez(os.path.join(out_dir, f"rank{comm.rank()}.npz"), **results)
        with open(os.path.join(out_dir, f"rank{comm.rank()}.json"), "w") as f:
            json.dump(notes, f)

    for scenario in scenarios:
        began = time.monotonic()
        globals()[f"run_{scenario}"](comm, tf, results, notes, mpi)
        notes[f"{scenario}_s"] = time.monotonic() - began
        save()
    comm.barrier()
    save()
    print(f"rank {comm.rank()} done", flush=True)


def _np(t) -> np.ndarray:
    a = np.asarray(t.numpy() if hasattr(t, "numpy") else t)
    return a.astype(np.float32) if a.dtype.name == "bfloat16" else a


def _input(tf, name: str, rank: int, dtype: str, shape=SHAPE):
    return tf.cast(tf.constant(value(name, rank, dtype, shape)), dtype)


def _ops(comm, tf, dtype: str, x):
    """Every collective on `x` (a dict of results); runs eagerly or traced, the same code."""
    n, last = comm.size(), comm.size() - 1
    out = {f"all_reduce/{op}": comm.all_reduce(x, op) for op in ops_for(dtype)}
    out["broadcast"] = comm.broadcast(x, root=last)
    out["all_gather"] = comm.all_gather(x)
    out["all_to_all"] = comm.all_to_all(x)
    out["reduce_scatter"] = comm.reduce_scatter(x, "max" if dtype == "bool" else "sum")
    out["barrier"] = tf.constant(n)
    comm.barrier()
    return out


def run_battery(comm, tf, results, notes, mpi) -> None:
    for dtype in DTYPES:
        x = _input(tf, "battery", comm.rank(), dtype)
        for key, t in _ops(comm, tf, dtype, x).items():
            results[f"battery/{dtype}/{key}"] = _np(t)
        if mpi is not None:
            _oracle(mpi, results, dtype, value("battery", comm.rank(), dtype))


def run_function(comm, tf, results, notes, mpi) -> None:
    for dtype in FUNCTION_DTYPES:
        fn = tf.function(lambda x, dtype=dtype: _ops(comm, tf, dtype, x))
        x = _input(tf, "battery", comm.rank(), dtype)
        for _ in range(2):  # the second call reuses the trace: fresh instance keys at call time
            out = fn(x)
        for key, t in out.items():
            results[f"function/{dtype}/{key}"] = _np(t)


def _shapes(comm, tf):
    r, n = comm.rank(), comm.size()
    out = {}
    mine = _input(tf, "uneven", r, "float32", (r + 1, 2))
    out["all_gather"] = comm.all_gather(mine)
    out["all_gather_int8"] = comm.all_gather(tf.cast(mine, tf.int8))
    gathered = comm.gather(mine, root=0)
    if gathered is not None:
        out["gather"] = gathered
    reduced = comm.reduce(_input(tf, "battery", r, "float32"), root=1, op="max")
    if reduced is not None:
        out["reduce"] = reduced
    pieces = [_input(tf, "scatter", i, "float64", (i + 1, 2)) for i in range(n)] if r == 0 else None
    out["scatter"] = comm.scatter(pieces, root=0, like=tf.TensorSpec([None, 2], tf.float64))
    message = _input(tf, "p2p", r, "complex64", (r + 2,))
    if r % 2 == 0:
        comm.send(message, dst=(r + 1) % n)
        out["recv"] = comm.recv(src=(r - 1) % n, like=tf.TensorSpec([None], tf.complex64))
    else:
        out["recv"] = comm.recv(src=(r - 1) % n, like=tf.TensorSpec([None], tf.complex64))
        comm.send(message, dst=(r + 1) % n)
    return out


def run_shapes(comm, tf, results, notes, mpi) -> None:
    for key, t in _shapes(comm, tf).items():
        results[f"shapes/{key}"] = _np(t)
    for key, t in tf.function(lambda: _shapes(comm, tf))().items():
        results[f"shapes_function/{key}"] = _np(t)
    if mpi is not None:
        _oracle_shapes(mpi, results, comm.rank(), comm.size())


def run_groups(comm, tf, results, notes, mpi) -> None:
    r = comm.rank()
    edges = comm.new_group([2, 0])  # ranks 0 and 2 (group ranks 0 and 1)
    tail = comm.new_group([1, 2])
    notes["groups"] = {"edges": [list(edges.ranks), edges.rank], "tail": [list(tail.ranks), tail.rank]}
    x = _input(tf, "battery", r, "int32")
    for name, group in (("edges", edges), ("tail", tail)):
        if group.rank is None:
            try:
                comm.all_reduce(x, group=group)
            except Exception as err:  # noqa: BLE001 - recorded for the test
                notes[f"not_member_{name}"] = f"{type(err).__name__}: {err}"
            continue
        results[f"groups/{name}/all_reduce"] = _np(comm.all_reduce(x, "sum", group=group))
        results[f"groups/{name}/broadcast"] = _np(comm.broadcast(x, root=1, group=group))
        results[f"groups/{name}/all_gather"] = _np(comm.all_gather(x[: group.rank + 1], group=group))
        fn = tf.function(lambda y, g=group: comm.reduce_scatter(y, "min", group=g))
        results[f"groups/{name}/reduce_scatter"] = _np(fn(x))
    results["groups/world_after"] = _np(comm.all_reduce(x, "sum"))


def run_errors(comm, tf, results, notes, mpi) -> None:
    r, n = comm.rank(), comm.size()
    errors = {}

    def expect(name, fn):
        try:
            fn()
            errors[name] = "no error"
        except Exception as err:  # noqa: BLE001 - recorded for the test
            errors[name] = f"{type(err).__name__}: {err}"

    expect("dtype_mismatch", lambda: comm.all_reduce(tf.ones([2], tf.float32 if r == 0 else tf.int32)))
    expect("op_mismatch", lambda: comm.all_reduce(tf.ones([2])) if r == 0 else comm.broadcast(tf.ones([2])))
    expect("shape_mismatch", lambda: comm.all_to_all(tf.ones([2 * (r + 1)])))
    expect("gather_trailing", lambda: comm.all_gather(tf.ones([1, r + 1])))
    expect("scatter_like", lambda: comm.scatter([tf.ones([1])] * n if r == 0 else None,
                                                like=tf.float32 if r == 0 else tf.int64))
    expect("wrong_op", lambda: comm.all_reduce(tf.ones([2]), "avg"))
    expect("root_outside", lambda: comm.broadcast(tf.ones([2]), root=n))
    expect("recv_self", lambda: comm.recv(src=r, like=tf.float32))
    expect("string", lambda: comm.all_gather(tf.constant(["a"])))
    expect("bool_mean", lambda: comm.all_reduce(tf.constant([True]), "mean"))
    expect("divisible", lambda: comm.reduce_scatter(tf.ones([n + 1])))
    # inside tf.function the signature check is an Assert that stops the function before the collective
    expect("mismatch_function", tf.function(lambda: comm.all_reduce(tf.ones([2], tf.float32 if r == 0 else tf.int32))))
    # errors on one rank only, after the data moved: the other rank goes on
    expect("scatter_shape", lambda: comm.scatter([tf.ones([1])] * n if r == 0 else None,
                                                 like=tf.float32 if r == 0 else tf.TensorSpec([5], tf.float32)))
    if r < 2:
        expect("recv_like", lambda: comm.send(tf.ones([2]), dst=1) if r == 0 else comm.recv(src=0, like=tf.int32))
    notes["errors"] = errors
    results["errors/after"] = _np(comm.all_reduce(tf.constant([r + 1.0]), "sum"))  # the job goes on


def run_timeout(comm, tf, results, notes, mpi) -> None:
    """Rank 0 skips one all_reduce: the others get an error after timeout_s, not a hang."""
    out_dir = sys.argv[1]
    if comm.rank() == 0:  # wait (bounded) until every other rank has reported its error, then leave
        deadline = time.monotonic() + TIMEOUT_S + 120  # generous: the others' timeouts fire late on a loaded box
        while time.monotonic() < deadline and not all(
                "timeout" in _read(os.path.join(out_dir, f"rank{r}.json")) for r in range(1, comm.size())):
            time.sleep(0.5)
        notes["timeout"] = "skipped"
    else:
        began = time.monotonic()
        try:
            comm.all_reduce(tf.ones([2]))
            notes["timeout"] = "no error"
        except Exception as err:  # noqa: BLE001 - recorded for the test
            notes["timeout"] = f"{type(err).__name__}: {err}"
        notes["timeout_after_s"] = time.monotonic() - began
    with open(os.path.join(out_dir, f"rank{comm.rank()}.json"), "w") as f:
        json.dump(notes, f)
    if mpi is not None:
        mpi.Finalize()  # mpirun counts a rank that exits without it as failed
    os._exit(0)  # the collectives are broken now; leave without the final barrier


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


# -- the oracle: the same operations through mpi4py (buffer methods, real MPI reductions) ---------
_MPI_DTYPES = ("float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "int64", "uint32", "uint64",
               "complex64", "complex128")


def _oracle(MPI, results, dtype: str, x: np.ndarray) -> None:
    if dtype not in _MPI_DTYPES:
        return
    world = MPI.COMM_WORLD
    n = world.Get_size()
    ops = {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
    # Open MPI 4.1 compares MPI_UNSIGNED_LONG (mpi4py's type for uint64) as signed in MAX/MIN: name the
    # fixed-width unsigned types explicitly
    typed = (lambda a: [a, getattr(MPI, f"{dtype.upper()}_T")]) if dtype.startswith("uint") else (lambda a: a)
    for op in ops_for(dtype):
        out = np.empty_like(x)
        world.Allreduce(typed(x), typed(out), op=ops[op])
        if op == "mean":
            out = out / n if out.dtype.kind in "fc" else out // n
        results[f"mpi4py/battery/{dtype}/all_reduce/{op}"] = out
    root = x.copy()
    world.Bcast(root, root=n - 1)
    results[f"mpi4py/battery/{dtype}/broadcast"] = root
    gathered = np.empty((n,) + x.shape, x.dtype)
    world.Allgather(x, gathered)
    results[f"mpi4py/battery/{dtype}/all_gather"] = gathered.reshape((-1,) + x.shape[1:])
    swapped = np.empty_like(x)
    world.Alltoall(x, swapped)
    results[f"mpi4py/battery/{dtype}/all_to_all"] = swapped
    block = np.empty((x.shape[0] // n,) + x.shape[1:], x.dtype)
    world.Reduce_scatter_block(typed(x), typed(block), op=MPI.SUM)
    results[f"mpi4py/battery/{dtype}/reduce_scatter"] = block


def _oracle_shapes(MPI, results, r: int, n: int) -> None:
    world = MPI.COMM_WORLD
    mine = value("uneven", r, "float32", (r + 1, 2))
    counts = [(i + 1) * 2 for i in range(n)]
    everyone = np.empty((sum(counts) // 2, 2), np.float32)
    world.Allgatherv(mine, [everyone, counts])
    results["mpi4py/shapes/all_gather"] = everyone
    if r == 0:
        results["mpi4py/shapes/gather"] = everyone
    best = np.empty(SHAPE, np.float32)
    world.Reduce(value("battery", r, "float32"), best if r == 1 else None, op=MPI.MAX, root=1)
    if r == 1:
        results["mpi4py/shapes/reduce"] = best
    pieces = np.concatenate([value("scatter", i, "float64", (i + 1, 2)) for i in range(n)]) if r == 0 else None
    piece = np.empty((r + 1, 2), np.float64)
    world.Scatterv([pieces, counts] if r == 0 else None, piece, root=0)
    results["mpi4py/shapes/scatter"] = piece
    source = (r - 1) % n
    got = np.empty(source + 2, np.complex64)
    requests = [world.Isend(value("p2p", r, "complex64", (r + 2,)), dest=(r + 1) % n), world.Irecv(got, source=source)]
    MPI.Request.Waitall(requests)
    results["mpi4py/shapes/recv"] = got


if __name__ == "__main__":
    main()
