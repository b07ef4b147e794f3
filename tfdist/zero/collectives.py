"""ShardCollectives: the collectives sharded state needs (ZeRO), and their in-process version (device copies)."""

from __future__ import annotations

import abc
from collections.abc import Sequence

import tensorflow as tf

__all__ = ["ShardCollectives", "LocalCollectives"]


class ShardCollectives(abc.ABC):
    """The collective operations the ZeRO engine needs across the shard owners (one per replica).

    A strategy supplies one of these; the ZeRO engine (tfdist.zero) never talks to devices,
    processes or TF collectives itself. Every method takes and returns one tensor per *local*
    replica of this process, in the order of `devices`; `shard_ids[i]` is the global shard (=
    global replica) index of local replica i. In-process MirroredStrategy has all N replicas
    local (`LocalCollectives`); a multi-worker or Horovod strategy has one or a few local
    replicas and implements the same methods with cross-process collectives, e.g. reduce-scatter
    as an all-to-all + local sum (TF's CollectiveReduceScatterV2 does not run on CPU, and
    Horovod's reducescatter is slower than its all-reduce under Gloo), and all-gather with
    `CollectiveGatherV2` / `hvd.allgather`.

    All methods are called inside the strategy's cross-replica context (merge_call), in graph
    or eager mode; collective implementations must order their ops (per-device tokens) when they
    issue several in one tf.function.
    """

    #: local replica devices, one shard owner each
    devices: Sequence[str]
    #: global shard index of each local replica
    shard_ids: Sequence[int]
    #: total number of shards (= replicas in sync)
    num_shards: int
    #: whether a read of one slot may all-gather on its own (False: only inside
    #: SlotShards.gathered()/collective_reads(), so a save on one rank alone fails clearly instead of hanging)
    gather_on_read: bool = True
    #: bytes per call when a reduce-scatter is sent in pieces (all shards' parts together)
    CHUNK_BYTES: int = 16 * 2**20

    def agree_to_read(self, what: str) -> None:
        """Called before a read of sharded state that gathers on its own (outside `gathered()`): returns when
        every process makes the same read, or raises a ConfigError. TF's collectives time out by themselves."""

    @abc.abstractmethod
    def reduce_scatter(self, chunks: Sequence[Sequence[tf.Tensor]]) -> list[tf.Tensor]:
        """Sums contributions per shard: `chunks[i][r]` is local replica i's part for global shard r
        (all of equal length). Returns, for each local replica i, the sum over all replicas of
        their part for shard `shard_ids[i]`, placed on `devices[i]`."""

    def reduce_scatter_flat(self, flats: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """`reduce_scatter` with each local replica's parts already concatenated in shard order
        (`flats[i]` has num_shards * shard_size elements). Implementations override it to avoid
        per-shard copies; this default splits and calls `reduce_scatter`."""
        chunks = []
        for flat, device in zip(flats, self.devices):
            with tf.device(device):
                chunks.append(tf.split(flat, self.num_shards))
        return self.reduce_scatter(chunks)

    def chunk_bounds(self, shard_size: int, dtype: tf.DType) -> list[tuple[int, int]]:
        """(start, stop) ranges within a shard, to send one after the other: each piece, taken
        from all `num_shards` shards, carries about CHUNK_BYTES, which bounds the temporaries of
        collectives that hold a copy (or several) of their input."""
        chunk = max(1, min(shard_size, self.CHUNK_BYTES // (dtype.size * self.num_shards)))
        return [(start, min(start + chunk, shard_size)) for start in range(0, shard_size, chunk)]

    def all_to_all_sums(self, rows: tf.Tensor, exchange, senders: int) -> list[tf.Tensor]:
        """A reduce-scatter as all-to-alls, chunk by chunk: `rows` is [num_shards, shard_size] (row r
        for shard r); `exchange(columns)` sends column chunk `columns` ([num_shards, k]) to the
        shards' owners and returns the `senders` rows it received. Returns each chunk's sum over
        senders (in sender order), one chunk in flight at a time so temporaries stay ~CHUNK_BYTES:
        an all-to-all returns as much as it is given, so one call over the whole gradient would hold
        a second full-size gradient next to the first, more than ZeRO-2 saves."""
        sums, done = [], []
        for start, stop in self.chunk_bounds(int(rows.shape[1]), rows.dtype):
            with tf.control_dependencies(done):
                sums.append(tf.add_n(tf.unstack(exchange(rows[:, start:stop]), senders)))
            done = [sums[-1]]
        return sums

    @abc.abstractmethod
    def all_gather(self, shards: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """`shards[i]` is local replica i's shard. Returns, for each local replica, the
        concatenation of all `num_shards` shards in global order, on its device."""

    @abc.abstractmethod
    def all_reduce_sum(self, values: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """Sum over all replicas of small tensors (norms for gradient clipping), one per local replica."""

    @property
    def all_local(self) -> bool:
        """True when every shard lives in this process (saving/loading then needs no collective)."""
        return len(self.shard_ids) == self.num_shards


class LocalCollectives(ShardCollectives):
    """ShardCollectives for replicas that all live in this process: plain device-to-device copies.

    Reduce-scatter moves (N-1)/N of each replica's gradient once, like a ring reduce-scatter;
    all-gather moves each shard to every other device once. Summation order is replica 0, 1, ...
    on the owner's device, so results are deterministic.

    Example:
        >>> comm = LocalCollectives(["/cpu:0", "/cpu:1"])
        >>> comm.reduce_scatter([[tf.ones(2), tf.ones(2)], [tf.ones(2), 2 * tf.ones(2)]])[1].numpy()
        array([3., 3.], dtype=float32)
    """

    def __init__(self, devices: Sequence[str]):
        self.devices = list(devices)
        self.shard_ids = list(range(len(self.devices)))
        self.num_shards = len(self.devices)

    def reduce_scatter(self, chunks: Sequence[Sequence[tf.Tensor]]) -> list[tf.Tensor]:
        out = []
        for r, device in enumerate(self.devices):
            with tf.device(device):
                parts = [chunks[i][r] for i in range(len(self.devices))]
                out.append(parts[0] if len(parts) == 1 else tf.add_n(parts))
        return out

    def all_gather(self, shards: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        out = []
        for device in self.devices:
            with tf.device(device):
                out.append(tf.concat([tf.identity(s) for s in shards], axis=0) if len(shards) > 1
                           else tf.identity(shards[0]))
        return out

    def all_reduce_sum(self, values: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        out = []
        for device in self.devices:
            with tf.device(device):
                out.append(tf.add_n([tf.identity(v) for v in values]) if len(values) > 1
                           else tf.identity(values[0]))
        return out
