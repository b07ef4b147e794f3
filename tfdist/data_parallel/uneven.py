"""Uneven per-rank data: the ranks agree, at every step, whether the step happens (what DDP's join() gives).

Without it, a rank whose dataset ends early leaves the epoch while the others wait in the next collective: a
hang under Horovod, a type mismatch reported as a lost worker under MultiWorkerMirroredStrategy. With
`UnevenData` attached to a multi-process strategy (its `uneven_data` option):

- every distributed dataset gets a look-ahead (tfdist.data_parallel.uneven_lookahead): during step k each rank knows
  how many of its replicas have data for step k+1, and how many rows;
- that `[replicas, rows, unknown]` vector rides along with step k's gradient all-reduce
  (tfdist.data_parallel._fused_flags), so at step k+1 every rank reads the same sum before asking for data.
  Steps without a gradient all-reduce (evaluate, predict, accumulation steps, ZeRO-2's reduce-scatter), the
  first step of an epoch and pipelines without a look-ahead (sparse, ragged) agree with a small all-reduce
  of their own instead, the way TF's iterators do it at every step;
- `"stop"`: the step happens only if every replica of every rank has data; otherwise every rank ends the
  epoch there (Keras sees the end of the dataset). The epoch is as long as the shortest rank's data;
- `"join"`: the step happens while any replica has data; replicas without data take it with an empty batch
  (zero gradient, zero weight in the loss and metrics), and each replica's loss is weighted by
  `rows * replicas / total rows` of the step, so the summed gradient is the mean over the step's real
  examples (with Keras' default mean-over-batch losses), the gradient one process would compute on the
  concatenation of the step's batches;
- the dataset's cardinality (what Keras counts steps by) is agreed once when it is distributed: the
  smallest ("stop") or largest ("join") number of steps of any rank, or unknown if any rank's is unknown.
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from collections.abc import Iterator

import tensorflow as tf

from tfdist._compat.distribute import first_global_replica_id
from tfdist._compat.tf_runtime import outside_any_strategy
from tfdist.data_parallel._uneven_input import UNKNOWN, joining, local_steps
from tfdist.data_parallel.uneven_lookahead import with_lookahead
from tfdist.errors import ConfigError

__all__ = ["MODES", "UnevenData", "agreed_steps", "check_mode"]

log = logging.getLogger(__name__)

MODES = ("stop", "join")
INFINITE = int(tf.data.INFINITE_CARDINALITY)
# The state vector of a strategy's agreement (float32; counts are exact up to 2**24):
_AGREED = 0  # [0:3] the next step as agreed by every rank: replicas with data, rows, fresh (1: agreed in time)
_AHEAD = 3  # [3:6] this rank's next step (the look-ahead): replicas with data, rows, unknown (1: no look-ahead)
_COUNTS = 6  # [6:8] steps agreed so far: fused (in the previous step's all-reduce), separate (an all-reduce of their own)
_SIZE = 8


def check_mode(mode: str) -> str:
    """`mode` if it is one of MODES, else ConfigError."""
    if mode not in MODES:
        raise ConfigError(f"uneven_data must be one of {list(MODES)} ('stop': every rank stops at the end of the "
                          f"shortest rank's data; 'join': ranks without data take steps with empty batches until "
                          f"every rank's data ends), got {mode!r}.")
    return mode


def agreed_steps(steps_per_rank: list[int], mode: str) -> int:
    """The steps per epoch every rank runs, from each rank's own count (-1 infinite, -2 unknown)."""
    if any(s == UNKNOWN for s in steps_per_rank):
        return UNKNOWN
    finite = [s for s in steps_per_rank if s >= 0]
    if mode == "stop":
        return min(finite) if finite else INFINITE
    return max(finite) if len(finite) == len(steps_per_rank) else INFINITE


class UnevenData:
    """The step agreement of one multi-process strategy (see the module docstring).

    Args:
        strategy: the strategy (a DataParallel over several processes).
        mode: "stop" or "join".
        host_device: where the few state variables live (this process's CPU).
    """

    def __init__(self, strategy: tf.distribute.Strategy, mode: str, host_device: str):
        self.strategy, self.mode = strategy, check_mode(mode)
        self.local_replicas = len(strategy.extended.worker_devices)
        self.num_replicas = int(strategy.num_replicas_in_sync)
        self.num_processes = self.num_replicas // self.local_replicas
        self._first_replica = first_global_replica_id(strategy)
        self._armed = False
        self._weighted: weakref.WeakSet = weakref.WeakSet()

        def variables():
            with tf.device(host_device):
                return (tf.Variable(tf.zeros([_SIZE]), trainable=False, name="uneven_state"),
                        tf.Variable(tf.ones([self.local_replicas]), trainable=False, name="uneven_weights"))

        # Plain variables of this process, never mirrored: created outside any strategy. One state vector
        # (see _AGREED.._COUNTS): a step reads and writes it once.
        self._state, self._weights = outside_any_strategy(variables)

    # -- datasets ------------------------------------------------------------------------------------------
    def distribute(self, distributed, mode: str | None = None):
        """TF's distributed dataset, iterating under this agreement in `mode` (None: the strategy's). Call it
        on every rank: it agrees on the number of steps with one small all-reduce."""
        mode = self.mode if mode is None else check_mode(mode)
        mine = _steps(*local_steps(distributed), mode)
        onehot = [0] * self.num_processes
        onehot[self._first_replica // self.local_replicas] = mine
        steps = agreed_steps([int(s) for s in self._sum_over_ranks(tf.constant(onehot, tf.int64)).numpy()], mode)
        if 0 <= steps < mine:
            log.info("uneven data: this rank has %d steps of data, every rank runs %d (uneven_data=%r)", mine, steps, mode)
        return joining(distributed, self, mode, with_lookahead, steps)

    # -- the input side (tfdist.data_parallel._uneven_input.StepPolicy) -----------------------------------------------
    def new_iterator(self) -> None:
        self._state[_AGREED:_AHEAD].assign(tf.zeros([3]))

    def decide(self, mode: str, has: tf.Tensor, rows: tf.Tensor, lookahead: tf.Tensor) -> tf.Tensor:
        here = tf.stack([tf.reduce_sum(tf.cast(has, tf.int64)), tf.reduce_sum(rows)])
        state = self._state.read_value()
        # Agreed during the last step (fused into its gradient all-reduce), or now with an all-reduce of its own.
        fresh = state[_AGREED + 2] > 0
        now = tf.cond(fresh, lambda: tf.cast(state[_AGREED:_AGREED + 2], tf.int64), lambda: self._sum_over_ranks(here))
        fused = tf.cast(fresh, tf.float32)
        ahead = tf.concat([tf.cast(tf.maximum(lookahead, 0), tf.float32), tf.cast(lookahead[:1] < 0, tf.float32)], 0)
        updates = [self._state.assign(
            tf.concat([tf.zeros([3]), ahead, state[_COUNTS:] + tf.stack([fused, 1 - fused])], 0))]
        if mode == "stop":  # every replica has data: the losses keep Keras' own weights
            updates.append(self._weights.assign(tf.ones([self.local_replicas])))
            go = now[0] >= self.num_replicas
        else:
            go = now[0] > 0
            share = tf.cast(rows, tf.float32) * (self.num_replicas / tf.cast(tf.maximum(now[1], 1), tf.float32))
            updates.append(self._weights.assign(tf.where(go, share, 1.0)))  # after the last step: 1 again
        # A "no" ends the epoch with an OutOfRangeError raised inside the step's function, which cancels the ops
        # still pending: the decision is handed out only once the state it wrote is written.
        with tf.control_dependencies(updates):
            return tf.identity(go)

    def agreements(self) -> dict[str, int]:
        """How the steps so far were agreed: "fused" (with the previous step's gradient all-reduce) or
        "separate" (an all-reduce of their own: first steps of epochs, steps without a gradient all-reduce)."""
        fused, separate = (int(n) for n in self._state[_COUNTS:].numpy())
        return {"fused": fused, "separate": separate}

    def _sum_over_ranks(self, local: tf.Tensor) -> tf.Tensor:
        # A plain tensor is this process's contribution (as for TF's own "replicas with data" count).
        return self.strategy.reduce(tf.distribute.ReduceOp.SUM, local, axis=None)

    # -- the step side (tfdist.data_parallel._fused_flags.FlagCarrier) ----------------------------------------------
    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Open around `strategy.run`: its first gradient all-reduce carries this rank's look-ahead."""
        self._armed = True
        try:
            yield
        finally:
            self._armed = False

    def take(self) -> tf.Tensor | None:
        if not self._armed:
            return None
        self._armed = False
        return self._state.read_value()[_AHEAD:_COUNTS]

    def receive(self, summed: tf.Tensor) -> None:
        summed = tf.cast(summed, tf.float32)
        fresh = tf.cast(tf.equal(summed[2], 0.0), tf.float32)  # any rank without a look-ahead: agree at the step
        self._state[_AGREED:_AHEAD].assign(tf.stack([summed[0], summed[1], fresh]))

    # -- "join": each replica's loss weighted by its share of the step's rows --------------------------------
    def weigh(self, optimizer) -> None:
        """Makes `optimizer.scale_loss` (which Keras' train_step applies to the loss before the gradients)
        weight this replica's loss by the step's weight: rows * replicas / total rows of the step in "join"
        mode, 1 otherwise. Only inside this strategy's replicas; elsewhere the stock method runs."""
        if optimizer is None or optimizer in self._weighted:
            return
        stock = optimizer.scale_loss

        def scale_loss(loss):
            return stock(loss) * self._replica_weight(loss.dtype)

        optimizer.scale_loss = scale_loss
        self._weighted.add(optimizer)

    def _replica_weight(self, dtype) -> tf.Tensor:
        context = tf.distribute.get_replica_context()
        if context is None or tf.distribute.get_strategy() is not self.strategy:
            return tf.constant(1, dtype)
        local = context.replica_id_in_sync_group - self._first_replica
        return tf.cast(tf.gather(self._weights.read_value(), local), dtype)


def _steps(count: int, per_step: int, mode: str) -> int:
    """Steps of a pipeline of `count` elements, `per_step` of them per step (one per local replica, or one
    if `count` already counts steps). In "stop" mode a last step that some local replica has no batch for
    does not count."""
    if count < 0:
        return count
    return count // per_step if mode == "stop" else math.ceil(count / per_step)
