"""The split forward of an EinsumDense (attention projections): kernel split along an output letter
(column-parallel, e.g. the heads) or along a contracted letter (row-parallel, e.g. the output projection)."""

from __future__ import annotations

import collections
import weakref

import keras
import tensorflow as tf

from tfdist.tensor_parallel.ops import (
    copy_to_shards,
    gather_from_shards,
    on_device,
    on_device_many,
    reduce_from_shards,
    remember_shards,
    shards_of,
    split_to_shards,
)
from tfdist.tensor_parallel.span import gathers_lazily, logical_value, position, row_size

__all__ = ["einsum_column", "einsum_row", "fuse_projections", "layer_split_axis", "set_split_axis"]

_split_axes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # EinsumDense -> its split kernel dimension


def layer_split_axis(layer) -> int:
    """The kernel dimension of `layer` (an EinsumDense) split over the model axis."""
    return _split_axes[layer]


def set_split_axis(layer, axis: int) -> None:
    _split_axes[layer] = axis


def _einsum_parts(equation: str) -> tuple[str, str, str]:
    inputs, output = equation.split("->")
    x_spec, kernel_spec = inputs.split(",")
    return x_spec, kernel_spec, output


def _einsum_bias_part(layer, bias_shards, k: int, devices, out_axis: int, out_rank: int):
    if bias_shards is not None:
        return bias_shards[k]
    if layer.bias is None:
        return None
    bias = tf.convert_to_tensor(layer.bias)
    dim = out_axis - (out_rank - bias.shape.rank)  # the bias is right-aligned to the output
    if dim < 0 or bias.shape[dim] == 1:
        return bias
    size, at = bias.shape[dim] // row_size(devices), position(devices, k)
    return tf.gather(bias, tf.range(at * size, (at + 1) * size), axis=dim)


def _out_axis(layer) -> int:
    _, kernel_spec, out_spec = _einsum_parts(layer.equation)
    return out_spec.index(kernel_spec[layer_split_axis(layer)])


def _project(layer, shards: dict, xk, k: int, devices):
    """Shard k (this process's k-th) of a column-split EinsumDense's output, from its input on shard k's device."""
    y = keras.ops.einsum(layer.equation, xk, shards["kernel"][k])
    out_rank = len(_einsum_parts(layer.equation)[2])
    bias = _einsum_bias_part(layer, shards.get("bias"), k, devices, _out_axis(layer), out_rank)
    if bias is not None:
        y = keras.ops.add(y, bias)
    return layer.activation(y) if layer.activation is not None else y


# Projections fused like Megatron's QKV projection: EinsumDense -> [(weak layer, shards)] of its group (query,
# key, value of one MultiHeadAttention); (id(input), devices, id(layer)) -> weak (input, logical output).
_groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_fused: collections.OrderedDict = collections.OrderedDict()
_REMEMBERED = 4096


def fuse_projections(members: list[tuple]) -> None:
    """Makes the column-split EinsumDense layers `members` ([(layer, shards)]: an attention's query, key and value
    projections) share one copy of an input they are all called on: one f (one backward sum) instead of three.
    The first of them called on an input computes all of them from it; the others then find their output."""
    group = [(weakref.ref(layer), shards) for layer, shards in members]
    for layer, _ in members:
        _groups[layer] = group


def _fused_column(layer, x, devices, home, group):
    key = (id(x), tuple(devices), id(layer))
    found = _fused.get(key)
    if found is not None and found[0]() is x and found[1]() is not None:
        return found[1]()
    members = [(ref(), shards) for ref, shards in group]
    if any(member is None for member, _ in members):
        return None
    xs = copy_to_shards(x, devices, home)
    outs = [on_device_many(device, lambda xk, k=k: [_project(m, sh, xk, k, devices) for m, sh in members], xs[k])
            for k, device in enumerate(devices)]
    result = None
    for j, (member, _) in enumerate(members):
        ys = [out[j] for out in outs]
        logical = gather_from_shards(ys, home, axis=_out_axis(member), devices=devices, lazy=gathers_lazily(member))
        remember_shards(logical, devices, ys, axis=_out_axis(member))
        _fused[(id(x), tuple(devices), id(member))] = (weakref.ref(x), weakref.ref(logical))
        result = logical if member is layer else result
    while len(_fused) > _REMEMBERED:
        _fused.popitem(last=False)
    return result


def einsum_column(layer, x, shards: dict, devices, home):
    """An EinsumDense whose kernel is split along an output letter (e.g. the heads of an attention projection).
    Fused projections (`fuse_projections`) called on one input copy it once."""
    group = _groups.get(layer)
    # Traced steps only: an eager tensor may be fed again after the weights changed, and eager outputs die at once.
    if group is not None and not tf.executing_eagerly():
        logical = _fused_column(layer, x, devices, home, group)
        if logical is not None:
            return logical
    xs = copy_to_shards(x, devices, home)
    ys = [on_device(device, lambda xk, k=k: _project(layer, shards, xk, k, devices), xs[k])
          for k, device in enumerate(devices)]
    logical = gather_from_shards(ys, home, axis=_out_axis(layer), devices=devices, lazy=gathers_lazily(layer))
    remember_shards(logical, devices, ys, axis=_out_axis(layer))
    return logical


def einsum_row(layer, x, shards: dict, devices, home):
    """An EinsumDense whose kernel is split along a contracted letter: partial products, then the sum."""
    kernels = shards["kernel"]
    x_spec, kernel_spec, _ = _einsum_parts(layer.equation)
    in_axis = x_spec.index(kernel_spec[layer_split_axis(layer)])
    xs = shards_of(x, devices, in_axis) or split_to_shards(logical_value(x), devices, home, axis=in_axis)
    parts = [on_device(device, lambda xk, k=k: keras.ops.einsum(layer.equation, xk, kernels[k]), xs[k])
             for k, device in enumerate(devices)]
    y = reduce_from_shards(parts, devices, home)
    with tf.device(home):
        if layer.bias is not None:
            y = keras.ops.add(y, layer.bias)
        return layer.activation(y) if layer.activation is not None else y
