"""GroupedZeroEngine: ZeRO stages 1 and 2 when each variable's replica copies live on their own devices."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence

import tensorflow as tf

from tfdist._compat import keras_optimizer
from tfdist.errors import ConfigError
from tfdist.zero.clipping import logical_clip_factors
from tfdist.zero.collectives import LocalCollectives, ShardCollectives
from tfdist.zero.config import ZeroConfig
from tfdist.zero.engine import ZeroEngine
from tfdist.zero.replica_values import tf_variable
from tfdist.zero.sliced_gradients import rows_of
from tfdist.zero.slot_checkpoint import LogicalSlot, load_own_variables_strict

__all__ = ["GroupedZeroEngine"]


class GroupedZeroEngine:
    """ZeRO-1/2 for an optimizer whose variables are mirrored over different device lists, one device per replica.

    Under tensor parallelism a replica (a mesh row) spans several devices: shard k of every split variable has
    its copy in row r on the row's k-th device, a replicated variable on the row's first device. The flat
    `ZeroEngine` assumes one device per replica; here the variables are grouped by their device list
    (`devices[i][r]`: where replica r's copy of variable i lives) and each group is the existing `ZeroEngine`
    over its own devices: its variables concatenated, cut into R equal pieces, piece r (optimizer state, and
    at stage 2 the summed gradient) on replica r's copy of them. So the state of a variable never leaves the
    devices that hold the variable, and each device keeps 1/R of the state of the variables it holds.

    A step: one replica-context pass (Keras' all-reduce when stage 1 needs it, Keras' weight decay), then one
    merge_call in which every group reduce-scatters (or slices) its gradients, updates its pieces with the
    optimizer's own `update_step` and all-gathers the updated variables to every replica. The user's optimizer
    keeps one `LogicalSlot` per (variable, slot) in Keras' order, so checkpoints hold the full logical state.

    Clipping is on the summed gradient, as in `ZeroEngine`: `clipvalue` per element, `clipnorm` by the norm of
    each logical variable (`logical[i]`: which logical variable variable i is a shard of; the shards of a split
    variable sit in several groups), `global_clipnorm` by the norm over every group's pieces (one small
    all-reduce per group); with `gradient_accumulation_steps`, on the accumulated mean at the update step.

    `devices` lists this process's copies; `collectives(group devices)` gives each group its `ShardCollectives`
    (default `LocalCollectives`: every replica in this process; across processes, collectives whose shards are
    the global replicas). `grad_dtype`: the dtype each group's reduce-scatter sums in (`ZeroConfig.grad_dtype`).

    Example:
        >>> engine = tfdist.zero.engine_of(model.optimizer)   # ModelParallelStrategy(..., zero_stage=1)
        >>> [len(devices) for devices in engine.group_devices]     # R devices per group, one group per column
        [2, 2]
    """

    def __init__(self, optimizer, variables: list, devices: Sequence[Sequence[str]], stage: int,
                 host_device: str = "/job:localhost/replica:0/task:0/device:CPU:0",
                 collectives: Callable[[list[str]], ShardCollectives] = LocalCollectives,
                 logical: Sequence[int] | None = None, grad_dtype: tf.DType | None = None):
        if len(devices) != len(variables):
            raise ValueError(f"{len(variables)} variables but {len(devices)} device lists")
        self._optimizer = weakref.ref(optimizer)
        self.stage = stage
        self.variables = list(variables)
        groups: dict[tuple, list[int]] = {}
        for i, listed in enumerate(devices):
            groups.setdefault(tuple(listed), []).append(i)
        if len({len(listed) for listed in groups}) > 1:
            raise ValueError(f"every variable needs one copy per replica; found device lists {list(groups)}")
        self.group_devices = [list(listed) for listed in groups]
        self.group_indices = list(groups.values())
        self._where = {i: (g, j) for g, indices in enumerate(self.group_indices) for j, i in enumerate(indices)}
        self.engines = [
            self._group_engine(optimizer, [variables[i] for i in indices], ZeroConfig(
                stage, False, collectives(list(listed)), host_device, grad_dtype=grad_dtype), g)
            for g, (listed, indices) in enumerate(groups.items())]
        # clipnorm and global_clipnorm: by the norms of the logical variables over every group (`_set_clip_factors`)
        logical = list(range(len(variables))) if logical is None else list(logical)
        if len(logical) != len(variables):
            raise ValueError(f"{len(variables)} variables but {len(logical)} logical indices")
        self.members = [[logical[i] for i in indices] for indices in self.group_indices]
        self._references: dict[int, tuple] = {}  # id(LogicalSlot) -> (slot, reference variable)
        self._attach(optimizer)

    def _group_engine(self, optimizer, variables: list, config: ZeroConfig, group: int) -> ZeroEngine:
        """The engine of one device group (a GroupedZero3Engine makes stage 3's)."""
        return ZeroEngine(optimizer, variables, config, attach=False, shards_name=f"shards_{group}")

    @property
    def optimizer(self):
        return self._optimizer()

    @property
    def all_local(self) -> bool:
        """True when every piece lives in this process (reading the state needs no collective)."""
        return all(engine.comm.all_local for engine in self.engines)

    @property
    def state(self) -> "GroupedState":
        """The groups' `SlotShards` together: `gathered()` and `collective_reads()` over all of them."""
        return GroupedState([engine.state for engine in self.engines])

    @property
    def state_variables(self) -> list:
        """The shard optimizers' variables (flat slot pieces, their counters), each a tf.Variable on its device."""
        return [v for engine in self.engines for v in engine.inner.variables]

    @property
    def kept_gradient_bytes(self) -> dict[str, int] | None:
        """Bytes of reduced gradient each device keeps in the traced step (None before it is traced)."""
        if any(engine.kept_gradient_bytes is None for engine in self.engines):
            return None
        kept: dict[str, int] = {}
        for engine in self.engines:
            for device, nbytes in zip(engine.comm.devices, engine.kept_gradient_bytes):
                kept[device] = kept.get(device, 0) + nbytes
        return kept

    def slot_reference(self, slot):
        """The variable a `LogicalSlot` of this engine is a slot of, or None for anything else."""
        entry = self._references.get(id(slot))
        return entry[1] if entry is not None and entry[0] is slot else None

    def _attach(self, optimizer) -> None:
        def add_slot(opt, reference_variable, name=None, initializer="zeros"):
            # By identity in the build list (Keras makes EMA slots before it indexes the variables).
            position = next((i for i, v in enumerate(self.variables) if v is reference_variable), None)
            if position is None:
                raise ConfigError(f"ZeRO: {reference_variable.path} is not one of the variables optimizer "
                                  f"{opt.name!r} was built with.")
            group, j = self._where[position]
            state = self.engines[group].state
            slot = LogicalSlot(state, j, name or "var", reference_variable, opt.name)
            state.shards(slot.slot_name)  # fails clearly if the shard optimizer has no such slot
            keras_optimizer.track_variable(opt, slot)
            self._references[id(slot)] = (slot, reference_variable)
            return slot

        keras_optimizer.override_sharded_state(
            optimizer, add_slot=add_slot, load_own_variables=load_own_variables_strict,
            apply_gradients=lambda opt, grads, variables: self.apply(list(grads), list(variables)),
            overwrite_with_average=lambda opt, variables: self.overwrite_with_average())

    # --- one training step -----------------------------------------------------------------
    def _gradients_in_order(self, grads: list, variables: list, stage: int) -> tuple:
        """(the replica context, the gradients in the build order): ConfigError outside a replica context or for
        a trainable variable without a gradient."""
        ctx = tf.distribute.get_replica_context()
        if ctx is None or tf.distribute.in_cross_replica_context():
            raise ConfigError("ZeRO: optimizer.apply() must run inside strategy.run() (replica context), "
                              "as model.fit does.")
        by_index = {keras_optimizer.variable_index(self.optimizer, v): g for g, v in zip(grads, variables)}
        missing = [self.variables[i].path for i in range(len(self.variables)) if i not in by_index]
        if missing:
            raise ConfigError(f"ZeRO stage {stage} needs a gradient for every trainable variable; none for "
                              f"{missing}. Set trainable=False on them.")
        return ctx, [by_index[i] for i in range(len(self.variables))]

    def apply(self, grads: list, variables: list) -> None:
        """Replica context: called from the optimizer's apply() with unscaled, non-None gradients."""
        ctx, grads = self._gradients_in_order(grads, variables, self.stage)
        opt = self.optimizer
        # Lookups (IndexedSlices) reach each group's update as slices, as stock Keras updates them
        # (`sliced_gradients`); accumulated ones Keras densifies itself.
        self._sliced = () if opt.gradient_accumulation_steps else tuple(
            i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices))
        rows = [rows_of(grads[i], self.variables[i].shape) for i in self._sliced]
        if not all(engine.reduce_scatters for engine in self.engines):  # stage 1, > 2 replicas: stage 0's sum
            grads = keras_optimizer.keras_all_reduce_sum(opt, grads, [tf_variable(v) for v in self.variables])
        if not opt.gradient_accumulation_steps:
            keras_optimizer.apply_weight_decay(opt, self.variables)
        ctx.merge_call(self._step, args=(grads, opt.learning_rate, rows))

    _sliced: tuple = ()  # variables whose gradient is IndexedSlices in the step being traced

    def _step(self, strategy, grads, learning_rate, rows=()) -> None:
        rows_of_variable = dict(zip(self._sliced, rows))
        for engine, indices in zip(self.engines, self.group_indices):
            engine.sliced = tuple(j for j, i in enumerate(indices) if i in rows_of_variable)
            engine.take_slices(strategy, [rows_of_variable[i] for i in indices if i in rows_of_variable])
        reduced = [engine.reduce_gradients(strategy, [grads[i] for i in indices], learning_rate)
                   for engine, indices in zip(self.engines, self.group_indices)]
        if self._clips_by_norm():
            self._set_clip_factors([_flat_squares(engine, shards) for engine, (shards, _, _) in
                                    zip(self.engines, reduced)])
        for engine, (shards, params, lrs) in zip(self.engines, reduced):
            engine.apply_shards(shards, params, lrs)

    def _clips_by_norm(self) -> bool:
        return bool(self.optimizer.clipnorm or self.optimizer.global_clipnorm)

    def _set_clip_factors(self, squares: list) -> None:
        """Gives every group's engine its clip factors (`clip_factors`), from `squares[g][i]` (group g's per-variable
        sums of squares of the gradient its update will use, over every replica, at local replica i): clipnorm by
        each logical variable's norm (the shards of a split variable sit in several groups), global_clipnorm by the
        norm over every group (Keras' `clip_by_norm` / `clip_by_global_norm` on the unsplit model)."""
        factors = logical_clip_factors(self.optimizer, squares, self.members,
                                       [engine.comm.devices for engine in self.engines])
        for engine, found in zip(self.engines, factors):
            engine.clip_factors = found

    def overwrite_with_average(self) -> None:
        """Writes every group's moving averages into the model (Keras' EMA overwrite)."""
        for engine in self.engines:
            engine.overwrite_with_average()


def _flat_squares(engine: ZeroEngine, shards: list) -> list:
    """Per local replica, the vector of per-variable sums of squares of the gradient the engine's update will
    clip (with accumulation: the accumulated mean, as Keras clips it on the update step; read before the engine's
    step adds to the accumulators), summed over every replica (one small all-reduce)."""
    steps = engine.optimizer.gradient_accumulation_steps
    accumulators = engine.state.shards("gradient_accumulator") if steps else None
    count = len(engine.layout.sizes)
    squares = []
    for i, (shard, sid, device) in enumerate(zip(shards, engine.comm.shard_ids, engine.comm.devices)):
        with tf.device(device):
            total = (tf.identity(shard) + accumulators[i]) / tf.cast(steps, engine.dtype) if steps else shard
            ids = tf.constant(engine.layout.segment_ids(sid))
            squares.append(tf.math.unsorted_segment_sum(tf.square(total), ids, count + 1)[:count])
    return engine.comm.all_reduce_sum(squares)


class GroupedState:
    """Several groups' `SlotShards` entered together (saving across processes: every process enters the same groups
    in the same order, the order of the optimizer's variables)."""

    def __init__(self, states: list):
        self.states = states

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every group's slots all-gathered once (collective): reads inside are local."""
        with contextlib.ExitStack() as stack:
            for state in self.states:
                stack.enter_context(state.gathered())
            yield

    @contextlib.contextmanager
    def collective_reads(self) -> Iterator[None]:
        """Reads that all-gather one slot each are allowed in every group (every process reads alike)."""
        with contextlib.ExitStack() as stack:
            for state in self.states:
                stack.enter_context(state.collective_reads())
            yield
