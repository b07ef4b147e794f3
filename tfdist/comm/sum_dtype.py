"""The dtype a reduction sums in: values cast to it before the collective and back to their own dtype after.

This is what `grad_dtype=` of the data-parallel strategies means: under a mixed-precision policy Keras keeps the
variables (and so their gradients) in float32, and summing the gradients in bfloat16 or float16 instead halves the
bytes every step sends (Megatron-LM's `grad_reduce_in_fp32=False`, DeepSpeed's `communication_data_type`). The
other way round, bfloat16 gradients of a `"bfloat16"` policy can be summed in float32 (`grad_dtype="float32"`).

The sum is the wire dtype's: it rounds every partial sum to it. Under a LossScaleOptimizer (mixed_float16) the
data-parallel path sums gradients Keras has already unscaled (ZeRO-3 sums them scaled, in the backward), so float16
is refused there (`check_unscaled_sum`): bfloat16 has float32's range.

Example:
    >>> check_sum_dtype("bfloat16")
    tf.bfloat16
    >>> summed_in(tf.bfloat16, [tf.constant([1.0]), tf.constant([2.0])], lambda ts: [ts[0] + ts[1]] * 2)[0].dtype
    tf.float32
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from tfdist.errors import ConfigError

__all__ = ["SUM_DTYPES", "check_sum_dtype", "check_unscaled_sum", "gradient_sum_dtype", "summed_in"]

#: the dtypes a sum can be carried in
SUM_DTYPES = (tf.bfloat16, tf.float16, tf.float32, tf.float64)


def check_sum_dtype(value, parameter: str = "grad_dtype") -> tf.DType | None:
    """`value` ('bfloat16', tf.bfloat16, np.float16, ... or None) as a tf.DType; a ConfigError naming `parameter`
    unless it is one of `SUM_DTYPES`."""
    if value is None:
        return None
    try:
        dtype = tf.as_dtype(np.dtype(value) if isinstance(value, type) else value)
    except (TypeError, ValueError):
        dtype = None
    if dtype not in SUM_DTYPES:
        raise ConfigError(f"{parameter} must be a floating dtype to sum gradients in ('bfloat16', 'float16', "
                          f"'float32' or 'float64'; None sums them in their own dtype), got {value!r}.")
    return dtype


def check_unscaled_sum(dtype: tf.DType | None, optimizers: Sequence, where: str) -> None:
    """ConfigError for float16 sums of gradients a LossScaleOptimizer among `optimizers` (those applying now) has
    already unscaled: there float16 loses the small ones, and a sum that overflows comes after its finite check."""
    import keras

    if dtype == tf.float16 and any(isinstance(o, keras.optimizers.LossScaleOptimizer) for o in optimizers):
        raise ConfigError(
            f"grad_dtype='float16' under a LossScaleOptimizer (mixed_float16): {where} the gradients are summed after "
            "Keras has removed the loss scale, where float16 loses the small ones and a sum that overflows comes "
            "after the finite check. Use grad_dtype='bfloat16' (float32's range), or zero_stage=3 (its "
            "reduce-scatter runs in the backward, on the scaled gradients).")


def gradient_sum_dtype(dtype: tf.DType | None, where: str) -> tf.DType | None:
    """`dtype` for a reduction made while a Keras optimizer applies gradients (the gradients' sum), checked by
    `check_unscaled_sum`; None for any other reduction (a metric's, a synchronized statistic's) or `dtype` None."""
    from tfdist._compat import keras_optimizer

    optimizers = keras_optimizer.applying()
    if dtype is None or not optimizers:
        return None
    check_unscaled_sum(dtype, optimizers, where)
    return dtype


def summed_in(dtype: tf.DType | None, tensors: Sequence[tf.Tensor], reduce: Callable[[list], list],
              devices: Sequence[str | None] | None = None) -> list[tf.Tensor]:
    """`reduce(tensors cast to dtype)`, each result cast back to its input's dtype; `reduce` takes and returns one
    tensor per local replica (`devices[i]`: where replica i's casts run; None: next to the tensor). `dtype` None,
    or the tensors' own: `reduce(tensors)` untouched."""
    tensors = list(tensors)
    if dtype is None or all(t.dtype == dtype for t in tensors):
        return reduce(tensors)
    devices = list(devices) if devices is not None else [None] * len(tensors)
    sent = []
    for t, device in zip(tensors, devices):
        with _on(device):
            sent.append(tf.cast(t, dtype))
    out = []
    for s, t, device in zip(reduce(sent), tensors, devices):
        with _on(device):
            out.append(tf.cast(s, t.dtype))
    return out


def _on(device: str | None):
    return contextlib.nullcontext() if device is None else tf.device(device)
