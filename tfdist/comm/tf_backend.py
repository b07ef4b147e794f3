"""The TensorFlow backend of `tfdist.comm`: TF's V2 collective ops between the processes of a TF_CONFIG
cluster (ranks: chief first, then workers), started by `runtime.start_server`.

- all_reduce: `CollectiveReduceV2` (merge Add/Mul/Max/Min);
- all_gather: `CollectiveGatherV2` (equal shapes; the API pads per-rank first dimensions);
- broadcast: `CollectiveBcastSendV2` on the root, `CollectiveBcastRecvV2` elsewhere;
- all_to_all: `CollectiveAllToAllV2`;
- send/recv: a broadcast in a two-member group per (sender, receiver) direction.

Group keys lie in tfdist.comm's range (`_compat.distribute.COMM_KEY_BASE` up, above every strategy's
keys): the server's own groups from COMM_KEY_BASE + 1, the world at WORLD_KEY, new_group()s above it,
send/recv pairs from PAIR_KEY_BASE (src * size + dst; group keys are int32, so up to 28 000 processes).
Instance keys count per group and are taken at call time (`_compat.tf_runtime.call_time_value`), so
every process numbers its collectives alike even when tf.functions are traced at different moments.
In a tf.function the ops run in program order, each even when its result is unused (`ProgramOrder`);
TF keeps repeated runs in a tf.while_loop apart by frame and iteration. A peer that does not take part fails an
op with DeadlineExceeded after `timeout_s`: eagerly through `deadline.bounded` (an abort), in a tf.function
through the op's own `timeout_seconds`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf

from tfdist._compat import tf_runtime
from tfdist._compat.distribute import COMM_KEY_BASE
from tfdist._compat.ring import RING_MAX_SUBDIVS
from tfdist.comm.deadline import bounded, op_timeout
from tfdist.comm.process_group import Backend, Group
from tfdist.comm.program_order import ProgramOrder
from tfdist.comm.runtime import start_server
from tfdist.comm.tf_config import MULTI_WORKER_JOBS, ClusterConfig

__all__ = ["PAIR_KEY_BASE", "WORLD_KEY", "TFBackend"]

WORLD_KEY = COMM_KEY_BASE + (1 << 16)  # below: the server strategy's own groups
PAIR_KEY_BASE = COMM_KEY_BASE + (1 << 28)  # WORLD_KEY..PAIR_KEY_BASE: new_group()
_MERGE = {"sum": "Add", "prod": "Mul", "max": "Max", "min": "Min"}
_NATIVE = frozenset({tf.float16, tf.float32, tf.float64, tf.int32, tf.int64})


class TFBackend(Backend):
    """TF collective ops between the tasks of `config` (None, or a cluster of one task: a single
    process, rank 0 of 1, no server).

    Example (on both processes of a 2-worker TF_CONFIG):
        >>> backend = TFBackend(parse_tf_config(os.environ["TF_CONFIG"]), timeout_s=60)
        >>> backend.rank, backend.size
        (1, 2)   # (0, 2) on the other process
    """

    name = "tf"
    move_dtypes = _NATIVE
    reduce_dtypes = frozenset(_NATIVE | {tf.bfloat16})

    def __init__(self, config: ClusterConfig | None, timeout_s: float):
        self.timeout_s = float(timeout_s)
        tasks = ([(job, i, addr) for job in MULTI_WORKER_JOBS for i, addr in enumerate(config.cluster.get(job, []))]
                 if config is not None else [("worker", 0, "localhost:0")])
        self.rank, self.size = (config.rank if config is not None else 0), len(tasks)
        host = tasks[self.rank][2].rpartition(":")[0]
        same_host = [r for r, (_, _, addr) in enumerate(tasks) if addr.rpartition(":")[0] == host]
        self.local_rank, self.local_size = same_host.index(self.rank), len(same_host)
        self.server = start_server(config, self.timeout_s) if self.size > 1 else None
        job, index, _ = tasks[self.rank]
        self.device = f"/job:{job}/replica:0/task:{index}/device:CPU:0" if self.size > 1 else "/device:CPU:0"
        self.world = Group(tuple(range(self.size)), self.rank, WORLD_KEY)
        self._groups = 0
        self._instance: dict[int, int] = {}
        self._order = ProgramOrder()

    def new_group(self, ranks: Sequence[int]) -> Group:
        self._groups += 1
        ranks = tuple(ranks)
        return Group(ranks, ranks.index(self.rank) if self.rank in ranks else None, WORLD_KEY + self._groups)

    # -- instance keys and order -----------------------------------------------------------------
    def _next_key(self, group_key: int) -> int:
        self._instance[group_key] = self._instance.get(group_key, 0) + 1
        return self._instance[group_key]

    def _instance_key(self, group_key: int) -> int | tf.Tensor:
        """An int eagerly; in a tf.function, a value fed at each call (so retracing on one process
        only does not shift the numbering)."""
        def at_call() -> tf.Tensor:
            key = self._instance_key(group_key)  # an int when the function runs eagerly
            if isinstance(key, int):
                with tf.device("/device:CPU:0"):
                    return tf.constant(key, tf.int32)
            return key  # a function called inside another: its key comes from the outer call

        captured = tf_runtime.call_time_value(at_call, tf.TensorSpec([], tf.int32))
        return self._next_key(group_key) if captured is None else captured

    def _ordered(self, make: Callable[[], tf.Tensor]) -> tf.Tensor:
        """Creates one collective on this process's device, in program order (eagerly: runs it, bounded)."""
        with tf.device(self.device):
            return bounded(self.timeout_s, lambda: self._order(make))

    # -- primitives ------------------------------------------------------------------------------
    def all_reduce(self, x: tf.Tensor, op: str, group: Group) -> tf.Tensor:
        return self._ordered(lambda: tf.raw_ops.CollectiveReduceV2(
            input=x, group_size=group.size, group_key=group.key, instance_key=self._instance_key(group.key),
            ordering_token=[], merge_op=_MERGE[op], final_op="Id", timeout_seconds=op_timeout(self.timeout_s),
            max_subdivs_per_device=RING_MAX_SUBDIVS))

    def all_gather(self, x: tf.Tensor, group: Group) -> tf.Tensor:
        return self._ordered(lambda: tf.raw_ops.CollectiveGatherV2(
            input=x, group_size=group.size, group_key=group.key, instance_key=self._instance_key(group.key),
            ordering_token=[], timeout_seconds=op_timeout(self.timeout_s)))

    def all_to_all(self, x: tf.Tensor, group: Group) -> tf.Tensor:
        rows = tf.reshape(x, [group.size, -1])  # the kernel wants one row per member
        out = self._ordered(lambda: tf.raw_ops.CollectiveAllToAllV2(
            input=rows, group_size=group.size, group_key=group.key, instance_key=self._instance_key(group.key),
            ordering_token=[], timeout_seconds=op_timeout(self.timeout_s)))
        return tf.reshape(out, tf.shape(x))

    def broadcast(self, x: tf.Tensor, root: int, group: Group) -> tf.Tensor:
        if group.rank == root:
            return self._send(x, group.size, group.key)
        return self._recv(tf.shape(x), x.dtype, group.size, group.key)

    def send(self, x: tf.Tensor, dst: int) -> tf.Tensor:
        return self._send(x, 2, PAIR_KEY_BASE + self.rank * self.size + dst)

    def recv(self, src: int, shape: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
        return self._recv(shape, dtype, 2, PAIR_KEY_BASE + src * self.size + self.rank)

    def _send(self, x: tf.Tensor, group_size: int, group_key: int) -> tf.Tensor:
        return self._ordered(lambda: tf.raw_ops.CollectiveBcastSendV2(
            input=x, group_size=group_size, group_key=group_key, instance_key=self._instance_key(group_key),
            timeout_seconds=op_timeout(self.timeout_s)))

    def _recv(self, shape: tf.Tensor, dtype: tf.DType, group_size: int, group_key: int) -> tf.Tensor:
        return self._ordered(lambda: tf.raw_ops.CollectiveBcastRecvV2(
            group_size=group_size, group_key=group_key, instance_key=self._instance_key(group_key),
            shape=shape, T=dtype, timeout_seconds=op_timeout(self.timeout_s)))
