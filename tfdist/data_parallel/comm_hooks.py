"""Communication hooks: how each gradient bucket is all-reduced (PyTorch DDP's `register_comm_hook`).

A hook is any callable `hook(bucket: tfdist.data_parallel.buckets.GradBucket) -> list[tf.Tensor]`. It is called once
per bucket while the training step is traced (inside the step's `tf.function`, in cross-replica context):

- `bucket.buffers`: one flat tensor per local replica, the bucket's gradients concatenated (already scaled
  by Keras: their plain sum over all replicas is the step's gradient);
- `bucket.gradients`, `bucket.gradient_ids`, `bucket.devices`, `bucket.index`, `bucket.num_replicas`;
- `bucket.all_reduce(tensors)`: one tensor per local replica in, their sum over every replica of the job
  out (a collective: call it the same number of times with the same shapes on every process).

It returns the summed buffers, one flat tensor per local replica, each as long as `bucket.buffers[i]`
(cast back to the gradients' dtype). Anything else is a `ConfigError` naming the hook and the bucket.
Built-ins: `fp16_compress`, `bf16_compress` and `tfdist.data_parallel.powersgd.PowerSGD`.

Example:
    >>> def halve_then_double(bucket):                  # a user hook: sum, as the plain path would
    ...     halved = [b / 2 for b in bucket.buffers]
    ...     return [s * 2 for s in bucket.all_reduce(halved)]
    >>> strategy.register_comm_hook(halve_then_double)   # before the first step is traced
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from tfdist.errors import ConfigError

__all__ = ["HOOKS", "bf16_compress", "fp16_compress", "hook_from"]


def _compress(bucket, wire: tf.DType) -> list[tf.Tensor]:
    sent = []
    for buffer, device in zip(bucket.buffers, bucket.devices):
        with tf.device(device):
            sent.append(tf.cast(buffer, wire))
    summed = bucket.all_reduce(sent)
    out = []
    for s, buffer, device in zip(summed, bucket.buffers, bucket.devices):
        with tf.device(device):
            out.append(tf.cast(s, buffer.dtype))
    return out


def fp16_compress(bucket) -> list[tf.Tensor]:
    """Each bucket travels (and is summed) as float16, then is cast back: half the bytes of float32.

    Keras divides the loss by the number of replicas before the gradients, so the sum stays in float16's
    range as long as the mean gradient does (PyTorch's fp16 hook divides by the world size for the same
    reason)."""
    return _compress(bucket, tf.float16)


def bf16_compress(bucket) -> list[tf.Tensor]:
    """Each bucket travels as bfloat16 (float32's range, 8 bits of mantissa), then is cast back."""
    return _compress(bucket, tf.bfloat16)


HOOKS: dict[str, Callable] = {"fp16": fp16_compress, "bf16": bf16_compress}


def hook_from(value) -> Callable:
    """A hook from a callable, 'fp16', 'bf16', or 'powersgd' / 'powersgd:R' (PowerSGD of rank R, default 4)."""
    if callable(value):
        return value
    if isinstance(value, str):
        if value in HOOKS:
            return HOOKS[value]
        name, _, rank = value.partition(":")
        if name == "powersgd" and (not rank or rank.isdigit()):
            from tfdist.data_parallel.powersgd import PowerSGD

            return PowerSGD(rank=int(rank or 4))
    raise ConfigError(f"hook must be a callable(bucket) -> list of tensors, 'fp16', 'bf16', 'powersgd' or "
                      f"'powersgd:RANK'; got {value!r}.")
