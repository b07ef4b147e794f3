"""tf.distribute internals for a mesh whose rows live in several processes (ModelParallelStrategy across workers).

- `RowsExtended`: MultiProcessExtended (global replica ids, input sharded per process, every reduction through
  cross-process ops, identical variables at creation) and PlacementExtended (variables mirrored over chosen
  devices, slots remembered) in one: each local mesh row is a replica, and replicas of every process count.
- `device_launchers`: one TF collective launcher per local device, each in its own group of the same device
  position in every process (group keys from the strategy's key base, so every process agrees on them).
- `column_launchers`: one launcher per device of one column of the mesh (several rows per process), in a group of
  that column's devices in every process (ZeRO's groups over the batch axis).
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf
from tensorflow.python.distribute import cross_device_utils as _cross_device_utils

from tfdist._compat.distribute import (
    _KEY_STRIDE,
    MultiProcessExtended,
    PlacementExtended,
    collective_key_base,
)

__all__ = ["RowsExtended", "column_launchers", "device_launchers"]

# Group keys of the per-device groups: three quarters of a key stride above the strategy's base (its own
# MirroredExtended groups count from base + 1, tfdist's ZeRO launchers from base + stride / 2).
_DEVICE_GROUP_OFFSET = 3 * _KEY_STRIDE // 4
# ZeRO's column groups (`column_launchers`): seven eighths of a stride above the base, one key per column.
_COLUMN_GROUP_OFFSET = 7 * _KEY_STRIDE // 8


class RowsExtended(MultiProcessExtended, PlacementExtended):
    """MirroredExtended over this process's mesh rows (one replica per row, named by its first device) whose
    replicas are those of every process, and whose variables can be mirrored over any column of devices
    (`creating_on`). Reductions always meet in a merge_call: a step's gradients live on several devices of a
    row (shard k on the row's k-th device), and the cross-device ops read where each one lives."""

    def _use_merge_call(self) -> bool:
        return True

    def launcher_for(self, device: str):
        """The collective launcher of `device`'s group (that device position in every process)."""
        return self._cross_device_ops.launcher_for(device)


def device_launchers(strategy, devices: Sequence[str], group_size: int, timeout_s: float) -> list:
    """One CollectiveReplicaLauncher per device of `devices` (this process's, in an order every process shares):
    launcher i is in group `base + offset + i` of `group_size` members (device i of every process). Launchers on
    one device share one ordering token, so every collective on a device runs in program order."""
    keys = _cross_device_utils.CollectiveKeys(group_key_start=1 + collective_key_base(strategy) + _DEVICE_GROUP_OFFSET)
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING, timeout_seconds=timeout_s)
    launchers, tokens = [], {}
    for device in devices:
        group_key = keys.get_group_key([device])
        launcher = _cross_device_utils.CollectiveReplicaLauncher(group_key, group_size, keys, device, options)
        if device in tokens:
            launcher._ordering_token = tokens[device]
        tokens.setdefault(device, launcher._ordering_token)
        launchers.append(launcher)
    return launchers


def column_launchers(strategy, devices: Sequence[str], column: int, group_size: int, timeout_s: float,
                     ordered_with: Sequence) -> list:
    """One CollectiveReplicaLauncher per device of `devices` (this process's devices of mesh column `column`, one
    per local row), all in group `base + offset + 1 + column` of `group_size` members: the column's devices in
    every process. Each shares the ordering token of `ordered_with[i]` (the strategy's launcher on the same device),
    so every collective on a device runs in program order. TF ranks a group's members by task, then device index."""
    keys = _cross_device_utils.CollectiveKeys(
        group_key_start=1 + collective_key_base(strategy) + _COLUMN_GROUP_OFFSET + int(column))
    group_key = keys.get_group_key(list(devices))
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING, timeout_seconds=timeout_s)
    launchers = []
    for device, own in zip(devices, ordered_with):
        launcher = _cross_device_utils.CollectiveReplicaLauncher(group_key, group_size, keys, device, options)
        launcher._ordering_token = own._ordering_token
        launchers.append(launcher)
    return launchers
