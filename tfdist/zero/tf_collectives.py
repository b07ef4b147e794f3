"""ZeRO's collectives (reduce-scatter, all-gather, all-reduce) across processes with TF's V2 collective ops."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import tensorflow as tf

from tfdist._compat import distribute as tf_distribute
from tfdist.comm.deadline import launched
from tfdist.errors import ConfigError, troubleshooting
from tfdist.zero.collectives import ShardCollectives

__all__ = ["TFShardCollectives"]


class TFShardCollectives(ShardCollectives):
    """`ShardCollectives` for a `MultiWorkerMirroredStrategy`: N workers x M local replicas.

    - reduce-scatter: `CollectiveAllToAllV2` + a local sum. Each replica sends part r of its
      gradient to replica r and sums the N parts it receives, so it moves (N-1)/N of the gradient
      like a ring reduce-scatter (TF's CollectiveReduceScatterV2 has no CPU implementation);
    - all-gather: `CollectiveGatherV2` of the equal-sized flat shards, in global replica order;
    - all-reduce (sum): `CollectiveReduceV2`, for the norms of global-norm gradient clipping.

    The ops run in their own collective group (keys never shared with the strategy's own
    collectives) but on the strategy's per-device ordering token, so all collectives of a device
    run in program order on every worker, in tf.function and eagerly. Eager calls with several
    local replicas launch one thread per replica (a collective blocks until its whole group joins).

    Every worker must make the same calls in the same order: reading the logical optimizer state
    (checkpoint saving) all-gathers, so every worker takes part in a save
    (tfdist.training.ModelCheckpoint, BackupAndRestore and save_model do). A collective that waits
    longer than the strategy's `timeout_s` fails with a ConfigError instead of hanging (eagerly bounded by
    `comm.deadline`).

    Example:
        >>> strategy = tfdist.MultiWorkerMirroredStrategy(zero_stage=2)   # under `tfdist launch -n 2`
        >>> comm = TFShardCollectives(strategy)   # a MultiWorkerMirroredStrategy, on worker 1 of 2
        >>> comm.shard_ids, comm.num_shards     # one device per worker
        ([1], 2)
    """

    def __init__(self, strategy: tf.distribute.Strategy | None, timeout_s: float | None = None, *,
                 launchers: Sequence | None = None, shard_ids: Sequence[int] = (), num_shards: int = 0):
        if launchers is None:  # the strategy's replicas: one launcher each, in a group of all of them
            launchers = tf_distribute.collective_launchers(strategy)
            first = tf_distribute.first_global_replica_id(strategy)
            shard_ids, num_shards = [first + i for i in range(len(launchers))], strategy.num_replicas_in_sync
        self._launchers = list(launchers)
        self.devices = [tf_distribute.launcher_device(lc) for lc in self._launchers]
        self.shard_ids = list(shard_ids)
        self.num_shards = int(num_shards)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # one eager collective launch at a time (no interleaving)
        self._pool = ThreadPoolExecutor(len(self.devices), thread_name_prefix="tfdist-zero-comm") \
            if len(self.devices) > 1 else None

    @classmethod
    def over_launchers(cls, launchers: Sequence, shard_ids: Sequence[int], num_shards: int,
                       timeout_s: float | None = None) -> TFShardCollectives:
        """The same collectives over given launchers, one per local shard owner (e.g. ModelParallelStrategy's
        per-device-position groups across processes: one owner per process, shard = process rank).

        Example:
            >>> comm = TFShardCollectives.over_launchers([launcher], shard_ids=[rank], num_shards=2)
        """
        return cls(None, timeout_s, launchers=launchers, shard_ids=shard_ids, num_shards=num_shards)

    # -- ShardCollectives ----------------------------------------------------------------------
    def reduce_scatter(self, chunks: Sequence[Sequence[tf.Tensor]]) -> list[tf.Tensor]:
        def one(i: int) -> tf.Tensor:
            parts = list(chunks[i])
            with tf.device(self.devices[i]):
                # row r goes to replica r; row r of the result is what replica r sent for our shard
                received = launched(tf_distribute.launcher_all_to_all, self._launchers[i], tf.stack(parts))
                return tf.add_n(tf.unstack(received, self.num_shards))  # sum in replica order

        return self._each(one, "reduce-scatter")

    def reduce_scatter_flat(self, flats: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """Like reduce_scatter, with each local replica's parts already concatenated in shard order
        (`flats[i]` = num_shards * shard_size elements).

        Sent in column chunks of about CHUNK_BYTES, one after the other (`all_to_all_sums`).
        """
        def one(i: int) -> tf.Tensor:
            with tf.device(self.devices[i]):
                rows = tf.reshape(flats[i], [self.num_shards, -1])  # a view: row r goes to replica r
                launcher = self._launchers[i]
                sums = self.all_to_all_sums(
                    rows, lambda cols: launched(tf_distribute.launcher_all_to_all, launcher, cols), self.num_shards)
                return tf.concat(sums, 0) if len(sums) > 1 else sums[0]

        return self._each(one, "reduce-scatter")

    def all_gather(self, shards: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        def one(i: int) -> tf.Tensor:
            with tf.device(self.devices[i]):
                return launched(tf_distribute.launcher_all_gather, self._launchers[i], tf.identity(shards[i]))

        return self._each(one, "all-gather")

    def all_reduce_sum(self, values: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        def one(i: int) -> tf.Tensor:
            with tf.device(self.devices[i]):
                return launched(tf_distribute.launcher_all_reduce_sum, self._launchers[i], tf.identity(values[i]))

        return self._each(one, "all-reduce")

    # -- helpers -------------------------------------------------------------------------------
    def _each(self, fn: Callable[[int], tf.Tensor], what: str) -> list[tf.Tensor]:
        """Runs fn(i) for every local replica: inline when tracing, one thread each when eager."""
        if not tf.executing_eagerly() or self._pool is None:
            return self._checked(lambda: [fn(i) for i in range(len(self.devices))], what)

        with self._lock:  # (threads start in eager mode; device scopes are set inside fn)
            return self._checked(lambda: list(self._pool.map(fn, range(len(self.devices)))), what)

    def _checked(self, run: Callable[[], list], what: str) -> list[tf.Tensor]:
        try:
            return run()
        except tf.errors.DeadlineExceededError as err:
            raise ConfigError(
                f"ZeRO {what} across workers timed out (timeout_s={self.timeout_s}): some worker did not "
                "take part. With optimizer state sharded across processes every worker must run the same "
                "steps and take part in every save (reading the full optimizer state gathers the shards): "
                "use tfdist.training.ModelCheckpoint / BackupAndRestore / save_model, or call model.save on "
                "every worker (the non-chief ones to a temporary path)."
                + troubleshooting("a-collective-times-out")) from err
