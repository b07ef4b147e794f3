"""The group collectives of `tfdist.comm`: all_reduce, reduce, broadcast, all_gather, gather,
reduce_scatter, all_to_all, scatter, barrier.

`root` is a rank within the group (as in MPI); `group=None` is every process. Results are `tf.Tensor`s;
`reduce` and `gather` return None except on the root. Everything works eagerly and inside
`tf.function`, for every dtype of `wire.DTYPES`. Each call checks its arguments, exchanges the ranks'
dtype/shape signatures (unless `init(check=False)`), then runs on the backend's primitives.
"""

from __future__ import annotations

import tensorflow as tf

from tfdist.comm.arguments import as_tensor, check_divisible, check_rank
from tfdist.comm.padding import gather_uneven
from tfdist.comm.process_group import Group
from tfdist.comm.reduction import all_reduce_over, check_op_for, local_reduce, reduce_op_name
from tfdist.comm.scattering import scatter_pieces
from tfdist.comm.signatures import check_same
from tfdist.comm.state import STATE, context, guard
from tfdist.comm.wire import carry

__all__ = ["all_gather", "all_reduce", "all_to_all", "barrier", "broadcast", "gather", "reduce", "reduce_scatter",
           "scatter"]


def all_reduce(x, op: str = "sum", *, group: Group | None = None) -> tf.Tensor:
    """The element-wise reduction of every rank's `x` ('sum', 'mean', 'max', 'min', 'prod'), on every rank.

    Same shape and dtype on every rank. 'mean' of integers floor-divides; of bool it is an error ('max' is
    any, 'min' is all).

    Example (2 processes):
        >>> tfdist.comm.all_reduce(tf.constant([1.0, 2.0]) * (tfdist.comm.rank() + 1), "mean").numpy()
        array([1.5, 3. ], dtype=float32)
    """
    backend, group = context("all_reduce", group)
    op = reduce_op_name(op, "all_reduce")
    x = as_tensor(x, "all_reduce")
    check_op_for(x.dtype, op, "all_reduce")
    if group.size == 1:
        return local_reduce(x[None], op, "all_reduce")
    if STATE.check:
        x, _ = check_same(backend, x, group, "all_reduce")
    return guard("all_reduce", group.ranks, lambda: all_reduce_over(backend, x, op, group, "all_reduce"))


def reduce(x, root: int = 0, op: str = "sum", *, group: Group | None = None) -> tf.Tensor | None:
    """Like `all_reduce`, but only the group rank `root` gets the result; the others get None. (It runs
    as an all-reduce: the others receive the result too and drop it, up to twice a reduce's traffic.)

    Example (2 processes):
        >>> tfdist.comm.reduce(tf.ones([2]), root=0)   # [2., 2.] on rank 0, None on rank 1
    """
    _, group = context("reduce", group)
    root = check_rank(root, group.size, "root", "reduce", group)
    result = all_reduce(x, op, group=group)
    return result if group.rank == root else None


def broadcast(x, root: int = 0, *, group: Group | None = None) -> tf.Tensor:
    """Group rank `root`'s `x`, on every rank. The others pass a tensor of the same shape and dtype
    (its values are ignored), e.g. their own copy of the weights.

    Example (2 processes):
        >>> tfdist.comm.broadcast(tf.fill([2], tfdist.comm.rank()), root=1).numpy()
        array([1, 1], dtype=int32)
    """
    backend, group = context("broadcast", group)
    root = check_rank(root, group.size, "root", "broadcast", group)
    x = as_tensor(x, "broadcast")
    if group.size == 1:
        return tf.identity(x)
    if STATE.check:
        x, _ = check_same(backend, x, group, "broadcast")
    return guard("broadcast", group.ranks,
                 lambda: carry(x, backend.move_dtypes, lambda w: backend.broadcast(w, root, group)))


def all_gather(x, *, group: Group | None = None) -> tf.Tensor:
    """Every rank's `x` concatenated along axis 0, in rank order (scalars are stacked). First dimensions
    may differ across ranks; dtype and the other dimensions must agree.

    Example (2 processes):
        >>> tfdist.comm.all_gather(tf.range(tfdist.comm.rank() + 1)).numpy()
        array([0, 0, 1], dtype=int32)
    """
    backend, group = context("all_gather", group)
    x = as_tensor(x, "all_gather")
    if x.shape.rank == 0:
        x = x[None]
    if group.size == 1:
        return tf.identity(x)
    table = None
    if STATE.check:
        x, table = check_same(backend, x, group, "all_gather", first_dim_free=True)
    return guard("all_gather", group.ranks, lambda: gather_uneven(backend, x, group, table))


def gather(x, root: int = 0, *, group: Group | None = None) -> tf.Tensor | None:
    """Like `all_gather`, but only the group rank `root` gets the result; the others get None. (It runs
    as an all-gather: every rank receives the data and the non-roots drop it.)

    Example (2 processes):
        >>> tfdist.comm.gather(tf.fill([1], tfdist.comm.rank()), root=1)   # [0, 1] on rank 1, None on rank 0
    """
    _, group = context("gather", group)
    root = check_rank(root, group.size, "root", "gather", group)
    result = all_gather(x, group=group)
    return result if group.rank == root else None


def reduce_scatter(x, op: str = "sum", *, group: Group | None = None) -> tf.Tensor:
    """Group rank r's block of the reduction: `x` (same shape everywhere, first dimension divisible by the
    group size) is cut into group.size blocks along axis 0; rank r gets the `op` of every rank's block r.

    Runs as an all-to-all and a local reduction (TF's reduce-scatter kernel does not run on CPU), so each
    rank sends and receives (n-1)/n of `x`, like a ring reduce-scatter.

    Example (2 processes, both passing [1., 2., 3., 4.]):
        >>> tfdist.comm.reduce_scatter(tf.constant([1.0, 2.0, 3.0, 4.0])).numpy()
        array([2., 4.], dtype=float32)      # rank 0; rank 1 gets [6., 8.]
    """
    backend, group = context("reduce_scatter", group)
    op = reduce_op_name(op, "reduce_scatter")
    x = as_tensor(x, "reduce_scatter")
    check_divisible(x, group, "reduce_scatter")
    check_op_for(x.dtype, op, "reduce_scatter")
    if group.size == 1:
        return local_reduce(x[None], op, "reduce_scatter")
    if STATE.check:
        x, _ = check_same(backend, x, group, "reduce_scatter")

    def run() -> tf.Tensor:
        received = carry(x, backend.move_dtypes, lambda w: backend.all_to_all(w, group))
        blocks = tf.reshape(received, tf.concat([[group.size, -1], tf.shape(x)[1:]], 0))
        return local_reduce(blocks, op, "reduce_scatter")

    return guard("reduce_scatter", group.ranks, run)


def all_to_all(x, *, group: Group | None = None) -> tf.Tensor:
    """`x` (first dimension divisible by the group size) is cut into group.size blocks along axis 0; block r
    goes to group rank r, and block r of the result is what rank r sent here. Same shape everywhere.

    Example (2 processes):
        >>> tfdist.comm.all_to_all(tf.constant([10, 11]) + 10 * tfdist.comm.rank()).numpy()
        array([10, 20], dtype=int32)        # rank 0; rank 1 gets [11, 21]
    """
    backend, group = context("all_to_all", group)
    x = as_tensor(x, "all_to_all")
    check_divisible(x, group, "all_to_all")
    if group.size == 1:
        return tf.identity(x)
    if STATE.check:
        x, _ = check_same(backend, x, group, "all_to_all")
    return guard("all_to_all", group.ranks,
                 lambda: carry(x, backend.move_dtypes, lambda w: backend.all_to_all(w, group)))


def scatter(xs=None, root: int = 0, *, like=None, group: Group | None = None) -> tf.Tensor:
    """Group rank r gets piece r of the root's `xs`.

    On the root, `xs` is a list of group.size tensors of one dtype and number of dimensions (shapes may
    differ) or a tensor cut into group.size equal blocks along axis 0. The other ranks pass `like`: the
    dtype they expect, or a tf.TensorSpec / tensor of their piece (None dimensions match any size; a
    piece of another shape is an error; inside tf.function the number of dimensions must be known);
    their `xs` is ignored. The pieces travel padded to one length through one all-to-all.

    Example (2 processes):
        >>> xs = [tf.zeros([1]), tf.ones([3])] if tfdist.comm.rank() == 0 else None
        >>> tfdist.comm.scatter(xs, root=0, like=tf.float32).numpy()
        array([0.], dtype=float32)          # rank 0; rank 1 gets [1., 1., 1.]
    """
    backend, group = context("scatter", group)
    root = check_rank(root, group.size, "root", "scatter", group)
    return scatter_pieces(backend, xs, root, like, group)


def barrier(*, group: Group | None = None) -> None:
    """Returns once every process of the group has called it.

    Example:
        >>> tfdist.comm.barrier()
    """
    backend, group = context("barrier", group)
    if group.size > 1:
        guard("barrier", group.ranks, lambda: backend.all_reduce(tf.zeros([], tf.int32), "sum", group))
