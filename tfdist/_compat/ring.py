"""MultiWorkerMirroredStrategy's ring all-reduce, made to keep a slow link busy (docs/comm.md, design.md).

Two settings of TF's own collective ops, applied by the launcher (the object MWMS creates its collectives with):

- subdivisions (always): stock MWMS creates its all-reduces with `max_subdivs_per_device=-1`, so each member's
  share travels as one RPC, serialised, sent, parsed and added whole while the link idles; allowed to subdivide,
  TF cuts it into chunks of at most 4 MB and pipelines them (the fewest subdivisions up to RING_MAX_SUBDIVS).
- pieces (`ring_piece_mb`, off by default): one ring op still ends by parsing and copying all of its chunks at
  once (they share the connection evenly, so they arrive together), with the link idle meanwhile. In a
  tf.function a large all-reduce can instead run as a chain of all-reduces of about `piece_bytes` each, whose
  end work is one piece's. Each op costs CPU besides, so pieces pay on slow links and cost on CPU-bound fast
  ones: measured both ways in docs/comm.md.

In pieces, a pack of tensors (TF packs a step's gradients, and the uneven-data flags that ride along, into one
all-reduce) is cut at the piece boundaries as it stands instead of being concatenated first: the concat is a
copy of the whole pack into a fresh buffer that no piece could start before, and a piece inside one tensor is a
view of it. The results are cut back into the pack's tensors the same way.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import tensorflow as tf
from tensorflow.python.distribute import collective_util as _collective_util
from tensorflow.python.distribute import cross_device_utils as _cross_device_utils
from tensorflow.python.ops import collective_ops as _collective_ops

__all__ = ["RING_MAX_PIECES", "RING_MAX_SUBDIVS", "piece_sizes", "recut", "ring_pieces", "subdivide_ring"]

RING_MAX_SUBDIVS = 16
RING_MAX_PIECES = 64
_ALIGN_BYTES = 64  # Eigen's alignment: pieces that start on it are views of the input, not copies


def piece_sizes(num_elements: int, itemsize: int, piece_bytes: int | None) -> list[int]:
    """How many elements each all-reduce of a flat tensor takes: the whole tensor when `piece_bytes` is None or
    the tensor is under two pieces, else up to RING_MAX_PIECES nearly equal pieces of >= `piece_bytes` whose
    starts are aligned (the last piece takes the remainder)."""
    pieces = 1 if piece_bytes is None else min(RING_MAX_PIECES, num_elements * itemsize // piece_bytes)
    if pieces < 2:
        return [num_elements]
    align = max(1, _ALIGN_BYTES // itemsize)
    size = num_elements // pieces // align * align
    return [size] * (pieces - 1) + [num_elements - size * (pieces - 1)]


def recut(parts: list[tf.Tensor], part_sizes: list[int], sizes: list[int]) -> list[tf.Tensor]:
    """The concatenation of the 1-D `parts` (`part_sizes` elements each) cut into 1-D tensors of `sizes` elements,
    without building the concatenation: a cut inside one part is a slice of it (a view of its buffer where it
    starts on Eigen's alignment), one across parts the concat of their slices."""
    if sum(part_sizes) != sum(sizes):
        raise ValueError(f"recut: parts of {sum(part_sizes)} elements cannot be cut into {sum(sizes)}")
    starts = list(itertools.accumulate(part_sizes, initial=0))  # where each part begins in the concatenation
    out, begin = [], 0
    for size in sizes:
        end = begin + size
        bits = [part if begin <= lo and hi <= end else
                part[max(begin, lo) - lo:min(end, hi) - lo]
                for part, lo, hi in zip(parts, starts, starts[1:]) if max(begin, lo) < min(end, hi)]
        out.append(parts[0][:0] if not bits else bits[0] if len(bits) == 1 else tf.concat(bits, 0))
        begin = end
    return out


class _RingLauncher(_cross_device_utils.CollectiveReplicaLauncher):
    """MWMS's per-device collective launcher whose ring all-reduces subdivide, and run in pieces when asked."""

    _tfdist_piece_bytes: int | None = None

    def all_reduce(self, input_tensor, control_input=None, options=None):
        options = self._options.merge(options)
        if options.implementation == _collective_util.CommunicationImplementation.NCCL:
            return super().all_reduce(input_tensor, control_input, options)
        with tf.device(self._device), self._control_input(control_input):
            input_tensor = tf.convert_to_tensor(input_tensor)
            count = input_tensor.shape.num_elements()
            sizes = ([count] if tf.executing_eagerly() or count is None  # eagerly, each op would wait for the host
                     else piece_sizes(count, input_tensor.dtype.size, self._tfdist_piece_bytes))
            if len(sizes) == 1:
                return self._ring(input_tensor, options)
            reduced = self._chain(recut([tf.reshape(input_tensor, [-1])], [count], sizes), options)
            return tf.reshape(tf.concat(reduced, 0), tf.shape(input_tensor))

    def batch_all_reduce(self, input_tensor_packs, options=None):
        options = self._options.merge(options)
        if (self._tfdist_piece_bytes is None or tf.executing_eagerly()
                or options.implementation == _collective_util.CommunicationImplementation.NCCL):
            return super().batch_all_reduce(input_tensor_packs, options)
        outputs = []
        for pack in input_tensor_packs:
            counts = [t.shape.num_elements() for t in pack]
            if None in counts or len({t.dtype for t in pack}) != 1:
                outputs += super().batch_all_reduce([pack], options)  # TF's own concat (or its error)
                continue
            with tf.device(self._device):
                flats = [tf.reshape(t, [-1]) for t in pack]
                sizes = piece_sizes(sum(counts), pack[0].dtype.size, self._tfdist_piece_bytes)
                reduced = self._chain(recut(flats, counts, sizes), options)
                outputs += [tf.reshape(r, tf.shape(t)) for r, t in zip(recut(reduced, sizes, counts), pack)]
        return outputs

    def _chain(self, pieces, options):
        reduced = []
        for piece in pieces:
            # One after another, as every device creates them: concurrent collectives on the local devices of
            # one process can deadlock (a device waits in one piece for a peer busy in another).
            with tf.control_dependencies(reduced[-1:]):
                reduced.append(self._ring(piece, options))
        return reduced

    def _ring(self, tensor, options):
        return _collective_ops.all_reduce_v2(
            tensor, self._group_size, self._group_key, self._next_instance_key(),
            communication_hint=options.implementation.value, timeout=options.timeout_seconds,
            ordering_token=self._get_ordering_token(), max_subdivs_per_device=RING_MAX_SUBDIVS)


def subdivide_ring(extended, piece_bytes: int | None = None) -> None:
    """Makes MWMS's launchers subdivide their ring all-reduces, and cut those of >= 2 x `piece_bytes` in pieces
    (None: whole); they keep their keys and ordering tokens."""
    for ops in (extended._cross_device_ops, getattr(extended, "_host_cross_device_ops", None)):
        for launcher in getattr(ops, "_launchers", ()):
            if type(launcher) in (_cross_device_utils.CollectiveReplicaLauncher, _RingLauncher):
                launcher.__class__ = _RingLauncher
                launcher._tfdist_piece_bytes = piece_bytes


@contextlib.contextmanager
def ring_pieces(extended, piece_bytes: int | None) -> Iterator[None]:
    """Within: the all-reduces MWMS creates (when a tf.function traces) use `piece_bytes`; after, the strategy's own
    setting again. For timing both settings in one process (`tfdist bench allreduce`)."""
    subdivide_ring(extended, piece_bytes)
    try:
        yield
    finally:
        subdivide_ring(extended, getattr(extended, "_tfdist_ring_piece_bytes", None))
