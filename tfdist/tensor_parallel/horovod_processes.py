"""ModelParallelStrategy across processes with Horovod (`backend="horovod"`, or "auto" under a Horovod/MPI launcher).

The mesh is the same as with TF collectives (`tfdist.cluster.list_devices()` names process r's devices
'/job:worker/replica:0/task:r/device:CPU:I', r = Horovod rank) and is checked by the same rules
(`tfdist.tensor_parallel.processes.process_rows`). What changes is who moves the bytes:

- the batch axis across processes (each process holds whole rows): gradients, metrics and `strategy.reduce` are
  summed over the local rows, then by one grouped `hvd.allreduce` per device (`HorovodMeshAllReduce`);
- rows spanning processes (the model axis across processes): the split layers' sums and gathers are
  `hvd.allreduce` / `hvd.allgather` in the row's process set (`HorovodRow`); with several rows, the rows'
  gradients are summed in the process set of the processes at the same place of every row;
- variables start as rank 0's (`HorovodGroup`: a signature all-gather, then `hvd.broadcast`);
- ZeRO over the batch axis (whole rows per process): each mesh column's group reduce-scatters, all-gathers and
  all-reduces with `tfdist.HorovodStrategy`'s own `HorovodShardCollectives`
  (`tfdist.strategies.model_parallel.zero.horovod_zero_collectives`).

Process sets: the global one when a set holds every rank, else added with Horovod's dynamic process sets (every
rank adds the same sets, in the same order, when the strategy is created).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping

import tensorflow as tf

from tfdist.comm.horovod_group import HorovodGroup
from tfdist.comm.launch_env import launcher_of, local_process
from tfdist.comm.tf_config import ClusterConfig, tf_config_from_env
from tfdist.devices import LocalProcess, mesh_process_devices
from tfdist.errors import ConfigError
from tfdist.tensor_parallel._tf_rows import RowsExtended, SpanExtended, SpanRowsExtended
from tfdist.tensor_parallel.mesh_devices import local_name, names_a_task
from tfdist.tensor_parallel.span import RowSpan

__all__ = ["BACKENDS", "choose_backend", "horovod_row_span", "horovod_rows", "start_horovod"]

BACKENDS = ("auto", "tf", "horovod")
_names = itertools.count(1)  # one op-name prefix per collective object, in creation order (equal on every rank)


def choose_backend(backend: str, environ: Mapping[str, str] | None = None) -> str:
    """'tf' or 'horovod' for ModelParallelStrategy(backend=...): 'auto' is Horovod when a Horovod/MPI launcher
    (horovodrun, mpirun, `tfdist launch --backend horovod`) started this process and no TF_CONFIG names a
    cluster of several workers, as `tfdist.comm.init` and `tfdist.auto_strategy` decide; TF collectives otherwise."""
    if backend not in BACKENDS:
        raise ConfigError(f"ModelParallelStrategy: backend must be one of {list(BACKENDS)}, got {backend!r}. "
                          "'tf': TF collective ops (tfdist launch, TF_CONFIG); 'horovod': Horovod (horovodrun, "
                          "mpirun, tfdist launch --backend horovod); 'auto': from the launcher.")
    if backend != "auto":
        return backend
    env = os.environ if environ is None else environ
    config = tf_config_from_env(env)
    if config is not None and config.num_workers > 1:
        return "tf"
    return "horovod" if launcher_of(env, mpi_world=True) is not None else "tf"


def horovod_rows(grid, timeout_s: float, environ: Mapping[str, str] | None = None):
    """This process's share of a mesh across Horovod ranks (a `ProcessRows` whose devices are local names), or
    None for a mesh of local devices in a job of one process. Starts Horovod (dynamic process sets)."""
    from tfdist.tensor_parallel.horovod_mesh import init_mesh_horovod
    from tfdist.tensor_parallel.processes import process_rows

    flat = [d for row in grid for d in row]
    hvd = init_mesh_horovod(timeout_s)
    size, rank = hvd.size(), hvd.rank()
    if not any(names_a_task(d) for d in flat):
        if size > 1:
            raise ConfigError(
                f"ModelParallelStrategy(backend='horovod'): this process is rank {rank} of a {size}-process Horovod "
                f"job, but the mesh lists only local devices {flat[:4]}{'...' if len(flat) > 4 else ''}: each "
                "process would train alone. Name every process's devices, e.g. DeviceMesh(shape, ('batch', 'model'), "
                "tfdist.cluster.list_devices()).")
        return None
    if size == 1:
        raise ConfigError(f"ModelParallelStrategy(backend='horovod'): the mesh names devices of processes "
                          f"({flat[0]!r}, ...) but this Horovod job has one process. Start {len(flat)} devices' worth "
                          "of processes with `tfdist launch --backend horovod -n N --devices-per-worker M`, "
                          "`horovodrun -np N` or `mpirun -np N`.")
    config = ClusterConfig({"worker": [f"horovod-rank-{r}" for r in range(size)]}, "worker", rank)
    rows = process_rows(grid, environ, config=config)
    rows.local_grid = [[local_name(d) for d in row] for row in rows.local_grid]  # no TF server: local devices
    local = LocalProcess(hvd.local_rank(), hvd.local_size(), local_process().own_devices)
    mesh_process_devices([d for r in rows.local_grid for d in r], rows.devices_per_process, local)
    return rows


def start_horovod(strategy, rows, timeout_s: float):
    """`make_extended()` for `tfdist._compat.distribute.init_strategy` over Horovod, and the row's collectives
    (`HorovodRow`, for `horovod_row_span`; None when rows stay inside processes). Every rank adds the same process
    sets in the same order here (Horovod's add_process_set is collective)."""
    from tfdist.tensor_parallel.horovod_mesh import HorovodMeshAllReduce, HorovodRow, init_mesh_horovod, process_set

    hvd = init_mesh_horovod(timeout_s)  # started by horovod_rows: this returns it
    world = HorovodGroup(hvd)
    name = f"tfdist_mesh{next(_names)}"
    if rows.span_first is None:  # the batch axis across processes, whole rows in each

        def make_extended():
            ops = HorovodMeshAllReduce(hvd, rows.size, hvd.global_process_set, name)
            return RowsExtended(strategy, [row[0] for row in rows.local_grid], ops, world)

        return make_extended, None
    b, home = rows.span_rows, rows.local_grid[0][0]
    q = rows.size // b
    # Every row's set, then every place's set (the processes at place p of each row), on every rank.
    row_sets = [process_set(hvd, range(r * q, (r + 1) * q)) for r in range(b)]
    place_sets = [process_set(hvd, range(p, rows.size, q)) for p in range(q)] if b > 1 else None
    row = HorovodRow(hvd, row_sets[rows.first_row], f"{name}_row")
    if b == 1:
        return lambda: SpanExtended(strategy, [home], tf.distribute.ReductionToOneDevice(), world), row
    from tfdist.tensor_parallel.processes import RowsOfSpan

    def make_extended():
        ops = HorovodMeshAllReduce(hvd, b, place_sets[rows.rank % q], f"{name}_rows")
        return SpanRowsExtended(strategy, [home], ops, RowsOfSpan(rows.first_row, b), world)

    return make_extended, row


def horovod_row_span(rows, row) -> RowSpan:
    """The RowSpan of this process's part of a row across Horovod ranks; `row`: its `HorovodRow` (process set)."""
    return RowSpan(rows.span_first, rows.row_size, rows.size // rows.span_rows, all_reduce=row.all_reduce,
                   all_gather=row.all_gather)
