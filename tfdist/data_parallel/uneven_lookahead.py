"""A tf.data transform that tells each element what follows it: the look-ahead of uneven-data agreement.

Ranks agree on "who still has data" for step k+1 inside step k's gradient all-reduce (tfdist.data_parallel.uneven).
For that, each rank must know during step k whether it has the batches of step k+1, before it asks for
them. `with_lookahead(dataset, m)` gives that knowledge inside the input pipeline, without running it twice:
element j comes with `[count, rows]` of the elements j+1 .. j+m (how many exist, and their total rows).

With m local replicas, elements go round-robin to the replicas (j -> replica j mod m), so the element of the
last replica of step k carries exactly step k+1's `[replicas with data, rows]` for this rank.

Example:
    >>> ds = tf.data.Dataset.range(7).batch(3)              # batches of 3, 3, 1 rows
    >>> [meta.tolist() for _, meta in with_lookahead(ds, 1).as_numpy_iterator()]
    [[1, 3], [1, 1], [0, 0]]
"""

from __future__ import annotations

import tensorflow as tf

__all__ = ["rows_of", "with_lookahead"]


def rows_of(element) -> tf.Tensor:
    """Rows (batch size) of an element: the first dimension of its first component (1 for a scalar), int64."""
    first = tf.nest.flatten(element)[0]
    if first.shape.rank == 0:
        return tf.constant(1, tf.int64)
    return tf.shape(first, out_type=tf.int64)[0]


def _empty(spec: tf.TensorSpec) -> tf.Tensor:
    # A stand-in with 0 rows; unknown inner dimensions are 0 too.
    dims = [0 if d is None else d for d in spec.shape.as_list()]
    return tf.zeros([0] + dims[1:] if dims else [], spec.dtype)


def with_lookahead(dataset: tf.data.Dataset, m: int) -> tf.data.Dataset | None:
    """`dataset` with every element paired with int64 `[count, rows]` of the next `m` elements.

    The pipeline runs once: a scan keeps the last m elements and lets element j out when element j+m (or the
    end) arrives. Order, cardinality and element shapes are those of `dataset`. Returns None when an element
    holds something other than dense tensors (sparse, ragged: no empty stand-in to pad the end with).
    """
    if m < 1:
        raise ValueError(f"with_lookahead: m must be >= 1 local replicas, got {m}.")
    spec = dataset.element_spec
    if not all(isinstance(s, tf.TensorSpec) for s in tf.nest.flatten(spec)):
        return None
    empty = tf.nest.map_structure(_empty, spec)
    # m stand-ins after the real elements push the last m real ones out of the scan's buffer.
    marked = dataset.map(lambda *e: (e if isinstance(spec, tuple) else e[0], tf.constant(1, tf.int64)))
    ends = tf.data.Dataset.from_tensors((empty, tf.constant(0, tf.int64))).repeat(m)
    start = (tuple(empty for _ in range(m)), tf.zeros([m], tf.int64), tf.zeros([m], tf.int64))

    def step(state, item):
        buffer, real, rows = state
        element, is_real = item
        new_rows = is_real * rows_of(element)
        # out: buffer[0] (element j), with the count and rows of buffer[1:] + the new one (j+1 .. j+m)
        meta = tf.stack([tf.reduce_sum(real[1:]) + is_real, tf.reduce_sum(rows[1:]) + new_rows])
        state = (buffer[1:] + (element,), tf.concat([real[1:], [is_real]], 0), tf.concat([rows[1:], [new_rows]], 0))
        return state, (buffer[0], meta)

    # The first m outputs are the initial empty buffer; the next n are the real elements, in order.
    out = marked.concatenate(ends).scan(start, step).skip(m)
    # The scan relaxes shapes (the stand-ins have 0 rows); the elements out are real ones: restore `spec`.
    out = out.map(lambda element, meta: (tf.nest.map_structure(tf.ensure_shape, element, _shapes(spec)), meta))
    # The scan's work runs ahead of the step, as the pipeline before it did (a pipeline ends in a prefetch).
    return out.prefetch(1)


def _shapes(spec):
    return tf.nest.map_structure(lambda s: s.shape, spec)
