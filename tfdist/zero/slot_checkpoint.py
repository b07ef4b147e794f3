"""Checkpoints of sharded optimizer state: the logical (unsharded) view of one slot, and strict loading."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfdist._compat.tf_runtime import SavedTensor
from tfdist.errors import ConfigError
from tfdist.zero.owned_slots import SlotShards

__all__ = ["LogicalSlot", "load_own_variables_strict"]


class LogicalSlot(SavedTensor):
    """The unsharded view of one optimizer slot of one variable (e.g. Adam's momentum of a kernel).

    Reading assembles it from the shard owners; writing scatters into them. `.keras` files,
    `tf.train.Checkpoint`, ModelCheckpoint and BackupAndRestore see these, so what they save is the
    full logical optimizer state with the shapes plain Keras uses, and loading it works at any
    number of replicas.
    """

    def __init__(self, state: SlotShards, var: int, slot_name: str, reference, optimizer_name: str):
        self.state, self.var, self.slot_name = state, var, slot_name
        self.shape = tuple(reference.shape)
        self.dtype = reference.dtype
        self.name = f"{getattr(reference, 'path', reference.name).replace('/', '_')}_{slot_name}"
        self.path = f"{optimizer_name}/{self.name}"
        self.trainable = False
        self.save_device = state.host_device

    def read(self) -> tf.Tensor:
        return self.state.read(self.var, self.slot_name)

    def write(self, value) -> None:
        value = tf.convert_to_tensor(value)
        if tuple(value.shape) != self.shape:
            raise ConfigError(f"checkpoint value for optimizer slot {self.path!r} has shape {tuple(value.shape)}, "
                              f"but the model's variable has shape {self.shape}: the checkpoint was written "
                              "for a different model.")
        self.state.write(self.var, self.slot_name, value)

    @property
    def value(self) -> tf.Tensor:
        return self.read()

    def numpy(self) -> np.ndarray:
        return self.read().numpy()

    def assign(self, value) -> None:
        self.write(value)

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.numpy(), dtype=dtype)

    def __repr__(self) -> str:
        return f"<LogicalSlot {self.path} shape={self.shape} over {self.state.layout.num_shards} shards>"


def load_own_variables_strict(optimizer, store) -> None:
    """Keras load_own_variables that refuses (instead of skipping with a warning) a mismatched checkpoint."""
    keys = list(store.keys())
    if len(keys) != len(optimizer.variables):
        raise ConfigError(f"optimizer {optimizer.name!r}: the checkpoint holds {len(keys)} optimizer variables but "
                          f"this optimizer has {len(optimizer.variables)}; it was written for a different model or "
                          "optimizer.")
    for i, variable in enumerate(optimizer.variables):
        value = store[str(i)]
        if tuple(np.shape(value)) != tuple(variable.shape):
            raise ConfigError(f"optimizer variable {variable.path!r} has shape {tuple(variable.shape)} but the "
                              f"checkpoint holds shape {tuple(np.shape(value))}: checkpoint of a different model.")
        variable.assign(value)
