"""Keras initializers evaluated block by block of rows on each shard's server, so no process computes a
whole sharded variable.

Keras 3 (TF backend) creates a variable with `tf.Variable(lambda: initializer(self._shape, dtype=self._dtype))`
(keras/src/backend/tensorflow/core.py, `Variable._initialize_with_initializer`) and passes no shape, so
TensorFlow's parameter-server strategy calls the lambda once, on the coordinator, for the whole table and
slices it. `keras_initializer(initial_value)` reads the initializer, shape and dtype back out of that
lambda. The strategy then creates each shard as zeros on its server and `fill`s it there in blocks of
BLOCK_BYTES: a server's peak is its shard plus a few blocks (an eager random initializer alone holds
three shard-sized tensors: draws, scaled, shifted). `for_shard(...)` gives, for a block of rows, an
initializer with the distribution of the same rows of the whole variable:

- Zeros, Ones and a scalar Constant: the same object; the values equal the unsharded ones exactly;
- RandomUniform, RandomNormal, TruncatedNormal: the same class with a seed derived from the shard's
  first row (an integer seed would otherwise give every equally-shaped shard the same values);
- VarianceScaling and its subclasses (GlorotUniform, HeNormal, ...): the scale computed from the
  *whole* shape (fans), then a uniform / normal / truncated normal of that spread per shard.

Blocks are aligned to global rows (block k holds rows [k*B, (k+1)*B) of the whole variable; a shard
boundary inside a block draws the whole block and keeps its part), so with an integer seed a row's
value depends on the seed and its row only, not on the number of servers. Random values still differ
from an unsharded initialisation (same distribution, other draws). Anything else (Orthogonal, Identity,
a callable) gives None and is initialised whole, as TensorFlow does.
"""

from __future__ import annotations

import tfdist._compat  # noqa: F401  (the TF/Keras version check, before any reach-in below)

import math
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.common.variables import Variable as _KerasVariable
from keras.src.initializers.random_initializers import compute_fans as _compute_fans

__all__ = ["BLOCK_BYTES", "fill", "for_shard", "keras_initializer"]

BLOCK_BYTES = 16 << 20  # rows initialised per step on a server (a random initializer holds 3 such blocks)

_SAME_VALUES = (keras.initializers.Zeros, keras.initializers.Ones)
_RESEEDED = (keras.initializers.RandomUniform, keras.initializers.RandomNormal, keras.initializers.TruncatedNormal)


def keras_initializer(initial_value) -> tuple[Callable, tuple[int, ...], str] | None:
    """(initializer, shape, dtype) of the lambda Keras hands to tf.Variable, or None for any other value."""
    code = getattr(initial_value, "__code__", None)
    if code is None or code.co_freevars != ("initializer", "self") or code.co_argcount:
        return None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in initial_value.__closure__)))
    variable = cells["self"]
    if not isinstance(variable, _KerasVariable) or variable._shape is None:
        return None
    return cells["initializer"], tuple(variable._shape), variable._dtype


def _shard_seed(seed: int, first_row: int) -> int:
    return int(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, first_row]).generate_state(1)[0] % (2**31 - 1))


def _scale_of(init: keras.initializers.VarianceScaling, shape: tuple[int, ...]) -> float:
    # What VarianceScaling.__call__ computes for the whole shape (keras/src/initializers/random_initializers.py).
    fan_in, fan_out = _compute_fans(shape, input_axes=init.input_axes, output_axes=init.output_axes)
    fan = {"fan_in": fan_in, "fan_out": fan_out}.get(init.mode, (fan_in + fan_out) / 2.0)
    return init.scale / max(1.0, fan)


def for_shard(initializer, shape: tuple[int, ...], first_row: int) -> Callable | None:
    """An initializer for rows [first_row, first_row + n) of a variable of `shape` (split on axis 0), called
    as `init(shard_shape, dtype=...)`; None when `initializer` has no per-shard form."""
    kind = type(initializer)
    if kind in _SAME_VALUES:
        return initializer
    if kind is keras.initializers.Constant:
        return initializer if np.ndim(initializer.value) == 0 else None
    if kind in _RESEEDED or (isinstance(initializer, keras.initializers.VarianceScaling)
                             and kind.__call__ is keras.initializers.VarianceScaling.__call__):
        seed = initializer.seed
        if isinstance(seed, (int, np.integer)):
            seed = _shard_seed(seed, first_row)
        elif kind in _RESEEDED:
            return initializer  # a SeedGenerator: every call (shard) draws new values already
        if kind in _RESEEDED:
            return kind.from_config({**initializer.get_config(), "seed": seed})
        scale = _scale_of(initializer, shape)
        if initializer.distribution == "truncated_normal":
            return keras.initializers.TruncatedNormal(0.0, math.sqrt(scale) / 0.87962566103423978, seed=seed)
        if initializer.distribution == "untruncated_normal":
            return keras.initializers.RandomNormal(0.0, math.sqrt(scale), seed=seed)
        limit = math.sqrt(3.0 * scale)
        return keras.initializers.RandomUniform(-limit, limit, seed=seed)
    return None


def fill(shards: list[tf.Variable], initializer, shape: tuple[int, ...], dtype) -> None:
    """Writes `initializer`'s values into `shards` (consecutive row ranges of a variable of `shape`, created
    as zeros), block by block, each block drawn on its shard's device. Zeros need no writing."""
    if type(initializer) is keras.initializers.Zeros:
        return
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * tf.as_dtype(dtype).size
    block = max(1, BLOCK_BYTES // max(1, row_bytes))
    first = 0
    for shard in shards:
        rows = int(shard.shape[0])
        with tf.init_scope(), tf.device(shard.device):  # eagerly, even if created while a function is traced
            for start in range(first - first % block, first + rows, block):
                size = min(block, shape[0] - start)
                values = for_shard(initializer, shape, start)((size, *shape[1:]), dtype=dtype)
                lo, hi = max(start, first), min(start + size, first + rows)
                tf.raw_ops.ResourceStridedSliceAssign(  # in place: rows [lo, hi) of the shard
                    ref=shard.handle, begin=[lo - first], end=[hi - first], strides=[1],
                    value=values[lo - start:hi - start])
        first += rows
