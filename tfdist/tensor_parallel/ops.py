"""Megatron's conjugate operators within one replica, and the memory of which activation is split.

A replica owns a row of "model"-axis devices; its first device is the *home* device, where replicated layers
run and where the replica's data arrives. Megatron-LM (`core/tensor_parallel/mappings.py`) pairs two operators:

- `copy_to_shards` (Megatron's f): forward, the replicated activation is copied to every shard's device;
  backward, the shards' input gradients are summed — the all-reduce of the backward pass.
- `reduce_from_shards` (Megatron's g): forward, the shards' partial outputs are summed — the all-reduce of the
  forward pass; backward, the gradient is copied to every shard.

Every such sum is an AddN under the name scope `tp_all_reduce`, concatenations of column-parallel outputs are
`tp_all_gather`, splits of a replicated activation are `tp_scatter` (`tensor_parallel_count` counts them).
A column-parallel layer returns the logical (concatenated) activation and `remember_shards` its pieces; a
row-parallel layer fed by it reads them back with `shards_of`, so the concatenation feeds nothing and TF
prunes it from the step.

A row that spans processes (`tensor_parallel_span`: `RowDevices` with a `RowSpan`, this process holding positions
first..first+M-1 of T) runs the same operators SPMD, as Megatron does: each process computes its own shards, every
sum is a local AddN followed by a collective all-reduce among the row's processes, a gather a local concat followed
by a collective all-gather. Collectives cannot be pruned by TF (they are stateful ops that must run), so a
column-parallel output that only row-parallel layers read is not gathered at all (`lazy`): it stands for the
logical activation with a NaN-filled tensor of the right shape, which nothing reads.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable, Sequence

import keras
import tensorflow as tf

from tfdist._compat.captured_inputs import captured_inputs
from tfdist.tensor_parallel.span import (
    RowSpan,
    gather_across,
    lazy_gather,
    span_of,
    split_across,
)

__all__ = ["SCOPES", "copy_to_shards", "gather_from_shards", "on_device", "on_device_many", "reduce_from_shards",
           "remember_shards", "shards_of", "split_to_shards"]

SCOPES = ("tp_all_reduce", "tp_all_gather", "tp_scatter")


# id(logical activation) -> weak references to (logical, shards): outputs of column-parallel layers, newest
# last. Weak, so that eager activations are not kept alive (an eager row layer whose shards are gone splits
# its input instead); graph tensors live as long as their graph.
_activation_shards: collections.OrderedDict = collections.OrderedDict()
_REMEMBERED = 4096


def _positive(axis: int, rank: int) -> int:
    return axis % rank


def remember_shards(logical, devices: Sequence[str], shards: list, axis: int = -1) -> None:
    key = (tuple(devices), _positive(axis, logical.shape.rank))
    _activation_shards[id(logical)] = (weakref.ref(logical), key, [weakref.ref(s) for s in shards])
    while len(_activation_shards) > _REMEMBERED:
        _activation_shards.popitem(last=False)


def shards_of(x, devices: Sequence[str], axis: int = -1) -> list | None:
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
            return _sum_on(home, parts, span_of(devices), value)

        return outs, grad

    return f(x)


def _sum_on(home: str, parts: list, span: RowSpan | None, like=None) -> tf.Tensor:
    """The sum of `parts` on `home`: one AddN inside a process; across processes a local AddN, then the row's
    collective all-reduce (the exchange counted under `tp_all_reduce`)."""
    if span is None:
        with tf.device(home), tf.name_scope("tp_all_reduce"):
            return tf.add_n(parts) if parts else tf.zeros_like(like)
    with tf.device(home):
        with tf.name_scope("tp_local_sum"):
            local = tf.add_n(parts) if parts else tf.zeros_like(like)
        with tf.name_scope("tp_all_reduce"):
            return span.all_reduce(local)


def reduce_from_shards(parts: Sequence[tf.Tensor], devices: Sequence[str], home: str) -> tf.Tensor:
    """Megatron's g: the sum of the shards' partial outputs on `home` (forward); the gradient copied to every
    shard's device (backward)."""

    @tf.custom_gradient
    def g(*values):
        total = _sum_on(home, list(values), span_of(devices))

        def grad(dy):
            outs = []
            for device in devices:
                with tf.device(device):
                    outs.append(tf.identity(dy))
            return outs

        return total, grad

    return g(*parts)


def gather_from_shards(shards: Sequence[tf.Tensor], home: str, axis: int = -1, devices=None,
                       lazy: bool = False) -> tf.Tensor:
    """The logical activation: the shards concatenated on `home` (a gather; pruned when nothing reads it).

    Across processes (`devices` a RowDevices with a span): the local concat, then the row's all-gather, whose
    backward takes this process's slice of the (identical) gradient. With `lazy` (only shard readers follow) no
    collective is made: the result is a NaN-filled placeholder of the logical shape, and `logical_value` makes the
    gather if something asks for it after all."""
    span = span_of(devices)
    if span is None:
        with tf.device(home), tf.name_scope("tp_all_gather"):
            return tf.concat(list(shards), axis=axis)
    if not lazy:
        return gather_across(list(shards), home, axis, span)
    return lazy_gather(list(shards), home, axis, span)


def split_to_shards(x: tf.Tensor, devices: Sequence[str], home: str, axis: int = -1) -> list[tf.Tensor]:
    """A replicated activation split along `axis`, piece k copied to devices[k] (gradient: a concat on home).

    Across processes each process keeps its own pieces of its (identical) copy, with no exchange forward; the
    gradient of x gathers every process's pieces (an all-gather among the row's processes)."""
    span = span_of(devices)
    if span is not None:
        return split_across(x, devices, home, axis, span)
    with tf.device(home), tf.name_scope("tp_scatter"):
        pieces = tf.split(x, len(devices), axis=axis)
    out = []
    for device, piece in zip(devices, pieces):
        with tf.device(device):
            out.append(tf.identity(piece))
    return out


def _dense_gradient(g):
    return tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g


def _fill_gradients(grads: list, sources: list, n: int, num_values: int) -> tuple[list, list]:
    """(input gradients, variable gradients) of an `on_device` block: zeros where the inputs and variables are
    unconnected, None for the captured tensors `fn` did not read (no zero-filled weight-sized tensors)."""
    out = []
    for k, (g, source) in enumerate(zip(grads, sources)):
        captured = n <= k < num_values
        # A variable's sparse gradient (a lookup's) stays sparse, as Keras gives it; so does a captured ZeRO-3
        # weight's, which the unit's backward hands the optimizer as slices of its piece.
        variable = k >= num_values
        out.append(None if g is None and captured else tf.zeros_like(source) if g is None
                   else g if variable or captured else _dense_gradient(g))
    return out[:num_values], out[num_values:]


def on_device(device: str, fn: Callable, *tensors: tf.Tensor) -> tf.Tensor:
    """`fn(*tensors)` with its forward *and* backward ops on `device` (float `tensors` only; capture others).

    Without this TF builds every backward op where the tape's gradient is requested (the home device); the
    backward of each shard here runs from an inner tape under the shard's device."""

    n = len(tensors)
    captured = captured_inputs()  # ZeRO-3's gathered weights, read by `fn` through their Keras variables

    @tf.custom_gradient
    def run(*values):
        with tf.device(device), tf.GradientTape() as tape:
            tape.watch(values)
            out = fn(*values[:n])

        def grad(dy, variables=None):
            variables = list(variables or [])
            with tf.device(device):
                grads = tape.gradient(out, list(values) + variables, output_gradients=tf.identity(dy),
                                      unconnected_gradients=tf.UnconnectedGradients.NONE)
            return _fill_gradients(grads, list(values) + variables, n, len(values))

        return out, grad

    with tf.device(device):
        return run(*tensors, *captured)


def on_device_many(device: str, fn: Callable, *tensors: tf.Tensor) -> list[tf.Tensor]:
    """`on_device` for an `fn` returning several tensors (e.g. the query, key and value projections of one
    input): one backward, whose inner tape sums each input's gradients from every output on `device`."""

    n = len(tensors)
    captured = captured_inputs()

    @tf.custom_gradient
    def run(*values):
        with tf.device(device), tf.GradientTape() as tape:
            tape.watch(values)
            outs = list(fn(*values[:n]))

        def grad(*dys, variables=None):
            variables = list(variables or [])
            with tf.device(device):
                # an output nothing reads (a projection computed for an input it was not called on) has no gradient
                dys = [tf.zeros_like(o) if d is None else tf.identity(d) for o, d in zip(outs, dys)]
                grads = tape.gradient(outs, list(values) + variables, output_gradients=dys,
                                      unconnected_gradients=tf.UnconnectedGradients.NONE)
            return _fill_gradients(grads, list(values) + variables, n, len(values))

        return outs, grad

    with tf.device(device):
        return list(run(*tensors, *captured))
