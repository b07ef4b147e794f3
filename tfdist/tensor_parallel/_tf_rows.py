"""tf.distribute internals for a mesh whose rows live in several processes (ModelParallelStrategy across workers).

- `RowsExtended`: MultiProcessExtended (global replica ids, input sharded per process, every reduction through
  cross-process ops, identical variables at creation) and PlacementExtended (variables mirrored over chosen
  devices, slots remembered) in one: each local mesh row is a replica, and replicas of every process count.
- `device_launchers`: one TF collective launcher per local device, each in its own group of the same device
  position in every process (group keys from the strategy's key base, so every process agrees on them).
- `column_launchers`: one launcher per device of one column of the mesh (several rows per process), in a group of
  that column's devices in every process (ZeRO's groups over the batch axis).
- `SpanExtended` / `SpanRowsExtended`: mesh rows that span processes (the model axis across processes; one row /
  several): one local replica, this process's part of its row; replicated variables start as rank 0's, shards
  (and their slots) are this process's own.
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

__all__ = ["RowsExtended", "SpanExtended", "SpanRowsExtended", "column_launchers", "device_launchers"]

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


class _OwnShards:
    """Variables made under `creating_on` (a row's shards) and their slots belong to this process: every process
    of a row skips the same ones when variables are made to start equal on every process."""

    def _create_own_or_shared(self, create, start_equal, kwargs):
        reference = kwargs.get("colocate_with")
        if not hasattr(self, "_own"):
            self._own: dict[int, object] = {}  # this process's own variables (shards, their slots) by id
        own = self._target_devices is not None or (reference is not None and id(reference) in self._own)
        var = create(**kwargs)
        if own:
            self._own[id(var)] = var
        else:
            start_equal(var)
        return var


class SpanExtended(_OwnShards, PlacementExtended):
    """MirroredExtended with one replica: this process's part of a mesh row that spans processes (SPMD: every
    process of the row runs the same step on the same batch, its own shards, replicated layers on its own first
    device of the row). A variable created outside `creating_on` (a replicated one, a metric, the optimizer's
    scalars) and slots of such variables start as rank 0's (`group.on_variable_created`); shards made under
    `creating_on` and their slots are this process's own and skip it (every process skips the same ones)."""

    def __init__(self, container_strategy, devices: Sequence[str], cross_device_ops, group):
        self.group = group
        super().__init__(container_strategy, devices, cross_device_ops)

    def _create_variable(self, next_creator, **kwargs):
        return self._create_own_or_shared(lambda **kw: super(SpanExtended, self)._create_variable(next_creator, **kw),
                                          self.group.on_variable_created, kwargs)


class SpanRowsExtended(_OwnShards, RowsExtended):
    """Several mesh rows, each spanning processes: this process runs its part of one row (one replica, numbered by
    its row). Input is sharded by row (the processes of a row read the same part of every global batch),
    reductions go over the rows through `cross_device_ops` (groups of the processes at the same place in their
    rows), and replicated variables start as rank 0's over every process (`world`); shards made under
    `creating_on` and their slots are this process's own."""

    def __init__(self, container_strategy, devices: Sequence[str], cross_device_ops, rows, world):
        self.world = world
        super().__init__(container_strategy, devices, cross_device_ops, rows)

    def _create_variable(self, next_creator, **kwargs):
        # PlacementExtended's creation, not MultiProcessExtended's start over the rows (`rows` is not every process)
        return self._create_own_or_shared(lambda **kw: PlacementExtended._create_variable(self, next_creator, **kw),
                                          self.world.on_variable_created, kwargs)


def device_launchers(strategy, devices: Sequence[str], group_size: int, timeout_s: float, first_group: int = 0,
                     tokens: dict | None = None) -> list:
    """One CollectiveReplicaLauncher per device of `devices` (this process's, in an order every process shares):
    launcher i is in group `base + offset + first_group + i` of `group_size` members (device i of every process
    that asks for the same groups). Launchers on one device share one ordering token (also with those of earlier
    calls given the same `tokens` dict), so every collective on a device runs in program order."""
    keys = _cross_device_utils.CollectiveKeys(
        group_key_start=1 + collective_key_base(strategy) + _DEVICE_GROUP_OFFSET + first_group)
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING, timeout_seconds=timeout_s)
    launchers, tokens = [], ({} if tokens is None else tokens)
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
