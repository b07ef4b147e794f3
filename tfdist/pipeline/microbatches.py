"""GPipe micro-batching: a model's call runs as M independent micro-batch chains, then concatenates."""

from __future__ import annotations

import contextlib
import functools
import weakref

import keras
import tensorflow as tf

from tfdist.errors import ConfigError

__all__ = ["check_batch", "pipeline_model_call", "split_batch"]

# model -> its own bound `call`, for models whose call this module wrapped (on that instance only)
_original_calls: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_batch(batch: int | None, replicas: int, micro_batches: int) -> None:
    """ConfigError unless a global `batch` splits into `replicas` pipelines of `micro_batches` equal parts."""
    if batch is None or micro_batches == 1:
        return
    if batch % (replicas * micro_batches):
        raise ConfigError(
            f"micro_batches={micro_batches} does not divide the batch: a batch of {batch} gives "
            f"{batch / replicas:g} samples per pipeline replica ({replicas}), which must split into "
            f"{micro_batches} equal micro-batches. Use a batch size that is a multiple of "
            f"{replicas * micro_batches}.")


def split_batch(x: tf.Tensor, micro_batches: int) -> tuple[list[tf.Tensor], tf.Tensor | None]:
    """Splits `x` along axis 0 into `micro_batches` equal parts; returns (parts, true size or None).

    A batch whose size is known when tracing must divide evenly (ConfigError otherwise). A batch
    of unknown size (the usual tf.data case, where an epoch's last batch can be smaller) is padded
    with zeros to a multiple of `micro_batches` at run time, and the true size is returned so the
    caller can drop the padded rows from the outputs: they then get no gradient, and the loss
    and every weight gradient are those of the real samples. (Uneven or empty micro-batches are
    avoided on purpose: oneDNN convolutions failed on them here, "input depth must be evenly
    divisible by filter depth".)
    """
    size = x.shape[0]
    if size is not None:
        if size % micro_batches:
            raise ConfigError(f"micro_batches={micro_batches} does not divide the per-replica batch of {size}; "
                              f"use a batch size that is a multiple of {micro_batches} per replica.")
        return tf.split(x, micro_batches, axis=0), None
    n = tf.shape(x)[0]
    padded = (n + micro_batches - 1) // micro_batches * micro_batches
    pad = tf.zeros(tf.concat([[padded - n], tf.shape(x)[1:]], axis=0), dtype=x.dtype)
    return tf.split(tf.concat([x, pad], axis=0), micro_batches, axis=0), n


def pipeline_model_call(model: keras.Model, micro_batches: int, streams=None) -> None:
    """Wraps `model.call` so a traced call runs the model once per micro-batch and concatenates.

    The M chains share no tensors until the final concat, so TensorFlow's dataflow executor runs
    micro-batch m on stage k while micro-batch m+1 is on stage k-1: the GPipe schedule (all
    forwards pipelined, then all backwards, since the loss needs every output). Each layer's
    weight gradient is the sum of its M micro-batch gradients, i.e. the gradient of the whole
    batch (up to float summation order).

    BatchNormalization under micro-batches (as in GPipe): in training each micro-batch is
    normalised with its own statistics, and the moving mean/variance are updated once per
    micro-batch (M momentum steps per training step), so results differ from a non-pipelined step
    unless the model has no batch-dependent layers. Inference uses the moving statistics and is
    unaffected. `streams` (a `streams.StageStreams`) learns each layer call's micro-batch.
    (torchgpipe's DeferredBatchNorm, which accumulates statistics over the whole
    batch, is not implemented.)
    """
    if micro_batches == 1:
        return
    original = _original_calls.get(model) or model.call

    @functools.wraps(original)
    def call(inputs, *args, **kwargs):
        flat = tf.nest.flatten(inputs)
        if (any(isinstance(t, keras.KerasTensor) for t in flat) or tf.executing_eagerly()
                or not tf.inside_function()):
            return original(inputs, *args, **kwargs)
        splits = [split_batch(tf.convert_to_tensor(t), micro_batches) for t in flat]
        parts, size = [p for p, _ in splits], splits[0][1]
        mask = kwargs.get("mask")
        masks = None
        if mask is not None:
            masks = [split_batch(m, micro_batches)[0] if tf.is_tensor(m) else [m] * micro_batches
                     for m in tf.nest.flatten(mask)]
        outputs = []
        token = object()  # this traced call: its micro-batches' backward tasks form one schedule
        for m in range(micro_batches):
            chunk = tf.nest.pack_sequence_as(inputs, [p[m] for p in parts])
            kw = dict(kwargs)
            if masks is not None:
                kw["mask"] = tf.nest.pack_sequence_as(mask, [ms[m] for ms in masks])
            with tf.name_scope(f"micro_batch_{m}"), (streams.micro_batch(m, token, micro_batches) if streams
                                                      else contextlib.nullcontext()):
                outputs.append(original(chunk, *args, **kw))

        def gather(*xs):
            joined = tf.concat(xs, axis=0)
            return joined if size is None else joined[:size]

        return tf.nest.map_structure(gather, *outputs)

    _original_calls[model] = original
    model.call = call
