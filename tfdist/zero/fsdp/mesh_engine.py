"""GroupedZero3Engine: ZeRO stage 3 when each variable's replica copies live on their own devices (tensor parallelism)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf

from tfdist.errors import ConfigError
from tfdist.zero.collectives import LocalCollectives, ShardCollectives
from tfdist.zero.config import ZeroConfig
from tfdist.zero.fsdp import _keras as fsdp_keras
from tfdist.zero.fsdp.engine import Zero3Engine, find_units, shard_parameters
from tfdist.zero.fsdp.regularizers import shard_regularizers
from tfdist.zero.fsdp.unit import FsdpUnit
from tfdist.zero.mesh_engine import GroupedZeroEngine

__all__ = ["GroupedZero3Engine"]


class GroupedZero3Engine(GroupedZeroEngine):
    """ZeRO-3 (parameters, gradients and optimizer state cut into one piece per replica) over device groups.

    Under tensor parallelism a replica (a mesh row) spans several devices; `devices[i][r]` is where row r's copy
    of variable i lives (a shard k of a split variable: the row's k-th device; a replicated variable: the row's
    first device). As `GroupedZeroEngine` does for stages 1 and 2, the variables are grouped by their device
    list and each group is the existing stage-3 engine (`Zero3Engine`) over its own R devices: every variable of
    the group becomes an `FsdpParam` whose piece r lives on row r's copy's device, and its optimizer state is
    built over the pieces. So a device holds 1/R of the parameters, gradients and optimizer state of the
    variables it held at stage 0, and nothing ever leaves the devices of its group.

    The units are `FsdpUnit`s, one per layer that owns weights (a `whole(layer)` layer, e.g. an attention whose
    query, key and value projections compute together, is one unit with its sublayers). A unit's weights may
    sit in several groups (a column-parallel Dense: kernel and bias shard k in group k): its forward makes one
    merge_call in which each group all-gathers its pieces onto each row's device of that group, the split
    layer computes from the gathered shards (`shards[role][k]` read through a `keras.StatelessScope`), and they
    are freed; its backward gathers again, recomputes, and reduce-scatters each group's weight gradients into
    its pieces. The optimizer step is one merge_call in which every group's engine updates its own pieces.

    Example:
        >>> engine = tfdist.zero.engine_of(model)   # ModelParallelStrategy(..., zero_stage=3) on 2 x 2, after fit
        >>> engine.stage, [len(d) for d in engine.group_devices]   # R = 2 rows per group
        (3, [2, 2, 2])
    """

    def __init__(self, optimizer, variables: list, devices: Sequence[Sequence[str]], model,
                 host_device: str = "/job:localhost/replica:0/task:0/device:CPU:0",
                 collectives: Callable[[list[str]], ShardCollectives] = LocalCollectives,
                 whole: Callable[[object], bool] = lambda layer: False, logical: Sequence[int] | None = None,
                 unit_bytes: int | None = None, reshard_after_forward: bool = True, prefetch: bool = False,
                 grad_dtype: tf.DType | None = None):
        units = find_units(model, list(variables), unit_bytes, whole,  # errors before anything changes
                           piece_regularizers=True)
        super().__init__(optimizer, variables, devices, 3, host_device, collectives, logical, grad_dtype)
        comm_of, param_of = {}, {}
        for engine in self.engines:
            shard_parameters(engine, engine.variables, engine.config)
            # L1/L2 penalties per piece: a split weight's shards each add theirs (as at stage 0), cut over the rows
            shard_regularizers(engine.variables, engine.params)
            for v, p in zip(engine.variables, engine.params):
                comm_of[id(v)], param_of[id(v)] = engine.comm, p
        self.units = [FsdpUnit(layer, [(v, param_of[id(v)]) for v in owned], comm_of[id(owned[0])],
                               comms=[comm_of[id(v)] for v in owned], reshard_after_forward=reshard_after_forward,
                               prefetch=prefetch, grad_dtype=grad_dtype) for layer, owned in units]
        fsdp_keras.reset_step_functions(model)

    def _group_engine(self, optimizer, variables: list, config: ZeroConfig, group: int) -> Zero3Engine:
        return Zero3Engine(optimizer, variables, config, attach=False, shards_name=f"shards_{group}")

    @property
    def params(self) -> list:
        """Every variable's `FsdpParam` (its pieces, one per row), in the optimizer's order."""
        found = {}
        for engine, indices in zip(self.engines, self.group_indices):
            found.update(zip(indices, engine.params))
        return [found[i] for i in range(len(self.variables))]

    # --- one training step -----------------------------------------------------------------
    def apply(self, grads: list, variables: list) -> None:
        """Replica context: `grads` are this row's reduce-scattered gradient pieces (the units' backward)."""
        ctx, grads = self._gradients_in_order(grads, variables, 3)
        opt = self.optimizer
        # A lookup's piece comes as element slices (the units' backward): each group's update takes them as they
        # are (`Zero3Engine.lookups`), the norms and accumulation their dense sum.
        self._sliced = () if opt.gradient_accumulation_steps else tuple(
            i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices))
        lookups = [(tf.identity(tf.cast(grads[i].indices, tf.int64)), tf.identity(grads[i].values))
                   for i in self._sliced]
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        for g, v, p in zip(grads, self.variables, self.params):
            if g.shape.rank != 1 or g.shape[0] not in (None, p.piece_size):
                raise ConfigError(
                    f"ZeRO stage 3: the gradient of {v.path} has shape {tuple(g.shape)}, not its piece's "
                    f"({p.piece_size},): the model ran before its parameters were sharded. Build the optimizer "
                    "before the first step, inside the scope: `optimizer.build(model.trainable_variables)` "
                    "(model.fit does).")
        ctx.merge_call(self._step, args=(grads, opt.learning_rate, lookups))

    def _step(self, strategy, grads, learning_rate, lookups=()) -> None:
        local, by_variable = strategy.experimental_local_results, dict(zip(self._sliced, lookups))
        for engine, indices in zip(self.engines, self.group_indices):
            engine.lookups = {j: list(zip(local(by_variable[i][0]), local(by_variable[i][1])))
                               for j, i in enumerate(indices) if i in by_variable}
        # clipnorm / global_clipnorm: factors from the norms over every group first (a split variable's shards sit in
        # several groups); then each group's Zero3Engine: clipping, decay, update_step, EMA on its own pieces.
        if self._clips_by_norm():
            local = strategy.experimental_local_results
            self._set_clip_factors([_piece_squares(engine, [local(grads[i]) for i in indices])
                                    for engine, indices in zip(self.engines, self.group_indices)])
        for engine, indices in zip(self.engines, self.group_indices):
            engine.step_pieces(strategy, [grads[i] for i in indices], learning_rate)


def _piece_squares(engine: Zero3Engine, grads: list) -> list:
    """Per local replica, the vector of per-variable sums of squares of the gradient pieces the engine's update
    will clip (`grads[j][i]`; with accumulation the accumulated mean, as Keras clips it), over every replica."""
    steps = engine.optimizer.gradient_accumulation_steps
    squares = []
    for i, device in enumerate(engine.comm.devices):
        accumulators = engine.state.piece_variables("gradient_accumulator", i) if steps else None
        with tf.device(device):
            row = []
            for j, g in enumerate(grads):
                total = tf.cast(g[i], engine.dtype)
                if steps:
                    total = (tf.identity(total) + accumulators[j]) / tf.cast(steps, engine.dtype)
                row.append(tf.reduce_sum(tf.square(total)))
            squares.append(tf.stack(row))
    return engine.comm.all_reduce_sum(squares)
