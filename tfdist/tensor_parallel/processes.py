"""ModelParallelStrategy across processes: the mesh's "batch" axis spans processes, or its rows do (the model axis).

A mesh names every process's devices ('/job:worker/replica:0/task:T/device:CPU:I', `tfdist.cluster.list_devices()`).
Each process holds whole rows, the same number, on the same local device positions. Start-up is
MultiWorkerMirroredStrategy's (TF's coordination service with deadlines, the gRPC server and collective ops
configured before TensorFlow initialises); then each process runs a `RowsExtended` over its own rows, whose
reductions sum over the local rows and then across processes with one TF collective group per device position
(`tfdist.tensor_parallel.row_reductions`).

Rows across processes (the "model" axis across processes, `DeviceMesh((B, T), ...)` with B rows of P/B processes):
each process holds T/(P/B) consecutive model positions of its row and runs one replica, its part of the row (SPMD;
`SpanExtended` for one row, `SpanRowsExtended` for several); the split layers' exchanges are collectives among
the row's processes on their first devices of the row, the rows' gradients are summed by the processes at the same
place of every row.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import tensorflow as tf

from tfdist._compat.distribute import launcher_all_gather
from tfdist.comm.deadline import launched
from tfdist.comm.launch_env import LOCAL_DEVICES_ENV, local_device_count, local_process
from tfdist.comm.runtime import check_tf_not_started, start_server
from tfdist.comm.tf_config import (
    MULTI_WORKER_JOBS,
    ClusterConfig,
    tf_config_from_env,
)
from tfdist.devices import mesh_process_devices
from tfdist.errors import ConfigError
from tfdist.tensor_parallel._tf_rows import (
    RowsExtended,
    SpanExtended,
    SpanRowsExtended,
    device_launchers,
)
from tfdist.tensor_parallel.mesh_devices import local_name, names_a_task, task_of
from tfdist.tensor_parallel.row_reductions import DeviceGroupAllReduce, ProcessDevices
from tfdist.tensor_parallel.span import RowSpan

__all__ = ["ProcessRows", "RowsOfSpan", "check_process_options", "device_position", "process_rows", "row_span",
           "start_processes"]

_STARTED: dict = {}  # "server": (TF_CONFIG of the job this process joined, the object keeping its server)


@dataclasses.dataclass
class ProcessRows:
    """This process's share of a mesh across processes."""

    config: ClusterConfig
    rank: int
    size: int
    local_grid: list[list[str]]  # this process's rows, devices named as TF names them after start-up
    first_row: int               # global index of this process's first row
    devices_per_process: int
    span_first: int | None = None  # a row across processes: model position of this process's first device
    row_size: int = 0              # ... the row's devices (T)
    span_rows: int = 1             # ... and the mesh's rows (B; first_row is then this process's row)


def process_rows(grid: Sequence[Sequence[str]], environ=None,
                 config: ClusterConfig | None = None) -> ProcessRows | None:
    """Checks a mesh grid (rows x model positions) against the job: None for a mesh of local devices in a process
    that is not part of a multi-process job; else this process's rows. ConfigError, naming the fix, for a mesh
    that does not fit the job (unknown tasks, a row that straddles processes, uneven or differently placed rows,
    a device count other than processes x devices per process). `config`: the job instead of TF_CONFIG (Horovod's
    ranks as workers, `horovod_processes`)."""
    config = tf_config_from_env(environ) if config is None else config
    multi = config is not None and config.num_workers > 1
    flat = [d for row in grid for d in row]
    if not any(names_a_task(d) for d in flat):
        if multi:
            raise ConfigError(
                f"ModelParallelStrategy: this process is task {config.task_name} of a {config.num_workers}-process "
                f"job (TF_CONFIG), but the mesh lists only local devices {flat[:4]}{'...' if len(flat) > 4 else ''}: "
                "each process would train alone. Name every process's devices, e.g. "
                "DeviceMesh(shape, ('batch', 'model'), tfdist.cluster.list_devices()), or unset TF_CONFIG.")
        return None
    if not multi:
        raise ConfigError(
            f"ModelParallelStrategy: the mesh names devices of processes ({flat[0]!r}, ...) but this process has no "
            "TF_CONFIG of 2 or more workers. Start the processes with `tfdist launch -n N --devices-per-worker M -- "
            "python train.py` (or set TF_CONFIG), or name local devices ('/cpu:0') for one process.")
    ranks = _task_ranks(config)
    if any(len({task_of(d) for d in row}) > 1 for row in grid):
        return _spanning_row(grid, config, ranks, environ)
    rows_of: dict[int, list[int]] = {}
    for r, row in enumerate(grid):
        tasks = sorted({task_of(d) for d in row})
        for task in tasks:
            if task not in ranks:
                raise ConfigError(f"ModelParallelStrategy: mesh row {r} names /job:{task[0]}/task:{task[1]}, which "
                                  f"is not a task of this job (TF_CONFIG: {_describe(config)}).")
        if len(tasks) > 1:
            raise ConfigError(
                f"ModelParallelStrategy: mesh row {r} (one index of the batch axis) straddles processes "
                f"{[f'/job:{job}/task:{index}' for job, index in tasks]}: {list(row)}. The model axis must stay inside one "
                "process (its exchanges run every layer); list the devices process by process, as "
                "tfdist.cluster.list_devices() does, so each row's devices are one process's.")
        rows_of.setdefault(ranks[tasks[0]], []).append(r)
    size = config.num_workers
    missing = [rank for rank in range(size) if rank not in rows_of]
    counts = {rank: len(rows) for rank, rows in rows_of.items()}
    if missing or len(set(counts.values())) != 1:
        raise ConfigError(
            f"ModelParallelStrategy: every one of the {size} processes must hold the same number of mesh rows; "
            f"rows per process rank: {[counts.get(rank, 0) for rank in range(size)]}. Use a batch axis of "
            f"{size} x rows-per-process and tfdist.cluster.list_devices().")
    per = counts[0]
    for rank, rows in rows_of.items():
        if rows != list(range(rank * per, (rank + 1) * per)):
            raise ConfigError(f"ModelParallelStrategy: mesh rows {rows} belong to process {rank}; rows go process by "
                              f"process in rank order (process {rank}: rows {rank * per}..{(rank + 1) * per - 1}), as "
                              "tfdist.cluster.list_devices() lists them.")
    layouts = {rank: [[local_name(d) for d in grid[r]] for r in rows] for rank, rows in rows_of.items()}
    if any(layout != layouts[0] for layout in layouts.values()):
        raise ConfigError(f"ModelParallelStrategy: the processes place their rows on different local devices "
                          f"({ {rank: layouts[rank] for rank in sorted(layouts)} }); every process must use the "
                          "same device positions (tfdist.cluster.list_devices() does).")
    local = [d for row in layouts[0] for d in row]
    m = local_device_count(environ)
    if m is not None and len(flat) != size * m:
        raise ConfigError(f"ModelParallelStrategy: the mesh has {len(flat)} devices but the job has {size} processes "
                          f"x {m} devices ({LOCAL_DEVICES_ENV}={m}) = {size * m}. Give the mesh {size * m} devices "
                          "(tfdist.cluster.list_devices()), or launch with --devices-per-worker "
                          f"{len(flat) // size if len(flat) % size == 0 else '?'}.")
    if m is None:
        m = 1 + max(int(tf.DeviceSpec.from_string(d).device_index or 0) for d in local)
    rank = config.rank
    job, task = config.task_type, config.task_index
    prefix = f"/job:{job}/replica:0/task:{task}"
    local_grid = [[prefix + d for d in row] for row in layouts[0]]
    return ProcessRows(config, rank, size, local_grid, rank * per, m)


def _spanning_row(grid, config: ClusterConfig, ranks: dict, environ) -> ProcessRows:
    """Mesh rows across the job's processes: B rows of T positions, Q = processes / B processes per row; row r is
    processes r*Q .. r*Q+Q-1, and its process q holds positions q*M .. q*M+M-1 (M = T / Q)."""
    for r, row in enumerate(grid):
        for task in {task_of(d) for d in row}:
            if task not in ranks:
                raise ConfigError(f"ModelParallelStrategy: mesh row {r} names /job:{task[0]}/task:{task[1]}, which "
                                  f"is not a task of this job (TF_CONFIG: {_describe(config)}).")
    size, rows = config.num_workers, len(grid)
    if size % rows:
        raise ConfigError(f"ModelParallelStrategy: the mesh's {rows} rows span processes, but {size} processes do "
                          f"not divide evenly among them; give the batch axis a size that divides {size}.")
    q = size // rows  # processes per row
    per = None
    for r, row in enumerate(grid):
        owners = [ranks[task_of(d)] for d in row]
        if len(set(owners)) != q:
            raise ConfigError(
                f"ModelParallelStrategy: mesh row {r} (one index of the batch axis) straddles processes "
                f"{sorted(set(owners))}, but {rows} rows over {size} processes give each row {q} process(es): "
                "every row spans the same number of processes, in rank order. List the devices process by process "
                "(tfdist.cluster.list_devices()) and give the batch axis the number of rows you want, e.g. "
                f"DeviceMesh(({size}, devices_per_process), ...) for rows inside processes, or "
                f"DeviceMesh((1, {size} x devices_per_process), ...) for one row across them.")
        runs = [owners[0]] + [b for a, b in itertools.pairwise(owners) if a != b]  # process of each contiguous block
        if len(runs) != len(set(runs)):
            raise ConfigError(f"ModelParallelStrategy: mesh row {r}'s positions are not contiguous per process "
                              f"(process ranks by position: {owners}); each process must hold consecutive model "
                              "positions, as tfdist.cluster.list_devices() lists them.")
        counts = [owners.count(rank) for rank in runs]
        if len(set(counts)) != 1 or len(row) % q or counts[0] != len(row) // q:
            raise ConfigError(f"ModelParallelStrategy: mesh row {r} is split unevenly among the processes "
                              f"(positions per process: { dict(zip(runs, counts)) }); every process of a row must hold "
                              f"the same number of its positions: {len(row)} positions / {q} processes per row "
                              "(--devices-per-worker).")
        if runs != list(range(r * q, (r + 1) * q)):
            raise ConfigError(f"ModelParallelStrategy: mesh row {r}'s blocks go to processes {runs}; rows and their "
                              f"blocks go in rank order (row {r}: processes {r * q}..{(r + 1) * q - 1}), as "
                              "tfdist.cluster.list_devices() lists them.")
        per = counts[0]
    layouts = {rank: [local_name(d) for d in grid[rank // q][(rank % q) * per:(rank % q + 1) * per]]
               for rank in range(size)}
    if any(layout != layouts[0] for layout in layouts.values()):
        raise ConfigError(f"ModelParallelStrategy: the processes place their part of the row on different local "
                          f"devices ({layouts}); every process must use the same device positions "
                          "(tfdist.cluster.list_devices() does).")
    m = local_device_count(environ)
    total = rows * len(grid[0])
    if m is not None and total != size * m:
        raise ConfigError(f"ModelParallelStrategy: the mesh has {total} devices but the job has {size} processes "
                          f"x {m} devices ({LOCAL_DEVICES_ENV}={m}) = {size * m}. Give the mesh {size * m} devices "
                          "(tfdist.cluster.list_devices()).")
    if m is None:
        m = 1 + max(int(tf.DeviceSpec.from_string(d).device_index or 0) for d in layouts[0])
    prefix = f"/job:{config.task_type}/replica:0/task:{config.task_index}"
    rank = config.rank
    return ProcessRows(config, rank, size, [[prefix + d for d in layouts[0]]], rank // q, m,
                       span_first=(rank % q) * per, row_size=len(grid[0]), span_rows=rows)


def start_processes(strategy, rows: ProcessRows, timeout_s: float):
    """Starts this process's server and TF's collectives for the job (every process calls it, first thing; later
    strategies of the same job reuse them), then returns `make_extended()` for
    `tfdist._compat.distribute.init_strategy`, and the object keeping the server."""
    config = rows.config
    started = _STARTED.get("server")
    if started is not None:
        if started[0] != config.to_json():
            raise ConfigError(f"ModelParallelStrategy: this process already joined the job {started[0]}; a process "
                              f"joins one job (got {config.to_json()}).")
        return _make_extended(strategy, rows, timeout_s), started[1]
    who = "tfdist.ModelParallelStrategy over a mesh across processes must be created"
    fix = "Create the mesh and the strategy first thing in the script."
    check_tf_not_started(who, fix)
    mesh_process_devices([local_name(d) for r in rows.local_grid for d in r], rows.devices_per_process,
                         local_process())  # configured before TF initialises
    server = start_server(config, timeout_s, who=who, fix=fix)
    _STARTED["server"] = (config.to_json(), server)
    return _make_extended(strategy, rows, timeout_s), server


def _make_extended(strategy, rows: ProcessRows, timeout_s: float):
    config = rows.config
    host = f"/job:{config.task_type}/replica:0/task:{config.task_index}/device:CPU:0"
    if rows.span_first is not None:
        return _make_span_extended(strategy, rows, timeout_s)
    # One collective group per device position (host CPU first: metrics, input agreement, variable start).
    devices = [host] + sorted({d for row in rows.local_grid for d in row} - {host}, key=device_position)

    def make_extended():
        ops = DeviceGroupAllReduce(device_launchers(strategy, devices, rows.size, timeout_s), rows.size)
        group = ProcessDevices(rows.rank, rows.size, ops.launcher_for(host))
        return RowsExtended(strategy, [row[0] for row in rows.local_grid], ops, group)

    return make_extended


def _make_span_extended(strategy, rows: ProcessRows, timeout_s: float):
    home = rows.local_grid[0][0]
    if rows.span_rows > 1:
        return _make_span_rows_extended(strategy, rows, timeout_s)

    def make_extended():
        # One group: every process's first device of the row. It carries the rows' exchanges (every split layer's
        # all-reduce and all-gather) and the variables' identical start, in program order (one ordering token).
        launcher = device_launchers(strategy, [home], rows.size, timeout_s)[0]
        extended = SpanExtended(strategy, [home], tf.distribute.ReductionToOneDevice(),
                                ProcessDevices(rows.rank, rows.size, launcher))
        extended.row_launcher = launcher
        return extended

    return make_extended


def _make_span_rows_extended(strategy, rows: ProcessRows, timeout_s: float):
    home, b = rows.local_grid[0][0], rows.span_rows
    q = rows.size // b
    local = sorted({d for row in rows.local_grid for d in row}, key=device_position)
    place = rows.rank % q  # this process's place in its row: its groups across the rows are those of that place

    def make_extended():
        tokens: dict = {}  # one ordering token per device for every group below: collectives run in program order
        # Across the rows: per (place in the row, local device), the B processes at that place (gradients, metrics).
        across = device_launchers(strategy, local, b, timeout_s, first_group=place * len(local), tokens=tokens)
        # Along the row (the split layers' exchanges), then every process (variables start as rank 0's).
        row = device_launchers(strategy, [home], q, timeout_s, first_group=q * len(local) + rows.first_row,
                               tokens=tokens)[0]
        world = device_launchers(strategy, [home], rows.size, timeout_s, first_group=q * len(local) + b,
                                 tokens=tokens)[0]
        ops = DeviceGroupAllReduce(across, b)
        extended = SpanRowsExtended(strategy, [home], ops, RowsOfSpan(rows.first_row, b),
                                    ProcessDevices(rows.rank, rows.size, world))
        extended.row_launcher = row
        return extended

    return make_extended


@dataclasses.dataclass
class RowsOfSpan:
    """The data-parallel view of rows that span processes: this process's row (rank) among B (size)."""

    rank: int
    size: int

    def on_variable_created(self, variable) -> None:  # SpanRowsExtended starts variables over every process
        del variable


def row_span(strategy, rows: ProcessRows) -> RowSpan:
    """The RowSpan of this process's part of a row across processes (after the strategy's extended exists)."""
    launcher = strategy.extended.row_launcher
    return RowSpan(rows.span_first, rows.row_size, rows.size // rows.span_rows,
                   all_reduce=lambda t: DeviceGroupAllReduce.all_reduce_sum(launcher, t),
                   all_gather=lambda t: launched(launcher_all_gather, launcher, t))


def check_process_options(rows: ProcessRows, zero_stage: int, groups, stage_dim_name: str,
                          backend: str = "tf") -> None:
    """What a mesh across processes does not run yet, refused before anything starts."""
    del backend  # ZeRO runs over TF collectives and over Horovod alike (whole rows per process)
    if rows.span_first is not None and zero_stage:
        raise ConfigError(f"zero_stage={zero_stage} with the model axis across processes (a mesh row that spans "
                          "processes) is not supported: its optimizer state is already split with the shards. Use "
                          "zero_stage=0, or a mesh whose rows each stay inside one process.")
    if groups is not None:
        where = "whose rows span processes" if rows.span_first is not None else "across processes"
        raise ConfigError(f"a mesh with a {stage_dim_name!r} axis (pipeline stages) {where} is not supported yet: "
                          "use a rank-3 mesh of this process's devices, or a rank-2 (batch, model) mesh across "
                          "processes.")


def device_position(device: str) -> tuple[str, int]:
    """(device type, index) of a device name: the order TF ranks a collective group's members in."""
    spec = tf.DeviceSpec.from_string(device)
    return spec.device_type.upper(), int(spec.device_index or 0)


def _task_ranks(config: ClusterConfig) -> dict[tuple[str, int], int]:
    order = [(job, i) for job in MULTI_WORKER_JOBS for i in range(len(config.cluster.get(job, [])))]
    return {task: rank for rank, task in enumerate(order)}


def _describe(config: ClusterConfig) -> str:
    return ", ".join(f"{job} x {len(config.cluster[job])}" for job in MULTI_WORKER_JOBS if job in config.cluster)
