"""Reductions of a mesh whose rows are in several processes: local rows first, then one TF collective per device.

`DeviceGroupAllReduce` is the CrossDeviceOps of `tfdist.ModelParallelStrategy` across processes. A value (a
shard's gradient, a replicated variable's, a metric) is first summed over this process's rows on the device it is
reduced to (row 0's device for that shard, as inside one process), then all-reduced across the processes by a
`CollectiveReduceV2` on that same device: one group per device position, holding that position of every process.
So shard k's gradient never leaves the k-th device of a row, and the processes exchange each shard on its own
device. `ProcessDevices` is the strategy's process group: rank, size, and every new variable made equal on every
process (a signature check, then rank 0's value).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from tfdist._compat import distribute as tf_distribute
from tfdist._compat.distribute import (
    launcher_all_gather,
    launcher_all_reduce_sum,
    launcher_device,
)
from tfdist.comm.deadline import launched
from tfdist.comm.variable_signature import mismatch_message, signature
from tfdist.errors import ConfigError

__all__ = ["DeviceGroupAllReduce", "ProcessDevices"]



def _key(device: str) -> tuple[str, int]:
    spec = tf.DeviceSpec.from_string(device)
    return (spec.device_type or "CPU").upper(), spec.device_index or 0


class DeviceGroupAllReduce(tf_distribute.ProcessCrossDeviceOps):
    """Sums over this process's replicas on the destination's first device, then across processes there.

    Args:
        launchers: one collective launcher per local device (`tfdist.tensor_parallel._tf_rows.device_launchers`),
            every process listing the same device positions in the same order; the first is the host's.
        num_processes: processes in the job.

    Example (what ModelParallelStrategy builds on each of 2 processes with one row of 2 devices):
        >>> ops = DeviceGroupAllReduce(device_launchers(strategy, ["/cpu:0", "/cpu:1"], 2, 60.0), 2)
    """

    def __init__(self, launchers: Sequence, num_processes: int):
        super().__init__()
        self.num_processes = int(num_processes)
        self._launchers = list(launchers)
        self._by_device = {_key(launcher_device(la)): la for la in self._launchers}

    def launcher_for(self, device: str):
        """The launcher of `device` (by type and index); the host's for a device outside the mesh."""
        return self._by_device.get(_key(device), self._launchers[0])

    # -- CrossDeviceOps hooks ----------------------------------------------------------------------
    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        return self._reduce(reduce_op, [(per_replica_value, destinations)])[0]

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        return self._reduce(reduce_op, value_destination_pairs)

    def gather_implementation(self, per_replica_value, destinations, axis):
        parts = tf_distribute.local_values(per_replica_value)
        device = tf_distribute.devices_of(destinations)[0]
        launcher = self.launcher_for(device)
        with tf.device(launcher_device(launcher)):
            local = tf.concat([tf.identity(p) for p in parts], axis=axis)
            perm = [axis] + [i for i in range(local.shape.rank) if i != axis]
            gathered = launched(launcher_all_gather, launcher, tf.transpose(local, perm) if axis else local)
            if axis:
                gathered = tf.transpose(gathered, np.argsort(perm).tolist())
        return self.broadcast(gathered, destinations)

    # -- the two stages ------------------------------------------------------------------------------
    def _reduce(self, reduce_op, pairs) -> list:
        out = []
        for value, destinations in pairs:
            parts = [tf.convert_to_tensor(p) for p in tf_distribute.local_values(value)]  # IndexedSlices: dense
            # Where the value is reduced: the destination's first device (row 0's device of this shard).
            launcher = self.launcher_for(tf_distribute.devices_of(destinations)[0])
            with tf.device(launcher_device(launcher)):
                local = tf.math.add_n(parts) if len(parts) > 1 else tf.identity(parts[0])
                total = self.all_reduce_sum(launcher, local)
                if reduce_op == tf.distribute.ReduceOp.MEAN:
                    count = len(parts) * self.num_processes
                    total = total / count if total.dtype.is_floating else total // count
            out.append(self.broadcast(total, destinations))
        return out

    @staticmethod
    def all_reduce_sum(launcher, tensor: tf.Tensor) -> tf.Tensor:
        """CollectiveReduceV2 (sum) over the launcher's group; bool values travel as int32."""
        if tensor.dtype == tf.bool:
            return tf.cast(launched(launcher_all_reduce_sum, launcher, tf.cast(tensor, tf.int32)), tf.bool)
        return launched(launcher_all_reduce_sum, launcher, tensor)


class ProcessDevices:
    """The processes of a cross-process mesh, for `MultiProcessExtended`: rank, size, and identical variables.

    Every new variable is checked across processes (an all-gather of its index/shape/dtype signature: processes
    that build different models get a ConfigError naming the variable, not a hang), then rank 0's value is
    summed with zeros from the others, so every process starts from rank 0's weights, bit for bit.

    Example:
        >>> group = ProcessDevices(rank=1, size=2, launcher=ops.launcher_for("/cpu:0"))
    """

    def __init__(self, rank: int, size: int, launcher):
        self.rank, self.size = int(rank), int(size)
        self._launcher = launcher
        self._created = 0

    def on_variable_created(self, var) -> None:
        index = self._created
        self._created += 1
        with tf.init_scope():
            if not tf.executing_eagerly():
                return  # TF1-style graph building: nothing to run now
            shape = var.shape.as_list() if var.shape.rank is not None else []
            own = signature(index, shape, var.dtype)
            with tf.device(launcher_device(self._launcher)):
                gathered = launched(launcher_all_gather, self._launcher, tf.constant(own[None, :])).numpy()
            if not (gathered == own[None, :]).all():
                raise ConfigError(mismatch_message("ModelParallelStrategy", "process", index, var, gathered))
            if tf_distribute.is_mirrored(var):  # sync-on-read metric states start at zero everywhere already
                value = tf.convert_to_tensor(tf_distribute.local_values(var)[0])
                with tf.device(launcher_device(self._launcher)):
                    mine = value if self.rank == 0 else tf.zeros_like(value)
                    var.assign(DeviceGroupAllReduce.all_reduce_sum(self._launcher, mine))

