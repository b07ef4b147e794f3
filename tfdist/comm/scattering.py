"""scatter: the root's pieces (shapes may differ), one to each rank, in three steps:

1. every rank's dtype and number of dimensions (the root's pieces, the others' `like`), all-gathered:
   a disagreement is an error on every rank alike;
2. the pieces' shapes and padded length (`padding.pack_pieces`), broadcast from the root;
3. the padded pieces, one row per rank, through one all-to-all (the non-roots send zeros);
   each rank cuts its piece from the root's row.

Example (2 processes): see `tfdist.comm.scatter`.
"""

from __future__ import annotations

import tensorflow as tf

from tfdist.comm.arguments import as_tensor, check_divisible, parse_like
from tfdist.comm.padding import pack_pieces, unpack_piece
from tfdist.comm.process_group import Backend, Group
from tfdist.comm.state import guard
from tfdist.comm.wire import carry
from tfdist.errors import ConfigError

__all__ = ["scatter_pieces"]


def scatter_pieces(backend: Backend, xs: object, root: int, like: object, group: Group) -> tf.Tensor:
    """This rank's piece of the root's `xs` (root: `xs`; others: `like`); see `tfdist.comm.scatter`."""
    if group.rank == root:
        pieces = _pieces(xs, group)
        dtype, ndims, expected = pieces[0].dtype, pieces[0].shape.rank, None
        if group.size == 1:
            return tf.identity(pieces[0])
    else:
        dtype, expected = parse_like(like, "scatter")
        ndims = expected.rank if expected is not None and expected.rank is not None else -1
        if ndims < 0 and not tf.executing_eagerly():
            raise ConfigError("tfdist.comm.scatter inside tf.function: ranks other than the root must pass like=a "
                              "tf.TensorSpec (or tensor) with the piece's dtype and number of dimensions.")
    # 1. dtypes and numbers of dimensions
    table = guard("scatter", group.ranks, lambda: backend.all_gather(
        tf.constant([[dtype.as_datatype_enum, ndims]], tf.int64), group))
    agree = _agreement(table, root, group)
    root_ndims = int(table[root, 1]) if tf.executing_eagerly() else ndims
    # 2. the pieces' shapes and padded length
    if group.rank == root:
        rows, meta = pack_pieces(pieces)
    else:
        meta = tf.zeros([group.size, root_ndims + 1], tf.int64)
    with tf.control_dependencies(agree):
        meta = tf.identity(meta)
    meta = guard("scatter", group.ranks, lambda: backend.broadcast(meta, root, group))
    # 3. the pieces
    if group.rank != root:
        rows = tf.zeros(tf.stack([tf.cast(group.size, tf.int64), meta[0, -1]]), dtype)
    received = guard("scatter", group.ranks,
                     lambda: carry(rows, backend.move_dtypes, lambda w: backend.all_to_all(w, group)))
    piece = unpack_piece(received[root], meta[group.rank])
    if tf.executing_eagerly() and expected is not None and not expected.is_compatible_with(piece.shape):
        raise ConfigError(f"tfdist.comm.scatter: the root's piece for this rank has shape {tuple(piece.shape)}; "
                          f"like= expects {tuple(expected)}.")
    return piece


def _agreement(table: tf.Tensor, root: int, group: Group) -> list:
    """Checks that every rank expects the root's dtype and number of dimensions (-1: any). Eagerly a
    ConfigError (on every rank alike); in a tf.function, the Assert to wait for."""
    codes, ranks = table[:, 0], table[:, 1]
    same = tf.reduce_all(tf.equal(codes, codes[root])) & tf.reduce_all((ranks < 0) | tf.equal(ranks, ranks[root]))
    if not tf.executing_eagerly():
        message = ("tfdist.comm.scatter: the ranks expect different dtypes or numbers of dimensions (rows: "
                   "[dtype enum, ndims] per rank)")
        return [tf.debugging.Assert(same, [message, table])]
    if not bool(same):
        rows = table.numpy()
        dims = (rows[:, 0] == rows[root, 0]).all()  # the dtypes agree: name the numbers of dimensions
        names = "; ".join(f"rank {r}: {tf.as_dtype(int(c)).name}" + (f" {int(n)}-D" if dims and n >= 0 else "")
                          for r, (c, n) in zip(group.ranks, rows))
        raise ConfigError(f"tfdist.comm.scatter: the ranks expect different pieces ({names}); `like` must have the "
                          "dtype and number of dimensions of the root's pieces.")
    return []


def _pieces(xs: object, group: Group) -> list[tf.Tensor]:
    if xs is None:
        raise ConfigError("tfdist.comm.scatter: the root must pass xs: a list of group.size tensors or a tensor "
                          "whose first dimension is a multiple of the group size.")
    if isinstance(xs, (list, tuple)):
        pieces = [as_tensor(p, "scatter", f"xs[{i}]") for i, p in enumerate(xs)]
        if len(pieces) != group.size:
            raise ConfigError(f"tfdist.comm.scatter: xs has {len(pieces)} pieces; the group has {group.size} ranks.")
        if len({p.dtype for p in pieces}) > 1 or len({p.shape.rank for p in pieces}) > 1:
            raise ConfigError(f"tfdist.comm.scatter: the pieces of xs must share dtype and number of dimensions, got "
                              f"{[(p.dtype.name, tuple(p.shape)) for p in pieces]}.")
        return pieces
    x = as_tensor(xs, "scatter", "xs")
    check_divisible(x, group, "scatter", "xs")
    return tf.split(x, group.size)
