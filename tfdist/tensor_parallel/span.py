"""A mesh row that spans processes (the model axis across processes), for Megatron's operators in
`tensor_parallel_ops`: which model positions this process holds (`RowSpan`, carried by `RowDevices`), the row's
collectives (all-reduce, all-gather among the row's processes), and the gathers left out because only shard
readers follow (`gather_lazily`: TF cannot prune a collective, it is a stateful op that must run).

Example (what ModelParallelStrategy gives its split layers on process 1 of 2, two devices each):
    >>> row = RowDevices(["/job:worker/replica:0/task:1/device:CPU:0", "/job:worker/replica:0/task:1/device:CPU:1"],
    ...                  RowSpan(first=2, size=4, processes=2, all_reduce=tf.identity, all_gather=tf.identity))
    >>> position(row, 0), row_size(row)
    (2, 4)
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from collections.abc import Callable, Sequence

import tensorflow as tf

__all__ = ["RowDevices", "RowSpan", "gather_across", "gather_lazily", "gather_value", "gathers_lazily", "lazy_gather",
           "logical_value", "position", "row_of", "row_size", "span_of", "split_across"]

_REMEMBERED = 4096


@dataclasses.dataclass(frozen=True)
class RowSpan:
    """This process's part of a mesh row that spans processes: model positions first..first+M-1 of `size`.

    `all_reduce(t)` sums `t` over the row's processes, `all_gather(t)` concatenates it along axis 0 in position
    order (collectives on this process's first device of the row; every process of the row calls them in the
    same order, SPMD)."""

    first: int
    size: int
    processes: int
    all_reduce: Callable[[tf.Tensor], tf.Tensor]
    all_gather: Callable[[tf.Tensor], tf.Tensor]


class RowDevices(list):
    """This process's devices of a mesh row (a list of device names), with the row's `span` when the row spans
    processes (None: the whole row is here)."""

    def __init__(self, devices: Sequence[str], span: RowSpan | None = None):
        super().__init__(devices)
        self.span = span


def span_of(devices) -> RowSpan | None:
    """The RowSpan of a row that spans processes, None for a row inside this process."""
    return getattr(devices, "span", None)


def position(devices, k: int) -> int:
    """The model-axis position of this process's k-th device of the row."""
    span = span_of(devices)
    return k + (span.first if span is not None else 0)


def row_size(devices) -> int:
    """T: devices in the whole row (across processes)."""
    span = span_of(devices)
    return span.size if span is not None else len(devices)


def gather_value(local: tf.Tensor, axis: int, span: RowSpan | None) -> tf.Tensor:
    """The row's pieces concatenated along `axis` (this process's `local` piece with the others'): a collective
    every process of the row calls (a logical variable read, a save); `local` itself for a row inside a process."""
    if span is None:
        return local
    axis = axis % local.shape.rank
    perm = [axis] + [i for i in range(local.shape.rank) if i != axis]
    gathered = span.all_gather(tf.transpose(local, perm) if axis else local)
    return tf.transpose(gathered, _inverse(perm)) if axis else gathered


def _inverse(perm: list[int]) -> list[int]:
    out = [0] * len(perm)
    for i, p in enumerate(perm):
        out[p] = i
    return out


# id(placeholder of a lazy gather) -> (weak placeholder, function making the real gather); see lazy_gather
_lazy: collections.OrderedDict = collections.OrderedDict()


_lazy_layers: weakref.WeakSet = weakref.WeakSet()  # layers whose split output only shard readers read


def gather_lazily(layer, lazy: bool = True) -> None:
    """Across processes: `layer`'s split output is read only as shards (a row-parallel layer follows), so its
    logical activation is not all-gathered (see `gather_from_shards(lazy=True)`)."""
    if lazy:
        _lazy_layers.add(layer)
    else:
        _lazy_layers.discard(layer)


def gathers_lazily(layer) -> bool:
    return layer in _lazy_layers


def row_of(devices) -> list:
    """`devices` as a list, keeping the RowSpan of a row across processes."""
    return devices if isinstance(devices, list) else list(devices)


def logical_value(x):
    """The real logical activation of `x`: `x` itself, or, for the placeholder of a gather left out because only
    shard readers were expected (`gather_from_shards(lazy=True)`), the gather made now."""
    entry = _lazy.get(id(x)) if tf.is_tensor(x) else None
    if entry is None or entry[0]() is not x:
        return x
    return entry[1]()


def lazy_gather(shards: list, home: str, axis: int, span: RowSpan) -> tf.Tensor:
    """A NaN-filled placeholder of the logical shape standing for the row's gather of `shards`, which is made only
    if `logical_value` asks for it (nothing reads the placeholder itself: only shard readers follow)."""
    with tf.device(home):
        axis = axis % shards[0].shape.rank
        shape = tf.shape(shards[0])
        shape = tf.tensor_scatter_nd_update(shape, [[axis]], [shape[axis] * span.size])  # even shards
        placeholder = tf.fill(shape, tf.constant(float("nan"), shards[0].dtype))
    made: list = []

    def make():
        if not made:
            made.append(gather_across(list(shards), home, axis, span))
        return made[0]

    _lazy[id(placeholder)] = (weakref.ref(placeholder), make)
    while len(_lazy) > _REMEMBERED:
        _lazy.popitem(last=False)
    return placeholder


def gather_across(shards: list, home: str, axis: int, span: RowSpan) -> tf.Tensor:
    """The logical activation across processes: the local concat, then the row's all-gather; backward, this
    process's slice of the (identical) gradient, with no exchange."""
    sizes = [s.shape[axis] for s in shards]

    @tf.custom_gradient
    def gather(*values):
        with tf.device(home):
            local = tf.concat(list(values), axis=axis)
            with tf.name_scope("tp_all_gather"):
                total = gather_value(local, axis, span)

        def grad(dy):
            with tf.device(home):  # every process holds the same gradient of the (replicated) logical activation
                mine = tf.split(dy, span.processes, axis=axis)[span.first // len(sizes)]
                return tf.split(mine, sizes, axis=axis)

        return total, grad

    return gather(*shards)


def split_across(x, devices, home, axis, span: RowSpan) -> list[tf.Tensor]:
    """This process's pieces of a replicated activation (no exchange forward); backward, the row's all-gather."""

    @tf.custom_gradient
    def split(value):
        with tf.device(home), tf.name_scope("tp_scatter"):
            pieces = tf.split(value, span.size, axis=axis)[span.first:span.first + len(devices)]
        outs = []
        for device, piece in zip(devices, pieces):
            with tf.device(device):
                outs.append(tf.identity(piece))

        def grad(*dys):
            with tf.device(home):
                local = tf.concat([tf.zeros_like(p) if d is None else d for p, d in zip(pieces, dys)], axis=axis)
                with tf.name_scope("tp_all_gather"):
                    return gather_value(local, axis, span)

        return outs, grad

    return split(x)
