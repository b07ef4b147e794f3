"""FsdpParam: the storage behind a Keras variable under ZeRO stage 3 — one piece per replica, full only when read."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import tensorflow as tf

from tfdist._compat.tf_runtime import SavedTensor
from tfdist.errors import ConfigError
from tfdist.zero.fsdp._keras import local_replica_index

__all__ = ["FsdpParam", "current_unit"]

_ids = itertools.count()
_active = threading.local()  # the FSDP unit whose call runs in this thread (for error messages)


def current_unit() -> list:
    """Stack of layer names whose ZeRO-3 call runs in this thread."""
    if not hasattr(_active, "stack"):
        _active.stack = []
    return _active.stack


class FsdpParam(SavedTensor):
    """What a Keras variable's backend value becomes under ZeRO stage 3.

    `components[i]` is local replica i's piece of the variable: elements [r * k, (r + 1) * k) of
    the flattened variable (zero-padded to N * k), r = its global replica, as a plain tf.Variable of
    shape [k] on that replica's device. Nothing holds the full variable: its FSDP unit all-gathers the
    pieces for each forward and backward; `read()` assembles it on the host for saving and
    `get_weights`; `write()` scatters a full value (loading, `set_weights`, tf.train.Checkpoint).

    Inside a replica (a training step), the Keras variable is not readable as a tensor: only its own
    layer's call may use it, through the unit. A read elsewhere (another layer sharing the weight, a
    regularizer, a constraint) raises a ConfigError naming both. `handle` is the local piece's, which is
    what a GradientTape differentiates, so Keras' `tape.gradient(loss, model.trainable_weights)`
    returns each replica's reduce-scattered gradient piece.

    Example:
        >>> # zero_stage=3 on 4 replicas, Sequential([Input((8,)), Dense(16), Dense(10)]) made in its scope
        >>> model.fit(x, y, epochs=1)                             # the first fit shards the weights
        >>> param = model.layers[0].kernel.value                  # the Keras variable's storage
        >>> param.shape, [tuple(c.shape) for c in param.components]
        (TensorShape([8, 16]), [(32,), (32,), (32,), (32,)])
        >>> model.layers[0].kernel.numpy().shape                  # assembled on read
        (8, 16)
    """

    def __init__(self, name: str, shape, dtype, components: list, num_shards: int, host_device: str,
                 shard_ids: list[int] | None = None, gather=None):
        self.name = name
        self.path = name
        self.shape = tf.TensorShape(shape)
        self.dtype = tf.as_dtype(dtype)
        self.components = list(components)
        self.num_shards = int(num_shards)
        self.size = int(np.prod(self.shape.as_list(), dtype=np.int64))
        self.piece_size = int(components[0].shape[0])
        self.save_device = host_device
        self.trainable = True
        self.owner: str | None = None  # name of the layer whose unit gathers it
        self._unique_id = f"tfdist_fsdp_{next(_ids)}"
        # Global replica (piece) index of each local component; across processes, the other pieces live
        # in other processes and `gather(param)` (the engine's, collective) assembles the flat value.
        self.shard_ids = list(range(len(self.components))) if shard_ids is None else list(shard_ids)
        self._gather = gather

    # --- the full (logical) value ----------------------------------------------------------------
    @property
    def all_local(self) -> bool:
        """True when every piece lives in this process."""
        return len(self.components) == self.num_shards

    def read(self) -> tf.Tensor:
        """The full value on the host. Across processes a collective (every process reads the same
        variables in the same order; see `Zero3Engine.gather_param`)."""
        if not self.all_local:
            flat = self._gather(self)
        else:
            parts = []
            for c in self.components:
                with tf.device(c.device):
                    parts.append(tf.identity(c))
            flat = tf.concat(parts, 0) if len(parts) > 1 else parts[0]
        with tf.device(self.save_device):
            return tf.reshape(flat[:self.size], self.shape)

    def write(self, value) -> None:
        value = tf.convert_to_tensor(value)
        if tuple(value.shape) != tuple(self.shape):
            raise ConfigError(f"checkpoint value for {self.name!r} has shape {tuple(value.shape)}, but the model's "
                              f"variable has shape {tuple(self.shape)}: the checkpoint was written for a "
                              "different model.")
        k, n = self.piece_size, self.num_shards
        flat = tf.pad(tf.reshape(tf.cast(value, self.dtype), [-1]), [[0, k * n - self.size]])
        for r, c in zip(self.shard_ids, self.components):  # this process's pieces only
            with tf.device(c.device):
                c.assign(flat[r * k:(r + 1) * k])

    # --- the tf.Variable surface Keras uses ---------------------------------------------------------
    def local_piece(self) -> tf.Variable:
        """This replica's piece (inside a replica function)."""
        ctx = tf.distribute.get_replica_context()
        if ctx is None or not tf.distribute.has_strategy():
            raise ConfigError(f"ZeRO stage 3: {self.name!r} has one piece per replica; its local piece exists "
                              "only inside strategy.run (a training step).")
        return self.components[local_replica_index(ctx)]

    @property
    def handle(self):
        return self.local_piece().handle

    @property
    def device(self) -> str:
        return self.save_device

    def value(self) -> tf.Tensor:
        return _convert(self)

    def read_value(self) -> tf.Tensor:
        return _convert(self)

    def numpy(self) -> np.ndarray:
        return self.read().numpy()

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.numpy(), dtype=dtype)

    def assign(self, value, use_locking=None, name=None, read_value=False):
        if _in_replica():
            raise ConfigError(f"ZeRO stage 3: {self.name!r} (a weight of layer {self.owner!r}) was assigned inside "
                              "a training step (a constraint or custom update?); its pieces are updated by "
                              "the ZeRO engine only.")
        self.write(value)

    @property
    def _shared_name(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return (f"<FsdpParam {self.name} shape={tuple(self.shape)} in {len(self.components)} pieces of "
                f"{self.piece_size}>")


def _in_replica() -> bool:
    return tf.distribute.has_strategy() and tf.distribute.get_replica_context() is not None


def _convert(param: FsdpParam, dtype=None, name=None, as_ref=False) -> tf.Tensor:
    if _in_replica():
        units = current_unit()
        where = f"inside the call of layer {units[-1]!r}" if units else "outside its layer's call"
        raise ConfigError(
            f"ZeRO stage 3: weight {param.name!r} of layer {param.owner!r} was read {where} (another layer "
            "reading it, a regularizer, a constraint or a metric). Under zero_stage=3 a weight is all-gathered "
            "only for the call of the layer that owns it: share the layer itself (call it twice) instead of "
            "its weights, drop the regularizer/constraint, or use zero_stage=2.")
    value = param.read()
    return value if dtype is None else tf.cast(value, dtype)


tf.register_tensor_conversion_function(FsdpParam, _convert)
