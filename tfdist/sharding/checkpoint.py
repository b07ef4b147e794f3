"""Checkpoints of sharded optimizer state: the logical (unsharded) slot view, and strict loading."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import numpy as np
import tensorflow as tf

from tfdist import compat
from tfdist.errors import ConfigError

if TYPE_CHECKING:
    from tfdist.sharding.zero import ZeroEngine

__all__ = ["LogicalSlot", "load_own_variables_strict", "gathered_state", "cross_process_engine"]


class LogicalSlot(compat.SavedTensor):
    """The unsharded view of one optimizer slot of one variable (e.g. Adam's momentum of a kernel).

    Reading assembles it from the shard owners; writing scatters into them. `.keras` files,
    `tf.train.Checkpoint`, ModelCheckpoint and BackupAndRestore see these, so what they save is the
    full logical optimizer state with the shapes plain Keras uses, and loading it works at any
    number of replicas.
    """

    def __init__(self, engine: ZeroEngine, var: int, slot: str, reference):
        self._engine, self._var, self._slot = engine, var, slot
        self.shape = tuple(reference.shape)
        self.dtype = reference.dtype
        self.name = f"{getattr(reference, 'path', reference.name).replace('/', '_')}_{slot}"
        self.path = f"{engine.optimizer.name}/{self.name}"
        self.trainable = False

    def read(self) -> tf.Tensor:
        return self._engine.state.read(self._var, self._slot)

    def write(self, value) -> None:
        value = tf.convert_to_tensor(value)
        if tuple(value.shape) != self.shape:
            raise ConfigError(f"checkpoint value for optimizer slot {self.path!r} has shape {tuple(value.shape)}, "
                              f"but the model's variable has shape {self.shape}: the checkpoint was written "
                              "for a different model.")
        self._engine.state.write(self._var, self._slot, value)

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
        return f"<LogicalSlot {self.path} shape={self.shape} over {self._engine.layout.num_shards} shards>"


def load_own_variables_strict(self, store):
    """Keras load_own_variables that refuses (instead of skipping with a warning) a mismatched checkpoint."""
    keys = list(store.keys())
    if len(keys) != len(self.variables):
        raise ConfigError(f"optimizer {self.name!r}: the checkpoint holds {len(keys)} optimizer variables but this "
                          f"optimizer has {len(self.variables)}; it was written for a different model or optimizer.")
    for i, variable in enumerate(self.variables):
        value = store[str(i)]
        if tuple(np.shape(value)) != tuple(variable.shape):
            raise ConfigError(f"optimizer variable {variable.path!r} has shape {tuple(variable.shape)} but the "
                              f"checkpoint holds shape {tuple(np.shape(value))}: checkpoint of a different model.")
        variable.assign(value)


def cross_process_engine(model_or_optimizer) -> ZeroEngine | None:
    """The ZeRO engine of a model's optimizer when some of its shards live in other processes, else None."""
    opt = getattr(model_or_optimizer, "optimizer", model_or_optimizer)
    opt = getattr(opt, "inner_optimizer", opt)  # LossScaleOptimizer
    engine = getattr(opt, "_tfdist_zero", None)
    return engine if engine is not None and not engine.comm.all_local else None


@contextlib.contextmanager
def gathered_state(model_or_optimizer):
    """Collective: inside it, the full optimizer state of a multi-process ZeRO run is readable on
    every rank without further collectives (for saving on the chief only). Every rank must enter
    it at the same point; without multi-process ZeRO it does nothing.

    Example:
        >>> with tfdist.sharding.gathered_state(model):   # on every rank
        ...     if strategy.is_chief:
        ...         model.save("model.keras")             # full logical Adam state, plain-Keras loadable
    """
    engine = cross_process_engine(model_or_optimizer)
    if engine is None:
        yield
        return
    with engine.state.gathered():
        yield
