"""ZeroEngine: ZeRO stages 1 and 2 for any element-wise Keras 3 optimizer, as flat state shards, one per replica."""

from __future__ import annotations

import weakref

import keras
import numpy as np
import tensorflow as tf

from tfdist._compat import keras_model, keras_optimizer, tf_runtime
from tfdist.comm.sum_dtype import check_unscaled_sum, summed_in
from tfdist.errors import ConfigError
from tfdist.zero.clipping import clip_flat_shards
from tfdist.zero.config import ZeroConfig, refusal, sharded_optimizer_names
from tfdist.zero.flat_layout import FlatLayout
from tfdist.zero.optimizer_step import (
    accumulate_or_update,
    decay,
    ema_step,
    update_averages,
)
from tfdist.zero.owned_slots import SlotShards
from tfdist.zero.replica_values import as_per_replica, tf_variable
from tfdist.zero.sliced_gradients import gather_slices, rows_of, shard_gradient
from tfdist.zero.slot_checkpoint import LogicalSlot, load_own_variables_strict

__all__ = ["ZeroEngine"]


class ZeroEngine:
    """Turns a built-in-scope Keras optimizer into a ZeRO-1/2 optimizer in place.

    The user's optimizer object stays the one the model holds (same class, same get_config, so a
    saved model loads in plain Keras). Its slots become `LogicalSlot` views; the real state lives
    in a twin optimizer of the same class and config (minus weight decay and clipping, which the
    engine applies on the whole model / the global gradient), built over one flat shard variable
    per replica, each on its owner's device (or the host with offload). A step:
    stage 1: all-reduce the gradients exactly as stage 0 does, each owner slices its shard
    (with two replicas: reduce-scatter, which adds the same two numbers; see `reduce_scatters`);
    stage 2: reduce-scatter the gradients so each owner only receives its shard's sum;
    then clip on the global gradient, copy the owner's parameter shard, run the optimizer's own
    update_step on the shard, and all-gather the updated shards into every replica's parameters.
    The parameter-shard variable (what update_step writes) has an unknown length and is emptied
    after the all-gather, so between steps a replica holds no 4Ψ/N copy of its parameters.

    Keras' `gradient_accumulation_steps` and `use_ema` keep their meaning, with sharded state:
    the reduced gradient shard is added to the owner's accumulator shard on every micro-step
    (DeepSpeed's stage-2 accumulation: 4Ψ/N per replica instead of a full-size accumulator), and
    only update steps clip, decay, update and all-gather; each owner keeps the moving average of
    its own parameter shard, and the averages are all-gathered into the model when Keras
    overwrites it (`ema_overwrite_frequency`, and at the end of `fit`).
    """

    def __init__(self, optimizer, variables: list, config: ZeroConfig, *, attach: bool = True,
                 shards_name: str = "shards"):
        # Weak: the optimizer holds the engine (through its slots and methods), not the reverse.
        self._optimizer = weakref.ref(optimizer)
        self._shards_name = shards_name  # the shard optimizer is "<optimizer name>_<shards_name>"
        self.config = config
        self.stage, self.comm = config.stage, config.collectives
        self._check(optimizer, variables)
        self.variables = list(variables)
        self.dtype = tf.as_dtype(variables[0].dtype)
        self.layout = self._make_layout([tuple(v.shape) for v in variables])
        # Stage 1 promises stage 0's weights bit for bit, so it reduces with stage 0's all-reduce
        # and then all-gathers: 1.5x data parallel's traffic. With two replicas a reduce-scatter
        # adds the same two numbers (x0 + x1 == x1 + x0 in IEEE arithmetic), so stage 1 takes it
        # and moves what data parallel moves (reduce-scatter + all-gather), like stage 2. With
        # more replicas the sum order of the two differs in the last bit.
        # Summed in another dtype (`grad_dtype`), stage 0's bits are not on offer: stage 1 reduce-scatters too.
        self.reduce_scatters = self.stage == 2 or self.comm.num_shards <= 2 or config.grad_dtype is not None
        self.state_devices = [config.host_device if config.offload else d for d in self.comm.devices]
        self._build_shards()
        self.kept_gradient_bytes: list[int] | None = None  # filled when the step is traced
        self.clip_factors: list | None = None  # set by a GroupedZeroEngine: norms over all its groups
        if attach:  # False: an engine for some of the optimizer's variables, driven by a GroupedZeroEngine
            self._attach(optimizer)

    def _attach(self, optimizer) -> None:
        """Makes `optimizer` keep its slots in this engine and send its gradients here."""
        engine = self

        def add_slot(opt, reference_variable, name=None, initializer="zeros"):
            # By identity in the build list: Keras makes the EMA "average" slots before it indexes
            # the variables it is building for.
            slot = LogicalSlot(engine.state, engine.variable_position(reference_variable), name or "var",
                               reference_variable, opt.name)
            engine.state.shards(slot.slot_name)  # fails clearly if the shard optimizer has no such slot
            keras_optimizer.track_variable(opt, slot)
            return slot

        keras_optimizer.override_sharded_state(
            optimizer, add_slot=add_slot, load_own_variables=load_own_variables_strict,
            apply_gradients=lambda opt, grads, variables: engine.apply(list(grads), list(variables)),
            overwrite_with_average=lambda opt, variables: engine.overwrite_with_average())

    def variable_position(self, variable) -> int:
        """Index of `variable` in the list the optimizer was built with."""
        for i, v in enumerate(self.variables):
            if v is variable:
                return i
        raise ConfigError(f"ZeRO: {_name(variable)} is not one of the variables optimizer "
                          f"{self.optimizer.name!r} was built with.")

    def _make_layout(self, shapes: list) -> FlatLayout:
        """How the state is cut into shards (stage 3 cuts each variable instead of the concatenation)."""
        return FlatLayout(shapes, self.comm.num_shards)

    @property
    def optimizer(self):
        """The user's optimizer (the one the model holds), whose state this engine shards."""
        return self._optimizer()

    # --- construction ----------------------------------------------------------------------
    def _check(self, optimizer, variables) -> None:
        name = type(optimizer).__name__
        why = refusal(optimizer)
        if why:
            raise ConfigError(
                f"ZeRO stage {self.stage} cannot shard optimizer {name}: {why}. "
                f"Supported: {', '.join(sharded_optimizer_names())} (and classes registered with "
                "tfdist.zero.register_elementwise); or use zero_stage=0.")
        if not variables:
            raise ConfigError("ZeRO: the model has no trainable variables to shard.")
        dtypes = {tf.as_dtype(v.dtype) for v in variables}
        bad = [_name(v) for v in variables if not tf.as_dtype(v.dtype).is_floating]
        if bad:
            raise ConfigError(f"ZeRO: trainable variables must be floating point; these are not: {bad}. "
                              "Mark them trainable=False (integer state is not optimised by gradients).")
        if len(dtypes) > 1:
            raise ConfigError(f"ZeRO: all trainable variables must share one dtype to be sharded flat; found "
                              f"{sorted(d.name for d in dtypes)}. Build every layer under one policy (a mixed_* "
                              "policy keeps all variables float32 and computes in 16 bits; with a 'bfloat16' "
                              "policy drop the float32 dtype= of the odd layers), or use zero_stage=0.")

    def _make_state(self, slots: dict[str, list], owner: str) -> SlotShards:
        return SlotShards(slots, self.layout, self.comm, self.state_devices, self.config.host_device, owner=owner)

    def _build_shards(self) -> None:
        """Builds the shard optimizer outside any strategy: its variables are then plain ones on the
        device we pick, instead of being mirrored on every replica."""
        cls = type(self.optimizer)
        cfg = self.optimizer.get_config()
        # Weight decay, clipping, loss scaling, accumulation and EMA live in apply(), which the shard
        # optimizer never runs (the engine calls its update_step), so its config can stay the user's;
        # with use_ema / gradient_accumulation_steps its build makes the "average" /
        # "gradient_accumulator" shards the engine keeps those in.
        cfg["name"] = f"{self.optimizer.name}_{self._shards_name}"

        def build():
            inner = cls.from_config(cfg)
            created: dict = {}
            keras_optimizer.record_slot_creation(inner, created)
            shards = []
            for sid, device in zip(self.comm.shard_ids, self.state_devices):
                with tf.device(device):
                    # The owner's parameter shard, which update_step needs as a variable to write.
                    # Its Keras shape is the shard's (slots are built from it), but the tf.Variable
                    # behind it has an unknown length: it holds the shard only during a step and is
                    # emptied after the all-gather (4Ψ/N bytes less per replica between steps).
                    shard = keras.Variable("zeros", shape=(self.layout.shard_size,), dtype=self.dtype,
                                           trainable=False, name=f"zero_shard_{sid}")
                    keras_model.swap_variable_value(shard, tf.Variable(
                        tf.zeros([0], self.dtype), shape=tf.TensorShape([None]), trainable=False,
                        name=f"zero_shard_{sid}"))
                    shards.append(shard)
            with tf.device(self.state_devices[0]):
                inner.build(shards)
            return {"inner": inner, "shards": shards, "created": created}

        box = tf_runtime.outside_any_strategy(build)
        self.inner, self.shard_params = box["inner"], box["shards"]
        slots: dict[str, list] = {}
        for (ref_id, name), var in box["created"].items():
            i = next(k for k, s in enumerate(self.shard_params) if id(s) == ref_id)
            slots.setdefault(name, [None] * len(self.shard_params))[i] = var
        self.state = self._make_state(slots, owner=f"ZeRO stage {self.stage} ({type(self.optimizer).__name__})")
        own = {id(v) for vs in slots.values() for v in vs} | {id(keras_optimizer.iteration_counter(self.inner))}
        lr = keras_optimizer.learning_rate_variable(self.inner)
        for v in self.inner.variables:
            if id(v) not in own and v is not lr and tuple(v.shape) not in ((), (self.layout.shard_size,)):
                raise ConfigError(f"ZeRO cannot shard {type(self.optimizer).__name__}: its state {v.path} has "
                                  f"shape {tuple(v.shape)}, not the variable's; only element-wise state can be cut.")

    # --- one training step -----------------------------------------------------------------
    def _replica_context(self) -> tf.distribute.ReplicaContext:
        ctx = tf.distribute.get_replica_context()
        if ctx is None or tf.distribute.in_cross_replica_context():
            raise ConfigError("ZeRO: optimizer.apply() must run inside strategy.run() (replica context), "
                              "as model.fit does.")
        return ctx

    def _in_variable_order(self, grads: list, variables: list) -> list:
        """`grads` (for `variables`, in any order) in the order of the engine's variables, each a dense tensor.
        A variable given no gradient (Keras drops None ones) gets zeros and is recorded in `self.missing`, so
        that the step leaves it and its state as they were, as stock Keras does."""
        order = [keras_optimizer.variable_index(self.optimizer, v) for v in variables]
        if len(set(order)) != len(order):
            raise ConfigError(f"ZeRO stage {self.stage}: apply_gradients got two gradients for one variable "
                              f"({[_name(v) for v in variables]}); pass each variable once.")
        by_index = dict(zip(order, grads))
        self.missing = frozenset(range(len(self.variables))) - by_index.keys()
        # Lookups stay slices too (`sliced_gradients`), except where Keras itself densifies them: accumulated.
        self.sliced = () if self.optimizer.gradient_accumulation_steps else tuple(
            i for i in sorted(by_index) if isinstance(by_index[i], tf.IndexedSlices))
        # Every gradient dense as well (IndexedSlices summed): the reduce-scatter gives the norms and accumulation.
        return [tf.convert_to_tensor(by_index[i]) if i in by_index
                else tf.zeros(self.variables[i].shape, self.dtype) for i in range(len(self.variables))]

    missing: frozenset = frozenset()  # engine variables without a gradient in the step being traced
    sliced: tuple = ()  # engine variables whose gradient is IndexedSlices in the step being traced

    def apply(self, grads: list, variables: list) -> None:
        """Replica context: called from the optimizer's apply() with unscaled, non-None gradients."""
        ctx = self._replica_context()
        # This replica's lookups, taken here (not kept on the engine: every replica's thread traces this at once).
        slice_rows = self._slice_rows(grads, variables)
        grads = self._in_variable_order(grads, variables)
        grads = ctx.merge_call(as_per_replica, args=tuple(grads))
        if not self.reduce_scatters:  # exactly stage 0's reduction: bit-identical gradients
            grads = keras_optimizer.keras_all_reduce_sum(self.optimizer, grads,
                                                         [tf_variable(v) for v in self.variables])
        if not self.optimizer.gradient_accumulation_steps:
            # Where stock Keras decays (replica context, before the update): bit-equal stage 1.
            # With accumulation, only update steps decay, inside the engine's step (`_decay`).
            keras_optimizer.apply_weight_decay(self.optimizer, self._present(self.variables))
        ctx.merge_call(self._step, args=(grads, self.optimizer.learning_rate, slice_rows))

    def _slice_rows(self, grads: list, variables: list) -> list:
        """(indices, values as rows) of each IndexedSlices gradient, in the order of `self.sliced` (which
        `_in_variable_order` sets, the same on every replica)."""
        if self.optimizer.gradient_accumulation_steps:
            return []
        by_index = {keras_optimizer.variable_index(self.optimizer, v): g for g, v in zip(grads, variables)}
        rows = [rows_of(by_index[i], self.variables[i].shape) for i in sorted(by_index)
                if isinstance(by_index[i], tf.IndexedSlices)]
        return [(ix, tf.cast(values, self.dtype)) for ix, values in rows]

    def _present(self, items: list) -> list:
        """`items` (one per engine variable) without those of variables that have no gradient this step."""
        return [item for k, item in enumerate(items) if k not in self.missing]

    def _kept(self, shard: int) -> tf.Tensor | None:
        """True where shard `shard` holds elements of a variable without a gradient (None: there are none)."""
        if not self.missing:
            return None
        parts = [np.full(p.stop - p.start, p.var in self.missing) for p in self.layout.pieces(shard)]
        parts.append(np.zeros(self.layout.padding(shard), bool))
        return tf.constant(np.concatenate(parts))

    def _pieces(self, tensors: list, shard: int) -> tf.Tensor:
        """Shard `shard` of the flat concatenation of `tensors` (one per variable), zero-padded."""
        parts = [tf.reshape(tensors[p.var], [-1])[p.start:p.stop] for p in self.layout.pieces(shard)]
        pad = self.layout.padding(shard)
        if pad:
            parts.append(tf.zeros([pad], self.dtype))
        return tf.concat(parts, 0) if len(parts) > 1 else parts[0]

    def _step(self, strategy, grads, learning_rate, slice_rows=()) -> None:
        self.take_slices(strategy, slice_rows)
        self._apply_shards(*self.reduce_gradients(strategy, grads, learning_rate))

    def take_slices(self, strategy, slice_rows) -> None:
        """Cross-replica context: every replica's lookups of the variables in `self.sliced` (`slice_rows[k]`: per
        replica (indices, values) of variable `sliced[k]`), all-gathered for the update (`sliced_gradients`)."""
        local = strategy.experimental_local_results
        self._gathered = {j: gather_slices(self.comm, local(ix), local(vals))
                          for j, (ix, vals) in zip(self.sliced, slice_rows)}

    _gathered: dict = {}  # variable -> per local replica, every replica's slices (`take_slices`)

    def reduce_gradients(self, strategy, grads: list, learning_rate) -> tuple[list, list, list]:
        """Cross-replica context (`apply`'s merge_call): `grads` (per-replica values, in the order of `variables`)
        reduced to each local replica's shard; returns (shards, local copies of the parameters, learning rates)
        for `apply_shards`. Public for a GroupedZeroEngine, which clips by the norm over all its engines between."""
        comm, layout = self.comm, self.layout
        n = len(comm.devices)
        local = strategy.experimental_local_results
        # [variable][local replica]. A gradient that is one tensor (the same on every replica, e.g. made outside
        # the replica function) is already this process's sum, as stock tf.distribute reduces it: the first
        # local replica contributes it and the others zeros, which the sum adds exactly.
        grads = [local(g) if isinstance(g, tf.distribute.DistributedValues)
                 else (g, *(tf.zeros_like(g) for _ in range(n - 1))) for g in grads]
        params = [local(tf_variable(v)) for v in self.variables]
        per_replica = isinstance(learning_rate, tf.distribute.DistributedValues)
        lrs = local(learning_rate) if per_replica else [learning_rate] * n
        if not self.reduce_scatters:
            shards = []
            for i, (sid, device) in enumerate(zip(comm.shard_ids, comm.devices)):
                with tf.device(device):
                    shards.append(self._pieces([g[i] for g in grads], sid))
            self.kept_gradient_bytes = [sum(int(np.prod(g[i].shape)) * g[i].dtype.size for g in grads)
                                        for i in range(n)]
        else:
            # One flat (padded) gradient per local replica: a single full-size copy, where per-shard
            # chunks concatenated again by the collective would make two.
            flats = []
            for i, device in enumerate(comm.devices):
                with tf.device(device):
                    parts = [tf.reshape(g[i], [-1]) for g in grads]
                    if layout.padded > layout.total:
                        parts.append(tf.zeros([layout.padded - layout.total], self.dtype))
                    flats.append(tf.concat(parts, 0))
            check_unscaled_sum(self.config.grad_dtype, keras_optimizer.applying(), f"at zero_stage {self.stage}")
            shards = summed_in(self.config.grad_dtype, flats, comm.reduce_scatter_flat, comm.devices)
            self.kept_gradient_bytes = [int(np.prod(s.shape)) * s.dtype.size for s in shards]
        return shards, params, lrs

    def apply_shards(self, shards: list, params: list, lrs: list) -> None:
        """Cross-replica context: the update from `reduce_gradients`' results (for a GroupedZeroEngine)."""
        self._apply_shards(shards, params, lrs)

    def _apply_shards(self, shards: list, params: list, lrs: list) -> None:
        """Cross-replica context: the reduced gradient shards (one per local replica) through
        accumulation, clipping, decay, the update and EMA; `params[j][i]` is local replica i's copy of
        variable j (its piece of it at stage 3)."""
        opt = self.optimizer
        iterations = opt.iterations  # Keras' own counter and rule: with accumulation it counts updates
        accumulators = self.state.shards("gradient_accumulator") if opt.gradient_accumulation_steps else None
        accumulate_or_update(opt, shards, accumulators, self.state_devices, self.dtype,
                             lambda total: self._update(total, params, lrs))
        self._ema_step(params, iterations)

    def _ema_step(self, params: list, iterations) -> None:
        """With `use_ema`: the averages of this engine's state (`_update_averages`), copied into the parameters
        every `ema_overwrite_frequency` steps."""
        ema_step(self.optimizer, iterations, lambda: self._update_averages(params, iterations),
                 lambda: self.overwrite_with_average(params))

    def _update(self, shards: list, params: list, lrs: list) -> None:
        """Clip the reduced gradient shards, decay and update each owner's parameter shard with the
        optimizer's own update_step, all-gather the shards into every replica's parameters."""
        comm, opt = self.comm, self.optimizer
        shards, clip_slices = clip_flat_shards(self.optimizer, self.comm, self.layout, shards, self.dtype,
                                               self.clip_factors)
        if opt.gradient_accumulation_steps:
            self._decay(params, lrs)
        for i, (sid, device) in enumerate(zip(comm.shard_ids, self.state_devices)):
            # After the gradient shards exist: filled earlier (it only needs the parameters), the
            # parameter shard would sit in memory through the backward pass and the reduction,
            # which is where the step peaks.
            with tf.device(device), tf.control_dependencies(shards):
                self.shard_params[i].assign(self._pieces([p[i] for p in params], sid))
        keras_optimizer.iteration_counter(self.inner).assign(
            tf.cast(keras_optimizer.iteration_counter(opt), keras_optimizer.iteration_counter(self.inner).dtype))
        for i, (sid, device) in enumerate(zip(comm.shard_ids, self.state_devices)):
            with tf.device(device):
                kept = self._kept(sid)
                state = [self.shard_params[i], *(self.state.shards(name)[i] for name in self.state.names)]
                before = [tf.identity(v.value) for v in state] if kept is not None else []
                gradient = tf.identity(shards[i])
                if self._gathered:  # lookups as stock Keras updates them: one slice per lookup
                    gradient = shard_gradient(self.layout, sid, gradient,
                                              {j: rows[i] for j, rows in self._gathered.items()}, clip_slices[i])
                with tf.control_dependencies(before):
                    self.inner.update_step(gradient, self.shard_params[i], tf.cast(lrs[i], self.dtype))
                for v, old in zip(state, before):  # variables without a gradient: as they were, state included
                    v.assign(tf.where(kept, old, v.value))
        fulls = comm.all_gather([s.value for s in self.shard_params])
        for i, device in enumerate(self.state_devices):
            with tf.device(device), tf.control_dependencies(fulls):
                self.shard_params[i].value.assign(tf.zeros([0], self.dtype))  # free it until the next step
        self._write_params(fulls, params)

    def _decay(self, params: list, lrs: list) -> None:
        decay(self.optimizer, self._present(self.variables), self._present(params), lrs, self.comm.devices, self.dtype)

    def _write_params(self, fulls: list, params: list) -> None:
        """Copies each local replica's gathered flat vector `fulls[i]` into its parameters."""
        layout = self.layout
        for i, device in enumerate(self.comm.devices):
            with tf.device(device):
                # One variable at a time (each slice waits for the previous assign): a full-size
                # split would hold a second copy of all parameters next to the gathered vector.
                done = []
                for j, var in enumerate(params):
                    with tf.control_dependencies(done):
                        piece = fulls[i][layout.offsets[j]:layout.offsets[j] + layout.sizes[j]]
                        done = [var[i].assign(tf.reshape(piece, layout.shapes[j]))]

    def _update_averages(self, params: list, iterations) -> None:
        """Keras' EMA, each owner on its own shard of the parameters."""
        currents = [lambda i=i, sid=sid: self._pieces([p[i] for p in params], sid)
                    for i, sid in enumerate(self.comm.shard_ids)]
        update_averages(self.optimizer, self.state.shards("average"), currents, iterations, self.state_devices,
                        self.dtype)

    def overwrite_with_average(self, params: list | None = None) -> None:
        """Writes the moving averages into the model's parameters (Keras'
        `_overwrite_model_variables_with_average_value`: `ema_overwrite_frequency` and the end of
        `fit`): one all-gather of the average shards. Cross-replica context; collective across
        processes, so every process calls it (as Keras' `fit` does)."""
        if params is None:
            strategy = keras_optimizer.optimizer_strategy(self.optimizer)
            params = [strategy.experimental_local_results(tf_variable(v)) for v in self.variables]
        averages = [tf.identity(a) for a in self.state.shards("average")]
        self._write_params(self.comm.all_gather(averages), params)

def _name(variable) -> str:
    return getattr(variable, "path", None) or variable.name
