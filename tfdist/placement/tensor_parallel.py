"""Feature splitting inside one replica: Megatron's conjugate operators and the split forward of Dense/Embedding.

A replica owns a row of "model"-axis devices; its first device is the *home* device, where replicated layers
run and where the replica's data arrives. Megatron-LM (`core/tensor_parallel/mappings.py`) pairs two operators:

- `copy_to_shards` (Megatron's f): forward, the replicated activation is copied to every shard's device;
  backward, the shards' input gradients are summed — the all-reduce of the backward pass.
- `reduce_from_shards` (Megatron's g): forward, the shards' partial outputs are summed — the all-reduce of the
  forward pass; backward, the gradient is copied to every shard.

Within one process an all-reduce whose result the next (replicated) layer needs in one place is a reduce to
the home device followed by the next f's copies: the same bytes as a ring all-reduce (2(T-1)/T of the tensor
per device, 2(T-1) tensors in all), with the replicated layers computed once instead of T times. Every such
sum is an AddN under a name scope `tp_all_reduce`, concatenations of column-parallel outputs (needed only
when a non-split layer reads them) are `tp_all_gather`, splits of a replicated activation for a row-parallel
layer not fed by a column-parallel one are `tp_scatter`: `collective_counts` counts them in a traced graph.

A column-parallel layer returns the logical (concatenated) activation and remembers its shards; a row-parallel
layer fed by it reads the shards, so the concatenation feeds nothing and TF prunes it from the step: a
column/row pair costs one all-reduce forward and one backward, as in Megatron.
"""

from __future__ import annotations

import collections
import functools
import weakref
from collections.abc import Callable, Sequence

import keras
import tensorflow as tf

__all__ = ["SCOPES", "collective_counts", "copy_to_shards", "on_device", "reduce_from_shards", "split_layer_call"]

SCOPES = ("tp_all_reduce", "tp_all_gather", "tp_scatter")
_KINDS = ("column", "row", "vocab", "embedding_features", "einsum_column", "einsum_row", "conv_column", "conv_row")

# id(logical activation) -> weak references to (logical, shards): outputs of column-parallel layers, newest
# last. Weak, so that eager activations are not kept alive (an eager row layer whose shards are gone splits
# its input instead); graph tensors live as long as their graph.
_activation_shards: collections.OrderedDict = collections.OrderedDict()
_REMEMBERED = 4096


def _positive(axis: int, rank: int) -> int:
    return axis % rank


def _remember(logical, devices: Sequence[str], shards: list, axis: int = -1) -> None:
    key = (tuple(devices), _positive(axis, logical.shape.rank))
    _activation_shards[id(logical)] = (weakref.ref(logical), key, [weakref.ref(s) for s in shards])
    while len(_activation_shards) > _REMEMBERED:
        _activation_shards.popitem(last=False)


def _shards_of(x, devices: Sequence[str], axis: int = -1) -> list | None:
    """The shards of `x` split along `axis` over `devices` if a split layer produced it, else None."""
    if not tf.is_tensor(x) or isinstance(x, keras.KerasTensor) or x.shape.rank is None:
        return None
    entry = _activation_shards.get(id(x))
    if entry is None or entry[0]() is not x or entry[1] != (tuple(devices), _positive(axis, x.shape.rank)):
        return None
    shards = [ref() for ref in entry[2]]
    return None if any(s is None for s in shards) else shards


def copy_to_shards(x: tf.Tensor, devices: Sequence[str], home: str) -> list[tf.Tensor]:
    """Megatron's f: x on every device (forward); the sum of the shards' gradients on `home` (backward)."""

    @tf.custom_gradient
    def f(value):
        outs = []
        for device in devices:
            with tf.device(device):
                outs.append(tf.identity(value))

        def grad(*dys):
            parts = [dy for dy in dys if dy is not None]
            with tf.device(home), tf.name_scope("tp_all_reduce"):
                return tf.add_n(parts) if parts else tf.zeros_like(value)

        return outs, grad

    return f(x)


def reduce_from_shards(parts: Sequence[tf.Tensor], devices: Sequence[str], home: str) -> tf.Tensor:
    """Megatron's g: the sum of the shards' partial outputs on `home` (forward); the gradient copied to every
    shard's device (backward)."""

    @tf.custom_gradient
    def g(*values):
        with tf.device(home), tf.name_scope("tp_all_reduce"):
            total = tf.add_n(list(values))

        def grad(dy):
            outs = []
            for device in devices:
                with tf.device(device):
                    outs.append(tf.identity(dy))
            return outs

        return total, grad

    return g(*parts)


def gather_from_shards(shards: Sequence[tf.Tensor], home: str, axis: int = -1) -> tf.Tensor:
    """The logical activation: the shards concatenated on `home` (a gather; pruned when nothing reads it)."""
    with tf.device(home), tf.name_scope("tp_all_gather"):
        return tf.concat(list(shards), axis=axis)


def split_to_shards(x: tf.Tensor, devices: Sequence[str], home: str, axis: int = -1) -> list[tf.Tensor]:
    """A replicated activation split along `axis`, piece k copied to devices[k] (gradient: a concat on home)."""
    with tf.device(home), tf.name_scope("tp_scatter"):
        pieces = tf.split(x, len(devices), axis=axis)
    out = []
    for device, piece in zip(devices, pieces):
        with tf.device(device):
            out.append(tf.identity(piece))
    return out


def _dense_gradient(g):
    return tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g


def on_device(device: str, fn: Callable, *tensors: tf.Tensor) -> tf.Tensor:
    """`fn(*tensors)` with its forward *and* backward ops on `device` (float `tensors` only; capture others).

    Without this TF builds every backward op where the tape's gradient is requested (the home device); the
    backward of each shard here runs from an inner tape under the shard's device."""

    @tf.custom_gradient
    def run(*values):
        with tf.device(device), tf.GradientTape() as tape:
            tape.watch(values)
            out = fn(*values)

        def grad(dy, variables=None):
            variables = list(variables or [])
            with tf.device(device):
                grads = tape.gradient(out, list(values) + variables, output_gradients=tf.identity(dy),
                                      unconnected_gradients=tf.UnconnectedGradients.ZERO)
            grads = [_dense_gradient(g) for g in grads]
            return grads[:len(values)], grads[len(values):]

        return out, grad

    with tf.device(device):
        return run(*tensors)


# --- the split forward of each supported layer ---------------------------------------------------------
def _bias_part(bias_shards, bias, k: int, parts: int):
    if bias_shards is not None:
        return bias_shards[k]
    if bias is None:
        return None
    size = bias.shape[0] // parts
    return tf.convert_to_tensor(bias)[k * size:(k + 1) * size]


def _column(layer, x, shards: dict, devices, home, op, bias):
    """Output features split (Dense/Conv): each device computes its slice of the output from a copy of the input
    (Megatron's f), the slices are concatenated and remembered so that a following row layer reads them."""
    kernels, bias_shards = shards["kernel"], shards.get("bias")
    xs = copy_to_shards(x, devices, home)
    ys = []
    for k, device in enumerate(devices):
        def shard(xk, k=k):
            y = op(xk, kernels[k])
            part = _bias_part(bias_shards, bias, k, len(devices))
            if part is not None:
                y = keras.ops.add(y, part)
            return layer.activation(y) if layer.activation is not None else y

        ys.append(on_device(device, shard, xs[k]))
    logical = gather_from_shards(ys, home)
    _remember(logical, devices, ys)
    return logical


def _row(layer, x, shards: dict, devices, home, op, bias):
    """Input features split (Dense/Conv): partial products on each device, then their sum (Megatron's g)."""
    kernels = shards["kernel"]
    xs = _shards_of(x, devices) or split_to_shards(x, devices, home)
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


def _einsum_parts(equation: str) -> tuple[str, str, str]:
    inputs, output = equation.split("->")
    x_spec, kernel_spec = inputs.split(",")
    return x_spec, kernel_spec, output


def _einsum_bias_part(layer, bias_shards, k: int, parts: int, out_axis: int, out_rank: int):
    if bias_shards is not None:
        return bias_shards[k]
    if layer.bias is None:
        return None
    bias = tf.convert_to_tensor(layer.bias)
    dim = out_axis - (out_rank - bias.shape.rank)  # the bias is right-aligned to the output
    if dim < 0 or bias.shape[dim] == 1:
        return bias
    size = bias.shape[dim] // parts
    return tf.gather(bias, tf.range(k * size, (k + 1) * size), axis=dim)


def _einsum_column(layer, x, shards: dict, devices, home):
    """An EinsumDense whose kernel is split along an output letter (e.g. the heads of an attention projection)."""
    kernels, bias_shards = shards["kernel"], shards.get("bias")
    _, kernel_spec, out_spec = _einsum_parts(layer.equation)
    letter = kernel_spec[layer_split_axis(layer)]
    out_axis = out_spec.index(letter)
    xs = copy_to_shards(x, devices, home)
    ys = []
    for k, device in enumerate(devices):
        def shard(xk, k=k):
            y = keras.ops.einsum(layer.equation, xk, kernels[k])
            bias = _einsum_bias_part(layer, bias_shards, k, len(devices), out_axis, len(out_spec))
            if bias is not None:
                y = keras.ops.add(y, bias)
            return layer.activation(y) if layer.activation is not None else y

        ys.append(on_device(device, shard, xs[k]))
    logical = gather_from_shards(ys, home, axis=out_axis)
    _remember(logical, devices, ys, axis=out_axis)
    return logical


def _einsum_row(layer, x, shards: dict, devices, home):
    """An EinsumDense whose kernel is split along a contracted letter: partial products, then the sum."""
    kernels = shards["kernel"]
    x_spec, kernel_spec, _ = _einsum_parts(layer.equation)
    in_axis = x_spec.index(kernel_spec[layer_split_axis(layer)])
    xs = _shards_of(x, devices, in_axis) or split_to_shards(x, devices, home, axis=in_axis)
    parts = [on_device(device, lambda xk, k=k: keras.ops.einsum(layer.equation, xk, kernels[k]), xs[k])
             for k, device in enumerate(devices)]
    y = reduce_from_shards(parts, devices, home)
    with tf.device(home):
        if layer.bias is not None:
            y = keras.ops.add(y, layer.bias)
        return layer.activation(y) if layer.activation is not None else y


_split_axes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # EinsumDense -> its split kernel dimension


def layer_split_axis(layer) -> int:
    return _split_axes[layer]


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
            local = ids - tf.cast(k * rows, ids.dtype)
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
    logical = tf.cast(gather_from_shards(ys, home), layer.compute_dtype)
    _remember(logical, devices, ys)
    return logical


_SPLIT_CALLS = {"column": _dense_column, "row": _dense_row, "vocab": _embedding_vocab,
                "embedding_features": _embedding_features, "einsum_column": _einsum_column, "einsum_row": _einsum_row,
                "conv_column": _conv_column, "conv_row": _conv_row}


def split_layer_call(layer: keras.layers.Layer, kind: str, shards: dict[str, list],
                     devices_for_replica: Callable[[], Sequence[str]], kernel_axis: int | None = None) -> None:
    """Makes `layer` compute its split forward (`kind`: one of _KINDS) from the
    shard variables `shards[role][k]` on devices_for_replica()[k] (the calling replica's model-axis row; its
    first device is home). Symbolic calls (KerasTensors, model construction) run the layer's own call."""
    if kind not in _SPLIT_CALLS:
        raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
    original = layer.call
    split = _SPLIT_CALLS[kind]
    if kernel_axis is not None:
        _split_axes[layer] = kernel_axis

    @functools.wraps(original)
    def call(inputs, *args, **kwargs):
        if isinstance(inputs, keras.KerasTensor):
            return original(inputs, *args, **kwargs)
        devices = list(devices_for_replica())
        return split(layer, tf.convert_to_tensor(inputs), shards, devices, devices[0])

    layer.call = call


def pass_shards_through(layer, devices_for_replica: Callable[[], Sequence[str]]) -> None:
    """Makes a per-feature layer (pooling, an activation) keep a split activation split: fed the output of a
    column-parallel layer, it runs on each shard on the shard's device, so the next row-parallel layer still
    needs no exchange. Fed anything else, it runs as usual."""
    original = layer.call

    @functools.wraps(original)
    def call(inputs, *args, **kwargs):
        if isinstance(inputs, keras.KerasTensor):
            return original(inputs, *args, **kwargs)
        devices = list(devices_for_replica())
        shards = _shards_of(inputs, devices)
        if shards is None:
            return original(inputs, *args, **kwargs)
        outs = [on_device(device, lambda t: original(t, *args, **kwargs), shard)
                for device, shard in zip(devices, shards)]
        logical = gather_from_shards(outs, devices[0])
        _remember(logical, devices, outs)
        return logical

    layer.call = call


def split_attention(layer, devices_for_replica: Callable[[], Sequence[str]]) -> None:
    """Makes a MultiHeadAttention whose query/key/value projections are split over the heads compute each
    device's heads there: the attention of head slice k runs on device k from the projections' shards, and its
    output stays split for the (row-parallel) output projection. Attention scores asked for, or projections
    not split alike, fall back to the layer's own (replicated) attention."""
    from tfdist._compat.tensor_parallel import wrap_compute_attention

    def make(original):
        def compute(query, key, value, attention_mask=None, training=None, return_attention_scores=False,
                    **kwargs):
            devices = list(devices_for_replica())
            shards = [_shards_of(t, devices, axis=2) for t in (query, key, value)]
            if return_attention_scores or any(s is None for s in shards):
                return original(query, key, value, attention_mask, training, return_attention_scores, **kwargs)
            outs = []
            for k, device in enumerate(devices):
                def heads(q, kk, v):
                    return original(q, kk, v, attention_mask, training, False, **kwargs)[0]

                outs.append(on_device(device, heads, shards[0][k], shards[1][k], shards[2][k]))
            logical = gather_from_shards(outs, devices[0], axis=2)
            _remember(logical, devices, outs, axis=2)
            return logical, None

        return compute

    wrap_compute_attention(layer, make)


def collective_counts(graph: tf.Graph) -> dict[str, int]:
    """How many tensor-parallel exchanges a traced step runs: AddN ops under `tp_all_reduce`, ConcatV2 under
    `tp_all_gather`, Split under `tp_scatter`, in the graph and every function in its library (Keras' step
    loop is one). Ops whose result nothing reads (a column-parallel output read only as shards) are left out:
    TF prunes them before running the step."""
    kinds = {"tp_all_reduce": ("AddN",), "tp_all_gather": ("ConcatV2",), "tp_scatter": ("Split", "SplitV")}
    counts = dict.fromkeys(kinds, 0)

    def count(op_type: str, name: str, used: bool) -> None:
        for scope, types in kinds.items():
            if used and op_type in types and f"{scope}/" in name:
                counts[scope] += 1

    for op in graph.get_operations():
        count(op.type, op.name, any(out.consumers() for out in op.outputs))
    for fn in graph.as_graph_def().library.function:
        read = {name.lstrip("^").split(":")[0] for node in fn.node_def for name in node.input}
        read |= {value.split(":")[0] for value in fn.ret.values()}
        for node in fn.node_def:
            count(node.op, node.name, node.name in read)
    return counts
