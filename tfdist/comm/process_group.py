"""Process groups, and the contract every backend of `tfdist.comm` fulfils."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field

import tensorflow as tf

from tfdist.errors import TfdistError

__all__ = ["Backend", "CollectiveError", "Group"]


class CollectiveError(TfdistError, RuntimeError):
    """A collective failed across processes: a peer did not take part in time, or ranks disagreed."""


@dataclass(frozen=True)
class Group:
    """Processes that run collectives together (an MPI communicator, a Horovod process set).

    `ranks` are global ranks in ascending order; the process `ranks[i]` has rank `i` in the group,
    and the `root` of a collective on a group is such a group rank (as in MPI). Create groups with
    `tfdist.comm.new_group`, on every process, in the same order.

    Example (3 processes):
        >>> evens = tfdist.comm.new_group([0, 2])       # on ranks 0, 1 and 2
        >>> evens.ranks, evens.size, evens.rank         # on rank 2
        ((0, 2), 2, 1)
        >>> evens.rank is None                          # on rank 1: not a member
        True
    """

    ranks: tuple[int, ...]
    rank: int | None  # this process's rank in the group; None when it is not a member
    key: int  # the backend's id for the group (TF collective group key, Horovod process set id)
    handle: object = field(default=None, compare=False, repr=False)  # e.g. the Horovod ProcessSet

    @property
    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, group_rank: int) -> int:
        """The global rank of the member with rank `group_rank` in this group."""
        return self.ranks[group_rank]


class Backend(abc.ABC):
    """What a collectives backend provides to the API: primitives on tensors of its native dtypes.

    The API checks arguments, converts dtypes to `move_dtypes`/`reduce_dtypes` (wire.py), pads
    per-rank shapes (padding.py) and composes the rest (reduce, gather, scatter, reduce_scatter)
    from these. Every method runs eagerly and inside `tf.function`; `group` contains this process.
    """

    name: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    timeout_s: float
    world: Group
    #: dtypes broadcast, all_gather, all_to_all and send/recv carry as they are
    move_dtypes: frozenset[tf.DType]
    #: dtypes all_reduce reduces as they are ('sum', 'prod', 'max', 'min')
    reduce_dtypes: frozenset[tf.DType]
    #: whether all_gather takes tensors whose first dimensions differ across ranks
    uneven_all_gather: bool = False

    @abc.abstractmethod
    def new_group(self, ranks: Sequence[int]) -> Group:
        """A group of the sorted, distinct global `ranks` (collective: every process calls it, in order)."""

    @abc.abstractmethod
    def all_reduce(self, x: tf.Tensor, op: str, group: Group) -> tf.Tensor:
        """Element-wise 'sum', 'prod', 'max' or 'min' over the group (same shape and dtype everywhere)."""

    @abc.abstractmethod
    def all_gather(self, x: tf.Tensor, group: Group) -> tf.Tensor:
        """The group's tensors concatenated along axis 0, in group-rank order."""

    @abc.abstractmethod
    def broadcast(self, x: tf.Tensor, root: int, group: Group) -> tf.Tensor:
        """Group rank `root`'s `x` on every member (the others pass a tensor of the same shape and dtype)."""

    @abc.abstractmethod
    def all_to_all(self, x: tf.Tensor, group: Group) -> tf.Tensor:
        """Part r of `x` (group.size equal parts along axis 0) goes to group rank r; part r of the
        result is what group rank r sent here."""

    @abc.abstractmethod
    def send(self, x: tf.Tensor, dst: int) -> tf.Tensor:
        """Sends `x` to global rank `dst`; returns `x` (graph code can depend on it)."""

    @abc.abstractmethod
    def recv(self, src: int, shape: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
        """Receives the tensor global rank `src` sends, of `shape` (an int tensor) and `dtype`."""

    def shutdown(self) -> None:
        """Releases what the backend holds (nothing by default)."""
