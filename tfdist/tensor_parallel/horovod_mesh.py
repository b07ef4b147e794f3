"""Horovod as the cross-process collectives of a mesh (`tfdist.ModelParallelStrategy(backend="horovod")`).

- `init_mesh_horovod(timeout_s)`: Horovod started with dynamic process sets (the mesh's rows and columns become
  process sets on every rank), `timeout_s` as Horovod's stall shutdown (Horovod has no per-op timeout).
- `process_set(hvd, ranks)`: the Horovod process set of `ranks` (the global set for every rank, a set registered
  earlier by any caller, else a new one: a collective, every rank adds the same sets in the same order).
- `HorovodMeshAllReduce`: the CrossDeviceOps of a mesh whose rows live in several processes: a value is summed
  over this process's rows on the device it is reduced to, then all-reduced within a process set on that same
  device (one grouped `hvd.allreduce` per device and step), so shard k's gradient stays on the k-th device.
- `HorovodRow`: all-reduce / all-gather among the processes of one mesh row (a process set): the exchanges of the
  split layers when the model axis spans processes.

Horovod matches collectives across ranks by name. The processes of a row hold different shards (variables named
`..._shard_0` on one, `..._shard_1` on the other), so names derived from tensors would differ: every op here is
named by a counter per graph (or eagerly) and purpose, equal on every rank that traces the same program (SPMD).
Inputs go through `PlaceholderWithDefault` in graphs: Horovod's ops are not stateful, and Grappler would
otherwise constant-fold a collective whose input is known at trace time, on one rank only.
"""

from __future__ import annotations

import itertools
import os
import weakref
from collections.abc import Sequence

import tensorflow as tf

from tfdist._compat import distribute as tf_distribute
from tfdist._compat.distribute import devices_of, local_values
from tfdist.comm._horovod_sets import registered_process_set
from tfdist.comm.horovod import init_horovod
from tfdist.comm.wire import sum_bf16_by_gather
from tfdist.errors import ConfigError

__all__ = ["HorovodMeshAllReduce", "HorovodRow", "init_mesh_horovod", "process_set"]


def init_mesh_horovod(timeout_s: float):
    """`horovod.tensorflow`, initialised once per process with dynamic process sets; HOROVOD_STALL_SHUTDOWN_TIME_
    SECONDS = `timeout_s` (a collective some rank never joins ends Horovod with an error instead of hanging)."""
    return init_horovod(explicit=False, dynamic_process_sets=True, stall_timeout_s=timeout_s)


def process_set(hvd, ranks: Sequence[int]):
    """The process set of `ranks` (sorted): the global one, one registered before, or a new one (collective)."""
    ranks = sorted(int(r) for r in ranks)
    if ranks == list(range(hvd.size())):
        return hvd.global_process_set
    found = registered_process_set(hvd, ranks)
    if found is not None:
        return found
    if os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS") != "1":
        raise ConfigError(
            f"ModelParallelStrategy(backend='horovod') needs the Horovod process set {ranks} (a mesh row or column), "
            "but Horovod was initialised (e.g. by a HorovodStrategy or hvd.init()) without dynamic process sets. "
            "Create the ModelParallelStrategy first, call hvd.init(process_sets='dynamic'), or set "
            "HOROVOD_DYNAMIC_PROCESS_SETS=1.")
    added = hvd.add_process_set(ranks)
    _exit_together(hvd)
    return added


_EXIT_BARRIER: list = []


def _exit_together(hvd) -> None:
    """Makes this process wait, when the interpreter exits normally, until every rank gets there (once per
    process). Horovod's shutdown is global: a rank that exits (atexit: `hvd.shutdown`) while the processes of
    another process set are still in a collective (a save's gathers in their row) ends that collective with
    "Horovod has been shut down" / "Process set provided does not exist" (seen with 4 ranks in two rows of two,
    at the chief's save). An exit after an uncaught exception skips the wait: the launcher stops the others."""
    if _EXIT_BARRIER:
        return
    import atexit
    import sys

    def barrier():
        if getattr(sys, "last_value", None) is None and hvd.is_initialized():
            hvd.allreduce(tf.zeros([1]), op=hvd.Sum, name="tfdist_mesh_exit_barrier",
                          process_set=hvd.global_process_set)

    atexit.register(barrier)  # after hvd.init's own atexit(shutdown): runs before it (last in, first out)
    _EXIT_BARRIER.append(barrier)


class _Names:
    """Rank-independent op names: purpose + a counter per graph (or eagerly)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._eager = itertools.count()

    def __call__(self, kind: str) -> str:
        if tf.executing_eagerly():
            number = next(self._eager)
        else:
            number = next(self._graphs.setdefault(tf.compat.v1.get_default_graph(), itertools.count()))
        return f"{self.prefix}_{kind}_{number}"


def _live(x: tf.Tensor) -> tf.Tensor:
    """`x`, opaque to Grappler's constant folding inside a tf.function (see the module docstring)."""
    return x if tf.executing_eagerly() else tf.raw_ops.PlaceholderWithDefault(input=x, shape=x.shape)


def _key(device: str) -> tuple[str, int]:
    spec = tf.DeviceSpec.from_string(device)
    return (spec.device_type or "CPU").upper(), int(spec.device_index or 0)


class HorovodMeshAllReduce(tf_distribute.ProcessCrossDeviceOps):
    """Sums over this process's replicas on the destination's first device, then within a Horovod process set there.

    Args:
        hvd: `horovod.tensorflow`, initialised.
        members: processes in `processes` (reported to TF as between-graph workers; MEAN divides by them too).
        processes: the Horovod process set the sum spans (the global set for the batch axis over whole rows; the
            processes at one place of every row when rows span processes).
        name: a prefix for the op names, equal on every member (one per strategy and purpose).

    Example (each of 2 ranks holding one mesh row of 2 devices):
        >>> ops = HorovodMeshAllReduce(hvd, 2, hvd.global_process_set, "tfdist_mesh_1")
    """

    def __init__(self, hvd, members: int, processes, name: str):
        super().__init__()
        self._hvd, self._set = hvd, processes
        self.num_processes = int(members)
        self._names = _Names(name)

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        return self._reduce(reduce_op, [(per_replica_value, destinations)])[0]

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        return self._reduce(reduce_op, value_destination_pairs)

    def gather_implementation(self, per_replica_value, destinations, axis):
        parts = local_values(per_replica_value)
        with tf.device(devices_of(destinations)[0]):
            local = tf.concat([tf.identity(p) for p in parts], axis=axis)
            perm = [axis] + [i for i in range(local.shape.rank) if i != axis]
            gathered = self._hvd.allgather(_live(tf.transpose(local, perm) if axis else local),
                                           name=self._names("allgather"), ignore_name_scope=True,
                                           process_set=self._set)
            if axis:
                gathered = tf.transpose(gathered, [perm.index(i) for i in range(len(perm))])
        return self.broadcast(gathered, destinations)

    def _reduce(self, reduce_op, pairs) -> list:
        if not pairs:
            return []
        sums, by_device = [], {}
        for i, (value, destinations) in enumerate(pairs):
            parts = [tf.convert_to_tensor(p) for p in local_values(value)]  # IndexedSlices: dense
            device = devices_of(destinations)[0]
            with tf.device(device):
                sums.append((tf.math.add_n(parts) if len(parts) > 1 else tf.identity(parts[0]), len(parts)))
            by_device.setdefault(_key(device), (device, []))[1].append(i)
        totals: list = [None] * len(pairs)
        for key in sorted(by_device):  # the same order of devices (and names) on every process
            device, indices = by_device[key]
            with tf.device(device):
                reduced = self._sum([sums[i][0] for i in indices])
            for i, r in zip(indices, reduced):
                totals[i] = r
        out = []
        for (value, destinations), (_, count), total in zip(pairs, sums, totals):
            if reduce_op == tf.distribute.ReduceOp.MEAN:
                n = count * self.num_processes
                total = total / n if total.dtype.is_floating else total // n
            out.append(self.broadcast(total, destinations))
        return out

    def _sum(self, tensors: list[tf.Tensor]) -> list[tf.Tensor]:
        """One grouped Horovod sum of `tensors` (bools travel as int32; Horovod has no bool all-reduce). Horovod has
        no bfloat16 kernels either: bfloat16 values (grad_dtype) are all-gathered as their bits and summed here, in
        rank order, in bfloat16 (`comm.wire.sum_bf16_by_gather`)."""
        if self.num_processes == 1:
            return tensors
        hvd = self._hvd
        summed = [i for i, t in enumerate(tensors) if t.dtype != tf.bfloat16]
        wire = [tf.cast(tensors[i], tf.int32) if tensors[i].dtype == tf.bool else tensors[i] for i in summed]
        reduced = hvd.grouped_allreduce([_live(t) for t in wire], op=hvd.Sum, name=self._names("allreduce"),
                                        ignore_name_scope=True, process_set=self._set) if wire else []
        out: list = list(tensors)
        for i, r in zip(summed, reduced):
            out[i] = tf.cast(r, tf.bool) if tensors[i].dtype == tf.bool else r
        halves = [i for i, t in enumerate(tensors) if t.dtype == tf.bfloat16]
        if halves:
            gather = lambda w: hvd.allgather(_live(w), name=self._names("allgather"),  # noqa: E731
                                             ignore_name_scope=True, process_set=self._set)
            for i, r in zip(halves, sum_bf16_by_gather(gather, [tensors[i] for i in halves], self.num_processes,
                                                       accumulate=tf.bfloat16)):
                out[i] = r
        return out


class HorovodRow:
    """The collectives among the processes of one mesh row (a Horovod process set), for `RowSpan`.

    `all_reduce(t)` sums `t` over the row's processes, `all_gather(t)` concatenates along axis 0 in process-set
    rank order (the row's position order: a row's processes are consecutive ranks). Every process of the row calls
    them in the same order (SPMD), so the counter names agree.

    Example (one mesh row over both ranks of a 2-rank job):
        >>> row = HorovodRow(hvd, hvd.global_process_set, "tfdist_row_1")
        >>> row.all_reduce(tf.ones([2]))      # [2., 2.] on both ranks
    """

    def __init__(self, hvd, processes, name: str):
        self._hvd, self._set = hvd, processes
        self._names = _Names(name)

    def all_reduce(self, tensor: tf.Tensor) -> tf.Tensor:
        hvd = self._hvd
        wire = tf.cast(tensor, tf.int32) if tensor.dtype == tf.bool else tensor
        out = hvd.allreduce(_live(wire), op=hvd.Sum, name=self._names("allreduce"), ignore_name_scope=True,
                            process_set=self._set)
        return tf.cast(out, tf.bool) if tensor.dtype == tf.bool else out

    def all_gather(self, tensor: tf.Tensor) -> tf.Tensor:
        return self._hvd.allgather(_live(tensor), name=self._names("allgather"), ignore_name_scope=True,
                                   process_set=self._set)
