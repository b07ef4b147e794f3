"""Stage 0 over several replicas: Keras' clipping and EMA on the summed gradient, in one merge_call, as ZeRO does.

Stock Keras 3 clips each replica's own gradient before the all-reduce (local norms), and runs its EMA overwrite
(`ema_overwrite_frequency`) in a `tf.cond` whose `extended.update` needs a merge_call, which fails when every
replica step meets in a merge_call ("merge_call called while defining a new graph"). ZeRO's engines never had
either problem: they reduce first and then clip, update and average in one cross-replica call
(`tfdist.zero.engine`, clipping in `tfdist.zero.clipping`). `SummedGradientUpdate` gives stage 0 the same
order, with Keras' own reduction and update: weights stay stage 0's where no clipping or EMA is asked for.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable

import tensorflow as tf

from tfdist._compat import keras_optimizer
from tfdist._compat.distribute import regroup_per_replica
from tfdist.zero.clipping import clip_pieces, logical_clip_factors
from tfdist.zero.collectives import LocalCollectives
from tfdist.zero.optimizer_step import ema_step, moving_average
from tfdist.zero.replica_values import tf_variable

__all__ = ["RowNorms", "SummedGradientUpdate"]

_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> its SummedGradientUpdate


@dataclasses.dataclass(frozen=True)
class RowNorms:
    """A mesh row that spans processes, for clipping norms: `all_reduce(t)` sums `t` over the row's processes (the
    split layers' own row collective, on `device`, this process's first device of the row), `shards` the ids of
    the variables that are this process's shards of split variables (every other variable is replicated: the
    same on every process of the row, counted once)."""

    all_reduce: Callable[[tf.Tensor], tf.Tensor]
    shards: frozenset
    device: str


class SummedGradientUpdate:
    """Makes one Keras optimizer (zero_stage=0, under a strategy whose replicas meet in a merge_call) clip the
    summed gradient and keep its EMA as one device with the global batch does.

    A step: Keras' own all-reduce and weight decay in replica context, then one merge_call that clips every local
    replica's copy of the summed gradient (`clip_pieces`: clipnorm per variable, or with `logical` per logical
    variable over its shards, clipvalue per element, global_clipnorm by the norm over all of them; each replica
    holds the whole sum, so its norm needs no collective; with `row`, a mesh row spanning processes, each process
    holds only its shards: their squares are summed over the row's processes by one small all-reduce, replicated
    variables counted once), runs Keras' own update of every variable, and with `use_ema` updates the averages
    and, every `ema_overwrite_frequency` steps, writes them into the model, all in cross-replica context (no
    merge_call inside a `tf.cond`). Every process computes the same norms from the same summed values (across a
    row: the same all-reduced bits plus the same replicated squares), so processes stay bit-identical. Optimizers
    with `gradient_accumulation_steps` keep Keras' path.

    Example:
        >>> optimizer = keras.optimizers.Adam(1e-3, global_clipnorm=1.0, use_ema=True, ema_overwrite_frequency=10)
        >>> SummedGradientUpdate.needed(optimizer)
        True
        >>> SummedGradientUpdate.attach(optimizer)      # done by ModelParallelStrategy when the optimizer is built
    """

    def __init__(self, optimizer, logical: dict[int, int] | None = None, row: RowNorms | None = None):
        # logical: id(variable) -> its logical variable's index (a split variable's shards share one): clipnorm
        # clips each logical variable by its own norm, the sum of its shards' squares.
        self.logical = dict(logical or {})
        self.row = row  # a row across processes: this process holds only its shards (`RowNorms`)
        self._optimizer = weakref.ref(optimizer)  # the optimizer holds this object (its bound method), not the reverse
        keras_optimizer.override_apply_gradients(
            optimizer, lambda opt, grads, variables: self.apply(list(grads), list(variables)))

    @staticmethod
    def needed(optimizer) -> bool:
        """Whether the optimizer asks for anything stock Keras does per replica (clipping) or cannot run over
        several merge_call replicas (EMA); not with gradient accumulation (Keras' cond around the update)."""
        asks = optimizer.use_ema or optimizer.clipnorm or optimizer.clipvalue or optimizer.global_clipnorm
        return bool(asks) and not optimizer.gradient_accumulation_steps

    @classmethod
    def attach(cls, optimizer, logical: dict[int, int] | None = None,
               row: RowNorms | None = None) -> SummedGradientUpdate:
        """Attaches (once) to `optimizer`; returns the attached object. `logical`: id(variable) -> the index of the
        logical variable it is a shard of (clipnorm then takes the logical variable's norm); `row`: for a mesh row
        that spans processes, its sum and which variables are this process's shards."""
        attached = _ATTACHED.get(optimizer)
        if attached is None:
            attached = _ATTACHED[optimizer] = cls(optimizer, logical, row)
        return attached

    @property
    def optimizer(self):
        return self._optimizer()

    def apply(self, grads: list, variables: list) -> None:
        """Keras' `_backend_apply_gradients` (unscaled, non-None gradients); outside a replica context Keras' own."""
        opt = self.optimizer
        ctx = tf.distribute.get_replica_context()
        if ctx is None or tf.distribute.in_cross_replica_context():
            keras_optimizer.stock_apply_gradients(opt, grads, variables)
            return
        tf_variables = [tf_variable(v) for v in variables]
        grads = keras_optimizer.keras_all_reduce_sum(opt, grads, tf_variables)
        keras_optimizer.apply_weight_decay(opt, variables)  # where Keras decays: before the update
        keys = [self.logical.get(id(v), -1 - j) for j, v in enumerate(variables)]  # unknown: a variable of its own
        dense: dict[int, int] = {}
        keys = [dense.setdefault(k, len(dense)) for k in keys]
        split = [self.row is not None and id(v) in self.row.shards for v in variables]
        ctx.merge_call(functools.partial(self._step, tf_variables, keys, split), args=(grads, opt.learning_rate))

    def _step(self, tf_variables: list, keys: list[int], split: list[bool], strategy, grads, learning_rate) -> None:
        opt = self.optimizer
        if self.row is not None and (opt.clipnorm or opt.global_clipnorm):
            grads = self._clip_row(strategy, list(grads), keys, split)
        elif opt.clipnorm or opt.clipvalue or opt.global_clipnorm:
            grads = self._clip(strategy, list(grads), keys)
        keras_optimizer.update_variables(opt, strategy, list(zip(grads, tf_variables)), learning_rate)
        if opt.use_ema:
            self._ema(strategy)

    def _clip(self, strategy, grads: list, keys: list[int]) -> list:
        """Each local replica's copy of the summed gradients clipped as one device clips the global gradient
        (clipnorm: by the norm of each logical variable, `keys[j]` saying which one variable j is part of)."""
        local = [strategy.experimental_local_results(g) for g in grads]  # [variable][local replica]
        devices = [g.device for g in local[0]]  # one device of each replica (its first variable's)
        clipped = []  # [local replica][variable]
        for i, device in enumerate(devices):
            if self.optimizer.clipnorm and len(set(keys)) < len(keys):  # some variable is split into shards
                clipped.append(_clip_logical(self.optimizer, [g[i] for g in local], keys, device))
                continue
            with tf.device(device):  # the replica's norm next to its gradients
                (row,) = clip_pieces(self.optimizer, LocalCollectives([device]), [[g[i] for g in local]])
            clipped.append(row)
        if len(devices) == 1:  # one local replica (or no strategy): plain values, as the update takes them
            return clipped[0]
        return [regroup_per_replica([clipped[i][j] for i in range(len(devices))]) for j in range(len(grads))]

    def _clip_row(self, strategy, grads: list, keys: list[int], split: list[bool]) -> list:
        """clipnorm / global_clipnorm in a row that spans processes (one local replica): the squares of this
        process's shards (`split[j]`) summed per logical variable, one all-reduce of that vector among the row's
        processes, then the replicated variables' squares (the same on every process: counted once) added.
        Every process gets the same bits from the all-reduce and adds the same values: the same factors."""
        (local,) = zip(*[strategy.experimental_local_results(g) for g in grads])  # one replica: [variable]
        squares = []
        for g in local:
            with tf.device(g.device or self.row.device):
                squares.append(tf.reduce_sum(tf.square(tf.cast(g, tf.float32))))
        count = max(keys) + 1
        with tf.device(self.row.device):
            totals = tf.zeros([count], tf.float32)
            for own in (True, False):
                picked = [j for j in range(len(keys)) if split[j] == own]
                if not picked:
                    continue
                part = tf.math.unsorted_segment_sum(tf.stack([squares[j] for j in picked]),
                                                    tf.constant([keys[j] for j in picked], tf.int32), count)
                totals = totals + (self.row.all_reduce(part) if own else part)
        # totals[k]: logical variable k's sum of squares, so each is its own member
        ((factors,),) = logical_clip_factors(self.optimizer, [[totals]], [list(range(count))], [[self.row.device]])
        out = []
        for j, g in enumerate(local):
            with tf.device(g.device or self.row.device):
                factor = factors if factors.shape.rank == 0 else factors[keys[j]]  # global_clipnorm: one scalar
                out.append(g * tf.cast(factor, g.dtype))
        return out

    def _ema(self, strategy) -> None:
        """Keras' EMA on every copy of every variable (its formula, `_update_model_variables_moving_average`),
        and its periodic overwrite of the model by the averages."""
        opt = self.optimizer
        iterations = tf.identity(opt.iterations)  # before this step's increment, as Keras reads it

        def average_fn(average, variable):
            average.assign(moving_average(opt, average, variable, iterations, variable.dtype))

        def update():
            for variable, average in zip(keras_optimizer.trained_variables(opt), keras_optimizer.moving_averages(opt)):
                if average is not None:
                    strategy.extended.update(tf_variable(average), average_fn, args=(tf_variable(variable),),
                                             group=False)

        ema_step(opt, iterations, update, lambda: keras_optimizer.overwrite_with_average(opt))


def _clip_logical(optimizer, row: list, keys: list[int], device: str) -> list:
    """clipnorm on one replica's summed gradients (`row[j]`, each on its variable's device) by the norm of each
    logical variable: the shards' sums of squares, each taken on its shard's device, added on `device`."""
    squares = []
    for g in row:
        with tf.device(g.device or device):
            squares.append(tf.reduce_sum(tf.square(g)))
    with tf.device(device):
        stacked = tf.stack(squares)
    ((factors,),) = logical_clip_factors(optimizer, [[stacked]], [keys], [[device]])
    out = []
    for j, g in enumerate(row):
        with tf.device(g.device or device):
            out.append(g * tf.cast(factors[j], g.dtype))
    return out
