"""The Horovod backend of `tfdist.comm`: `horovod.tensorflow` collectives (Gloo or MPI), process sets as groups.

- all_reduce: `hvd.allreduce` (Sum, Product, Max, Min);
- all_gather: `hvd.allgather` (first dimensions may differ across ranks);
- broadcast: `hvd.broadcast`; all_to_all: `hvd.alltoall`;
- send/recv: a broadcast in the two-member process set of the pair (created at init for up to
  `P2P_MAX_SIZE` processes: Horovod adds process sets only collectively, on every rank).

Groups are Horovod process sets (`hvd.init(process_sets="dynamic")`, then `hvd.add_process_set` on
every rank). Horovod matches collectives across ranks by name: every op gets a rank-independent name
from a counter (per group, per tf.function graph or eagerly), and runs in program order
(`ProgramOrder`). Horovod has no per-op timeout: `timeout_s` becomes HOROVOD_STALL_SHUTDOWN_TIME_SECONDS
(set before hvd.init), so a collective some rank never joins shuts Horovod down with an error instead
of hanging.
"""

from __future__ import annotations

import itertools
import os
import weakref
from collections.abc import Sequence

import tensorflow as tf

from tfdist.comm._horovod_sets import registered_process_set
from tfdist.comm.horovod import init_horovod
from tfdist.comm.process_group import Backend, Group
from tfdist.comm.program_order import ProgramOrder
from tfdist.errors import ConfigError

__all__ = ["HorovodBackend", "P2P_MAX_SIZE"]

#: up to this many processes, init creates the process sets send/recv needs (P(P-1)/2 of them)
P2P_MAX_SIZE = 8


class HorovodBackend(Backend):
    """Horovod collectives between the processes of a horovodrun / mpirun / `tfdist launch --backend horovod` job.

    Example (under `horovodrun -np 2`):
        >>> backend = HorovodBackend(timeout_s=60)
        >>> backend.rank, backend.size
        (0, 2)   # (1, 2) on the other process
    """

    name = "horovod"
    move_dtypes = frozenset({tf.uint8, tf.int8, tf.uint16, tf.int16, tf.int32, tf.int64, tf.float16, tf.float32,
                             tf.float64, tf.bool})
    reduce_dtypes = frozenset({tf.uint8, tf.int8, tf.int32, tf.int64, tf.float16, tf.float32, tf.float64})
    uneven_all_gather = True

    def __init__(self, timeout_s: float):
        self.timeout_s = float(timeout_s)
        hvd = self._hvd = init_horovod(explicit=False, dynamic_process_sets=True, stall_timeout_s=self.timeout_s)
        self._dynamic = os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS") == "1"
        self.rank, self.size = hvd.rank(), hvd.size()
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()
        self._sets: dict[tuple[int, ...], object] = {tuple(range(self.size)): hvd.global_process_set}
        self.world = Group(tuple(range(self.size)), self.rank, 0, hvd.global_process_set)
        self._names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> {set id: counter}
        self._eager_names: dict[int, itertools.count] = {}  # set id -> counter
        self._order = ProgramOrder()
        self._pairs = self.size <= P2P_MAX_SIZE
        if self._pairs and self.size > 2 and self._dynamic:
            for a, b in itertools.combinations(range(self.size), 2):
                self._process_set((a, b))

    def _process_set(self, ranks: tuple[int, ...]):
        if ranks not in self._sets:
            # A set another caller registered (a ModelParallelStrategy's mesh rows): Horovod refuses a duplicate.
            found = registered_process_set(self._hvd, ranks)
            if found is not None:
                self._sets[ranks] = found
                return found
            if not self._dynamic:
                raise ConfigError(
                    "tfdist.comm.new_group: Horovod was initialised (e.g. by a HorovodStrategy) without dynamic "
                    "process sets. Call tfdist.comm.init(backend='horovod') before creating the strategy, or set "
                    "HOROVOD_DYNAMIC_PROCESS_SETS=1 in the environment.")
            self._sets[ranks] = self._hvd.add_process_set(list(ranks))
        return self._sets[ranks]

    def new_group(self, ranks: Sequence[int]) -> Group:
        ranks = tuple(ranks)
        process_set = self._process_set(ranks)
        return Group(ranks, ranks.index(self.rank) if self.rank in ranks else None,
                     int(process_set.process_set_id), process_set)

    def _name(self, kind: str, group: Group) -> str:
        """A name equal on every member for the k-th collective of the group in this graph (or eagerly)."""
        counters = (self._eager_names if tf.executing_eagerly()
                    else self._names.setdefault(tf.compat.v1.get_default_graph(), {}))
        number = next(counters.setdefault(group.key, itertools.count()))
        return f"tfdist_comm_{kind}_{group.key}_{number}"

    def _live(self, x: tf.Tensor) -> tf.Tensor:
        """`x`, opaque to Grappler inside a tf.function. Horovod's ops are not marked stateful: with an input
        known at trace time, constant folding would run the collective while optimising the graph (on one
        rank, out of order: a hang)."""
        if tf.executing_eagerly():
            return x
        return tf.raw_ops.PlaceholderWithDefault(input=x, shape=x.shape)

    # -- primitives ------------------------------------------------------------------------------
    def all_reduce(self, x: tf.Tensor, op: str, group: Group) -> tf.Tensor:
        hvd = self._hvd
        hvd_op = {"sum": hvd.Sum, "prod": hvd.Product, "max": hvd.Max, "min": hvd.Min}[op]
        return self._order(lambda: hvd.allreduce(self._live(x), op=hvd_op, name=self._name("allreduce", group),
                                                 ignore_name_scope=True, process_set=group.handle))

    def all_gather(self, x: tf.Tensor, group: Group) -> tf.Tensor:
        return self._order(lambda: self._hvd.allgather(self._live(x), name=self._name("allgather", group),
                                                       ignore_name_scope=True, process_set=group.handle))

    def broadcast(self, x: tf.Tensor, root: int, group: Group) -> tf.Tensor:
        return self._order(lambda: self._hvd.broadcast(
            self._live(x), root_rank=group.global_rank(root), name=self._name("broadcast", group),
            ignore_name_scope=True, process_set=group.handle))

    def all_to_all(self, x: tf.Tensor, group: Group) -> tf.Tensor:
        return self._order(lambda: self._hvd.alltoall(self._live(x), name=self._name("alltoall", group),
                                                      ignore_name_scope=True, process_set=group.handle))

    def _pair(self, other: int) -> Group:
        if not self._pairs:
            raise ConfigError(f"tfdist.comm.send/recv with the Horovod backend are available up to {P2P_MAX_SIZE} "
                              f"processes (this job has {self.size}); use the TF backend, or broadcast in a group "
                              "made with tfdist.comm.new_group([src, dst]) on every rank.")
        ranks = tuple(sorted((self.rank, other)))
        process_set = self._process_set(ranks)
        return Group(ranks, ranks.index(self.rank), int(process_set.process_set_id), process_set)

    def send(self, x: tf.Tensor, dst: int) -> tf.Tensor:
        pair = self._pair(dst)
        return self.broadcast(x, pair.ranks.index(self.rank), pair)

    def recv(self, src: int, shape: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
        pair = self._pair(src)
        return self.broadcast(tf.zeros(shape, dtype), pair.ranks.index(src), pair)
