"""The split forward of Dense, Conv and Embedding layers (ReversibleEmbedding both ways), and `split_layer_call`,
which swaps it in.

Column-parallel layers (output features split) copy their input to every shard's device (Megatron's f) and
return the logical activation, remembering its shards; row-parallel layers (input features split) read those
shards, compute partial products on each device and sum them (Megatron's g). EinsumDense (attention
projections) lives in `tensor_parallel_einsum`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import keras
import tensorflow as tf

from tfdist.tensor_parallel import _keras_layers as tp_compat
from tfdist.tensor_parallel.einsum import einsum_column, einsum_row, set_split_axis
from tfdist.tensor_parallel.ops import (
    copy_to_shards,
    gather_from_shards,
    on_device,
    reduce_from_shards,
    remember_shards,
    shards_of,
    split_to_shards,
)
from tfdist.tensor_parallel.span import gathers_lazily, logical_value, position, row_of, row_size

__all__ = ["KINDS", "bias_part", "split_layer_call"]

KINDS = ("column", "row", "vocab", "embedding_features", "reversible", "einsum_column", "einsum_row", "conv_column",
         "conv_row")


def bias_part(bias_shards, bias, k: int, devices):
    """The bias of this process's k-th shard: its own shard, or its slice (model position) of a whole bias."""
    if bias_shards is not None:
        return bias_shards[k]
    if bias is None:
        return None
    size, at = bias.shape[0] // row_size(devices), position(devices, k)
    return tf.convert_to_tensor(bias)[at * size:(at + 1) * size]


def _column(layer, x, shards: dict, devices, home, op, bias):
    """Output features split (Dense/Conv): each device computes its slice of the output from a copy of the input
    (Megatron's f), the slices are concatenated and remembered so that a following row layer reads them."""
    kernels, bias_shards = shards["kernel"], shards.get("bias")
    xs = copy_to_shards(logical_value(x), devices, home)
    ys = []
    for k, device in enumerate(devices):
        def shard(xk, k=k):
            y = op(xk, kernels[k])
            part = bias_part(bias_shards, bias, k, devices)
            if part is not None:
                y = keras.ops.add(y, part)
            return layer.activation(y) if layer.activation is not None else y

        ys.append(on_device(device, shard, xs[k]))
    logical = gather_from_shards(ys, home, devices=devices, lazy=gathers_lazily(layer))
    remember_shards(logical, devices, ys)
    return logical


def _row(layer, x, shards: dict, devices, home, op, bias):
    """Input features split (Dense/Conv): partial products on each device, then their sum (Megatron's g)."""
    kernels = shards["kernel"]
    xs = shards_of(x, devices) or split_to_shards(logical_value(x), devices, home)
    parts = [on_device(device, lambda xk, k=k: op(xk, kernels[k]), xs[k]) for k, device in enumerate(devices)]
    y = reduce_from_shards(parts, devices, home)
    with tf.device(home):
        if bias is not None:
            y = keras.ops.add(y, bias)
        return layer.activation(y) if layer.activation is not None else y


def _dense_column(layer, x, shards: dict, devices, home):
    return _column(layer, x, shards, devices, home, keras.ops.matmul, layer.bias)


def _dense_row(layer, x, shards: dict, devices, home):
    return _row(layer, x, shards, devices, home, keras.ops.matmul, layer.bias)


def _conv_column(layer, x, shards: dict, devices, home):
    """A Conv (channels_last) with its output channels split."""
    return _column(layer, x, shards, devices, home, layer.convolution_op, layer.bias if layer.use_bias else None)


def _conv_row(layer, x, shards: dict, devices, home):
    """A Conv (channels_last) with its input channels split: partial convolutions, then the sum."""
    return _row(layer, x, shards, devices, home, layer.convolution_op, layer.bias if layer.use_bias else None)


def _ids(layer, inputs):
    if inputs.dtype not in (tf.int32, tf.int64):
        inputs = tf.cast(inputs, tf.int32)
    return inputs


def _embedding_vocab(layer, inputs, shards: dict, devices, home):
    tables = shards["embeddings"]
    ids = _ids(layer, inputs)
    rows = tables[0].shape[0]
    parts = []
    for k, device in enumerate(devices):
        def lookup(k=k):
            local = ids - tf.cast(position(devices, k) * rows, ids.dtype)
            inside = tf.logical_and(local >= 0, local < rows)
            found = tf.gather(tf.convert_to_tensor(tables[k]), tf.where(inside, local, tf.zeros_like(local)))
            return found * tf.cast(inside, found.dtype)[..., None]

        parts.append(on_device(device, lookup))
    return tf.cast(reduce_from_shards(parts, devices, home), layer.compute_dtype)


def _embedding_features(layer, inputs, shards: dict, devices, home):
    tables = shards["embeddings"]
    ids = _ids(layer, inputs)
    ys = [on_device(device, lambda k=k: tf.gather(tf.convert_to_tensor(tables[k]), ids))
          for k, device in enumerate(devices)]
    logical = tf.cast(gather_from_shards(ys, home, devices=devices, lazy=gathers_lazily(layer)), layer.compute_dtype)
    remember_shards(logical, devices, ys)
    return logical


def _split_axis(shards: list, logical) -> int:
    """The dimension along which `shards` split the variable `logical` (the one where their shapes differ)."""
    return next(i for i, (part, whole) in enumerate(zip(shards[0].shape, logical.shape)) if part != whole)


def _matmul_split(x, kernels: list, axis: int, devices, home, dtype):
    """x @ kernel for a kernel split along `axis`: its output features (1: each device computes its slice of the
    result from a copy of x, then a gather) or its input features (0: partial products, then their sum)."""
    def product(xk, k):
        return keras.ops.matmul(keras.ops.cast(xk, dtype), keras.ops.cast(kernels[k](), dtype))

    if axis == 1:
        xs = copy_to_shards(logical_value(x), devices, home)
        ys = [on_device(device, lambda xk, k=k: product(xk, k), xs[k]) for k, device in enumerate(devices)]
        return gather_from_shards(ys, home, devices=devices)
    xs = shards_of(x, devices) or split_to_shards(logical_value(x), devices, home)
    parts = [on_device(device, lambda xk, k=k: product(xk, k), xs[k]) for k, device in enumerate(devices)]
    return reduce_from_shards(parts, devices, home)


def _reversible(layer, x, shards: dict, devices, home, reverse: bool = False):
    """ReversibleEmbedding (a tied or untied input/output embedding). Forward: a lookup in the split table, as
    Embedding's. `reverse=True` (the logits, x @ embeddings^T or x @ reverse_embeddings): a vocabulary split of the
    tied table makes the transposed kernel column-parallel, a feature split row-parallel; an untied
    reverse_embeddings splits as a Dense kernel does."""
    if not reverse:
        tables = shards.get("embeddings")
        if tables is None:  # only the reverse kernel is split: the lookup is Keras' own
            return layer.__class__.call(layer, x)
        lookup = _embedding_vocab if _split_axis(tables, layer.embeddings) == 0 else _embedding_features
        y = lookup(layer, x, shards, devices, home)
        if layer.mask_zero:
            tp_compat.set_mask(y, tf.not_equal(x, 0))
        return y
    dtype = layer.reverse_dtype or layer.compute_dtype
    if layer.tie_weights and "embeddings" in shards:
        tables = shards["embeddings"]
        kernels = [lambda k=k: tf.transpose(tf.convert_to_tensor(tables[k])) for k in range(len(tables))]
        logits = _matmul_split(x, kernels, 1 - _split_axis(tables, layer.embeddings), devices, home, dtype)
    elif not layer.tie_weights and "reverse_embeddings" in shards:
        reverse_tables = shards["reverse_embeddings"]
        kernels = [lambda k=k: tf.convert_to_tensor(reverse_tables[k]) for k in range(len(reverse_tables))]
        logits = _matmul_split(x, kernels, _split_axis(reverse_tables, layer.reverse_embeddings), devices, home,
                               dtype)
    else:  # the reverse kernel is whole (untied and not split)
        with tf.device(home):
            return layer.__class__.call(layer, x, reverse=True)
    with tf.device(home):
        if layer.logit_soft_cap is not None:
            cap = layer.logit_soft_cap
            logits = keras.ops.multiply(keras.ops.tanh(keras.ops.divide(logits, cap)), cap)
        return logits


_SPLIT_CALLS = {"column": _dense_column, "row": _dense_row, "vocab": _embedding_vocab,
                "embedding_features": _embedding_features, "reversible": _reversible, "einsum_column": einsum_column,
                "einsum_row": einsum_row, "conv_column": _conv_column, "conv_row": _conv_row}


def split_layer_call(layer: keras.layers.Layer, kind: str, shards: dict[str, list],
                     devices_for_replica: Callable[[], Sequence[str]], kernel_axis: int | None = None) -> None:
    """Makes `layer` compute its split forward (`kind`: one of KINDS) from the
    shard variables `shards[role][k]` on devices_for_replica()[k] (the calling replica's model-axis row; its
    first device is home). Symbolic calls (KerasTensors, model construction) run the layer's own call."""
    if kind not in _SPLIT_CALLS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    original = layer.call
    split = _SPLIT_CALLS[kind]
    if kernel_axis is not None:
        set_split_axis(layer, kernel_axis)

    @functools.wraps(original)
    def call(inputs, *args, **kwargs):
        if isinstance(inputs, keras.KerasTensor):
            return original(inputs, *args, **kwargs)
        devices = row_of(devices_for_replica())
        options = {}
        if kind == "reversible":  # ReversibleEmbedding.call(inputs, reverse=False)
            options["reverse"] = bool(kwargs.get("reverse", args[0] if args else False))
        return split(layer, tf.convert_to_tensor(inputs), shards, devices, devices[0], **options)

    layer.call = call
