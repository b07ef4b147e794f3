"""ZeRO stage 3 (fully sharded data parallelism): parameters, gradients and optimizer state, each 1/N per replica."""

from __future__ import annotations

import functools
import math

import keras
import numpy as np
import tensorflow as tf

from tfdist._compat import keras_model, keras_optimizer, tf_runtime
from tfdist.errors import ConfigError
from tfdist.zero.clipping import clip_pieces, piece_clip_factors, piece_scale_factors
from tfdist.zero.config import ZeroConfig
from tfdist.zero.engine import ZeroEngine
from tfdist.zero.fsdp import _keras as fsdp_keras
from tfdist.zero.fsdp.layout import ParamShardLayout
from tfdist.zero.fsdp.param import FsdpParam
from tfdist.zero.fsdp.piece_state import PieceState
from tfdist.zero.fsdp.regularizers import ADDITIVE, gather_regularizers, shard_regularizers
from tfdist.zero.fsdp.unit import FsdpUnit, to_local_replicas
from tfdist.zero.optimizer_step import accumulate_or_update, update_averages
from tfdist.zero.replica_values import as_per_replica
from tfdist.zero.sliced_gradients import piece_slices, rows_of

__all__ = ["Zero3Engine", "enable_stage3", "find_units", "shard_parameters"]


class Zero3Engine(ZeroEngine):
    """ZeRO stage 3 on the ZeroEngine, with the optimizer update run per parameter piece.

    Each trainable variable is cut into N pieces (`FsdpParam.components`, one per replica, on its
    device; `ParamShardLayout` says which elements). The optimizer's own state is made per piece: the
    shard optimizer (same class and config as the user's) is built over the pieces themselves, so
    Adam's m and v of replica i's piece of variable j are variables shaped like that piece, on the
    replica's device (on the host with offload). A step runs the element-wise update directly on each
    piece with its reduce-scattered gradient piece (each FSDP unit's backward reduce-scatters):
    no flat gradient, no copy of the parameters into a shard buffer, no write-back. Clipping (on the
    global gradient), decoupled weight decay, gradient accumulation and EMA work piece by piece too.
    The units gather the parameters when they next need them.

    Example:
        >>> # zero_stage=3 on 4 replicas, Sequential([Input((8,)), Dense(16), Dense(10)]), after one fit
        >>> engine = tfdist.zero.engine_of(model)
        >>> engine.stage, engine.layout.shard_size, engine.state.names   # 32 + 4 + 40 + 3 elements
        (3, 79, ['momentum', 'velocity'])
    """

    def __init__(self, optimizer, variables: list, config: ZeroConfig, **kwargs):
        self.params: list[FsdpParam] = []  # filled by shard_parameters once the variables are converted
        self.units: list[FsdpUnit] = []
        super().__init__(optimizer, variables, config, **kwargs)  # attach/shards_name: for a GroupedZero3Engine
        self.reduce_scatters = True

    def _make_layout(self, shapes: list) -> ParamShardLayout:
        return ParamShardLayout(shapes, self.comm.num_shards)

    def _build_shards(self) -> None:
        # The state is built over the parameter pieces (`build_piece_state`), which exist only once
        # enable_stage3 has cut the variables. No flat parameter-shard buffer at stage 3.
        self.inner, self.state, self.shard_params = None, None, []
        self.piece_refs: list[list] = []  # [local replica][variable]: the Keras views of the pieces

    def build_piece_state(self) -> None:
        """Builds the shard optimizer over `self.params`' pieces (outside any strategy, so its slots are
        plain variables on the device we pick: the piece's replica, or the host with offload)."""
        cls, cfg = type(self.optimizer), self.optimizer.get_config()
        # Weight decay, clipping, accumulation and EMA run in this engine, which calls only update_step;
        # the config stays the user's so build makes the "average" / "gradient_accumulator" slots too.
        cfg["name"] = f"{self.optimizer.name}_shards"
        state_device = {}

        def build():
            inner = cls.from_config(cfg)
            created: dict = {}
            keras_optimizer.record_slot_creation(inner, created, device_of=lambda ref: state_device[id(ref)])
            refs = []
            for i, (sid, device) in enumerate(zip(self.comm.shard_ids, self.comm.devices)):
                row = []
                for param in self.params:
                    piece = param.components[i]
                    with tf.device(device):  # a piece-sized placeholder, replaced by the piece at once
                        ref = keras.Variable("zeros", shape=tuple(piece.shape), dtype=self.dtype, trainable=True,
                                             name=f"{param.name.replace('/', '_')}_piece{sid}")
                    keras_model.swap_variable_value(ref, piece)  # update_step writes the piece itself
                    state_device[id(ref)] = self.state_devices[i]
                    row.append(ref)
                refs.append(row)
            inner.build([ref for row in refs for ref in row])
            return {"inner": inner, "refs": refs, "created": created}

        box = tf_runtime.outside_any_strategy(build)
        self.inner, self.piece_refs = box["inner"], box["refs"]
        position = {id(ref): (i, j) for i, row in enumerate(self.piece_refs) for j, ref in enumerate(row)}
        pieces: dict[str, list[list]] = {}
        for (ref_id, name), var in box["created"].items():
            i, j = position[ref_id]
            pieces.setdefault(name, [[None] * len(self.params) for _ in self.piece_refs])[i][j] = var
        owner = f"ZeRO stage 3 ({type(self.optimizer).__name__})"
        self.state = PieceState(pieces, self.layout, self.comm, self.state_devices, self.config.host_device,
                                owner=owner, params=lambda: self.params)
        own = {id(v) for rows in pieces.values() for row in rows for v in row}
        own |= {id(keras_optimizer.iteration_counter(self.inner))}
        lr = keras_optimizer.learning_rate_variable(self.inner)
        for v in self.inner.variables:
            if id(v) not in own and v is not lr and tuple(v.shape) != ():
                raise ConfigError(f"ZeRO cannot shard {type(self.optimizer).__name__}: its state {v.path} has "
                                  f"shape {tuple(v.shape)}, not the variable's; only element-wise state can be cut.")

    # --- one training step -----------------------------------------------------------------
    def apply(self, grads: list, variables: list) -> None:
        """Replica context: `grads[j]` is this replica's reduce-scattered piece of variable j's gradient."""
        ctx = self._replica_context()
        lookups = self._lookup_slices(ctx, grads, variables)  # this replica's, before they are densified
        grads = self._in_variable_order(grads, variables)
        # A variable without a gradient (an output without a loss, a branch the step does not use): zeros of its
        # piece's size, and `_update` leaves it and its state as they were, as Keras leaves a None gradient's.
        grads = [tf.zeros([self.layout.piece_sizes[j]], self.dtype) if j in self.missing else g
                 for j, g in enumerate(grads)]
        grads = self._pieces_of_whole_gradients(ctx, grads)
        for j, g in enumerate(grads):
            if g.shape.rank != 1 or g.shape[0] not in (None, self.layout.piece_sizes[j]):
                raise ConfigError(
                    f"ZeRO stage 3: the gradient of {self.variables[j].path} has shape {tuple(g.shape)}: pass the "
                    f"variable's shape {tuple(self.variables[j].shape)} or its piece's ({self.layout.piece_sizes[j]},) "
                    "(what the model's own backward gives). A piece-shaped gradient of another size means the model "
                    "ran before its parameters were sharded (the optimizer was first built inside this step): build "
                    "it before the first step, inside the scope: `optimizer.build(model.trainable_variables)` "
                    "(model.fit does).")
        ctx.merge_call(self._step, args=(grads, self.optimizer.learning_rate, lookups))

    def _lookup_slices(self, ctx, grads: list, variables: list) -> list:
        """Replica context: for each variable in `self.sliced` (IndexedSlices gradients, `_in_variable_order`), the
        (positions, values) of this replica's piece that every replica's lookups give (`sliced_gradients`): from a
        unit's backward they come so already (dense shape: the piece's); a custom loop's slices of the whole
        variable are all-gathered here."""
        if self.optimizer.gradient_accumulation_steps:  # Keras densifies accumulated lookups itself
            return []
        by_index = {keras_optimizer.variable_index(self.optimizer, v): g for g, v in zip(grads, variables)}
        found, whole = {}, []
        for j in sorted(by_index):
            g = by_index[j]
            if not isinstance(g, tf.IndexedSlices):
                continue
            k = self.layout.piece_sizes[j]
            if tf.get_static_value(g.dense_shape) is not None and list(tf.get_static_value(g.dense_shape)) == [k] \
                    and tuple(self.variables[j].shape) != (k,):
                found[j] = (tf.identity(tf.cast(g.indices, tf.int64)), tf.identity(g.values))
            else:
                whole.append((j, rows_of(g, self.variables[j].shape)))
        if whole:
            gathered = ctx.merge_call(functools.partial(self._merge_lookup_slices, [j for j, _ in whole]),
                                      args=tuple(rows for _, rows in whole))
            found.update(zip((j for j, _ in whole), gathered))
        return [found[j] for j in sorted(found)]

    def _merge_lookup_slices(self, lookups: list[int], strategy, *rows) -> tuple:
        local, out = strategy.experimental_local_results, []
        for j, (indices, values) in zip(lookups, rows):
            found = piece_slices(self.comm, local(indices), [tf.cast(v, self.dtype) for v in local(values)],
                                 self.layout.piece_sizes[j])
            out.append(tuple(to_local_replicas(strategy, [f[k] for f in found], min(self.comm.shard_ids))
                             for k in (0, 1)))
        return tuple(out)

    def _pieces_of_whole_gradients(self, ctx, grads: list) -> list:
        """Replica context: a custom loop may pass a whole gradient (the variable's shape, not its piece's), in any
        form stock tf.distribute takes: per replica, one tensor shared by every replica, IndexedSlices (densified
        by `_in_variable_order`). Each is summed over the replicas and cut into pieces by one reduce-scatter, as a
        unit's backward does; a shared one counts once, as stock sums it (`as_per_replica`)."""
        whole = [j for j, g in enumerate(grads) if tuple(g.shape) == tuple(self.variables[j].shape)
                 and (g.shape.rank != 1 or g.shape[0] not in (None, self.layout.piece_sizes[j]))]
        if not whole:
            return grads
        each = ctx.merge_call(as_per_replica, args=tuple(grads[j] for j in whole))  # this replica's own value
        n, chunks = self.comm.num_shards, []
        for j, g in zip(whole, each):
            k = self.layout.piece_sizes[j]
            flat = tf.reshape(tf.cast(g, self.dtype), [-1])
            flat = tf.pad(flat, [[0, n * k - self.params[j].size]]) if n * k > self.params[j].size else flat
            chunks += [flat[r * k:(r + 1) * k] for r in range(n)]  # one per destination replica
        pieces = ctx.merge_call(self._merge_reduce_scatter, args=tuple(chunks))
        return [pieces[whole.index(j)] if j in whole else g for j, g in enumerate(grads)]

    def _merge_reduce_scatter(self, strategy, *chunks) -> tuple:
        n, local, out = self.comm.num_shards, strategy.experimental_local_results, []
        for at in range(0, len(chunks), n):
            mine = [local(c) for c in chunks[at:at + n]]  # [destination][local replica]
            summed = self.comm.reduce_scatter([[mine[r][i] for r in range(n)] for i in range(len(self.comm.devices))])
            out.append(to_local_replicas(strategy, summed, min(self.comm.shard_ids)))
        return tuple(out)

    def _step(self, strategy, grads, learning_rate, lookups=()) -> None:
        local = strategy.experimental_local_results
        self.lookups = {j: list(zip(local(positions), local(values)))
                         for j, (positions, values) in zip(self.sliced, lookups)}
        self.step_pieces(strategy, grads, learning_rate)

    lookups: dict = {}  # variable -> per local replica, (positions, values) of its piece's lookups (set per step)

    def step_pieces(self, strategy, grads: list, learning_rate) -> None:
        """Cross-replica context: `grads[j]` (per-replica values) are the replicas' gradient pieces of variable j;
        clips, decays and updates every piece (public for a GroupedZero3Engine, one call per device group)."""
        n = len(self.comm.devices)
        local = strategy.experimental_local_results
        grads = [local(g) for g in grads]  # [variable][local replica]
        params = [p.components for p in self.params]  # [variable][local replica]
        distributed = isinstance(learning_rate, tf.distribute.DistributedValues)
        lrs = local(learning_rate) if distributed else [learning_rate] * n
        pieces = []  # [local replica][variable]: the gradient pieces, as they came from the reduce-scatter
        for i, device in enumerate(self.comm.devices):
            with tf.device(device):
                # The static piece shape: a reduce-scatter across processes (TF collectives) may leave it unknown.
                pieces.append([tf.ensure_shape(tf.cast(g[i], self.dtype), [k])
                               for g, k in zip(grads, self.layout.piece_sizes)])
        self.kept_gradient_bytes = [sum(int(np.prod(g.shape)) * g.dtype.size for g in row) for row in pieces]
        self._apply_pieces(pieces, params, lrs)

    def _apply_pieces(self, grads: list, params: list, lrs: list) -> None:
        """Cross-replica context: `grads[i][j]` (replica i's gradient piece of variable j) through
        accumulation, clipping, decay, the update and EMA; `params[j][i]` is the parameter piece."""
        opt = self.optimizer
        iterations = opt.iterations  # Keras' own counter and rule: with accumulation it counts updates
        accumulators = ([self.state.piece_variables("gradient_accumulator", i) for i in range(len(grads))]
                        if opt.gradient_accumulation_steps else None)
        accumulate_or_update(opt, grads, accumulators, self.state_devices, self.dtype,
                             lambda total: self._update(total, params, lrs))
        self._ema_step(params, iterations)

    def _update(self, grads: list, params: list, lrs: list) -> None:
        """Clip (global gradient), decay, then the optimizer's own update_step on every piece."""
        opt = self.optimizer
        if self.clip_factors is not None:  # a GroupedZero3Engine's norms over all its groups
            factors = piece_scale_factors(grads, self.clip_factors)
        elif opt.clipvalue:
            factors = None
        else:
            factors = piece_clip_factors(opt, self.comm, grads)
        if factors is not None:
            grads = [[g * f for g, f in zip(row, fs)] for row, fs in zip(grads, factors)]
        elif opt.clipvalue:
            grads = clip_pieces(opt, self.comm, grads)
        self._decay(params, lrs)  # here, on the pieces (Keras decays the Keras variable, which has no value)
        counter = keras_optimizer.iteration_counter(self.inner)
        counter.assign(tf.cast(keras_optimizer.iteration_counter(self.optimizer), counter.dtype))
        for i, (row, refs, lr, device) in enumerate(zip(grads, self.piece_refs, lrs, self.state_devices)):
            with tf.device(device):
                lr = tf.cast(lr, self.dtype)
                for j, (g, ref) in enumerate(zip(row, refs)):
                    if j in self.missing:
                        continue
                    g = tf.identity(g)
                    if j in self.lookups:  # as stock Keras updates a lookup: one slice per looked-up element
                        positions, values = self.lookups[j][i]
                        if opt.clipvalue:
                            values = tf.clip_by_value(values, -opt.clipvalue, opt.clipvalue)
                        elif factors is not None:
                            values = values * factors[i][j]
                        g = tf.IndexedSlices(values, positions, tf.constant([self.layout.piece_sizes[j]], tf.int64))
                    self.inner.update_step(g, ref, lr)

    def _update_averages(self, params: list, iterations) -> None:
        """Keras' EMA, per piece."""
        averages = [self.state.piece_variables("average", i) for i in range(len(self.state_devices))]
        currents = [lambda i=i: [p[i] for p in params] for i in range(len(self.state_devices))]
        update_averages(self.optimizer, averages, currents, iterations, self.state_devices, self.dtype)

    def overwrite_with_average(self, params: list | None = None) -> None:
        """Keras' EMA overwrite: each replica writes its average pieces into its parameter pieces."""
        params = params if params is not None else [p.components for p in self.params]
        for i, device in enumerate(self.comm.devices):
            with tf.device(device):
                for average, p in zip(self.state.piece_variables("average", i), params):
                    p[i].assign(tf.identity(average))


def enable_stage3(optimizer, variables: list, config: ZeroConfig, model) -> Zero3Engine:
    """Shards `model`'s trainable `variables` (those `optimizer` is being built for) ZeRO-3 style:
    checks, builds the engine, replaces every variable's replicated value with an `FsdpParam` (pieces
    on the replicas' devices, the replicated copies are dropped), builds the optimizer state over the
    pieces and wraps each layer that owns some of them as an `FsdpUnit`."""
    variables = list(variables)
    _check_variables(variables)
    units = find_units(model, variables, config.unit_bytes, piece_regularizers=True, gathered_regularizers=True)
    engine = Zero3Engine(optimizer, variables, config)
    shard_parameters(engine, variables, config)
    shard_regularizers(variables, engine.params)
    param_of = {id(v): p for v, p in zip(variables, engine.params)}
    for layer, owned in units:
        engine.units.append(FsdpUnit(layer, [(v, param_of[id(v)]) for v in owned], config.collectives,
                                     reshard_after_forward=config.reshard_after_forward, prefetch=config.prefetch,
                                     grad_dtype=config.grad_dtype))
    gather_regularizers(engine.units)  # the others (orthogonal, a user's own) on the weight their unit gathers
    fsdp_keras.reset_step_functions(model)
    return engine


def shard_parameters(engine: Zero3Engine, variables: list, config: ZeroConfig) -> None:
    """Replaces each of `variables`' replicated values (one copy per replica, on `config.collectives`'
    devices) with an `FsdpParam` (piece r on replica r's device; the replicated copies are dropped) and builds
    `engine`'s optimizer state over the pieces. The engine's units are the caller's to make."""
    _check_variables(variables)
    comm, layout = config.collectives, engine.layout

    def build():
        made = []
        for j, v in enumerate(variables):
            k = layout.piece_sizes[j]
            with tf.device(config.host_device):
                flat = tf.reshape(tf.convert_to_tensor(keras_optimizer_value(v)), [-1])
                flat = tf.pad(flat, [[0, k * comm.num_shards - layout.sizes[j]]])
            pieces = []
            for r, device in zip(comm.shard_ids, comm.devices):
                with tf.device(device):
                    # A copy, not a slice: a slice along the first dimension shares the replicated
                    # variable's buffer, which the piece would then keep alive, and the first in-place
                    # update (the optimizer's, per piece) would copy it once more.
                    pieces.append(tf.Variable(tf.raw_ops.DeepCopy(x=flat[r * k:(r + 1) * k]), trainable=True,
                                              name=f"{v.path.replace('/', '_')}_fsdp{r}"))
            made.append(FsdpParam(v.path, v.shape, v.dtype, pieces, comm.num_shards, config.host_device,
                                  shard_ids=list(comm.shard_ids), gather=lambda p: engine.state.gather_param(p)))
        return made

    engine.params = tf_runtime.outside_any_strategy(build)
    engine.build_piece_state()
    for v, p in zip(variables, engine.params):
        keras_model.swap_variable_value(v, p)  # the replicated tf.Variable has no other holder: freed


def keras_optimizer_value(variable) -> tf.Tensor:
    """The current full value of a (still replicated) Keras variable."""
    return tf.convert_to_tensor(variable.value)


def _check_variables(variables: list) -> None:
    bad = [f"{v.path} ({what})" for v in variables
           for what in ("constraint",) if getattr(v, "constraint", None) is not None]
    if bad:
        raise ConfigError(f"zero_stage=3: these weights have a constraint, which would read the whole weight "
                          f"after every update: {bad}. Remove the constraints or use zero_stage=2.")


def find_units(model, variables: list, unit_bytes: int | None = None, whole=lambda layer: False, *,
               piece_regularizers: bool = False, gathered_regularizers: bool = False) -> list[tuple]:
    """(layer, its trainable variables to shard) for the top-most layers that own some of `variables`
    directly, or (with `unit_bytes`) whose weights, sublayers' included, total at most `unit_bytes`, or for
    which `whole(layer)` is true; a unit includes the variables of its sublayers (like FSDP's size-based
    auto-wrap, top-down). Weight regularizers are refused unless `piece_regularizers` (the caller then takes
    them per piece, `shard_regularizers`) and they are sums over elements, or `gathered_regularizers` (the
    caller takes the others on the gathered weight, `gather_regularizers`)."""
    wanted = {id(v) for v in variables}
    units, seen = [], set()

    def visit(layer) -> None:
        if id(layer) in seen:
            return
        seen.add(id(layer))
        owned = [v for v in layer.trainable_variables if id(v) in wanted]
        small = unit_bytes is not None and owned and \
            sum(math.prod(v.shape) * tf.as_dtype(v.dtype).size for v in owned) <= unit_bytes
        small = small or bool(owned and whole(layer))
        if small or any(id(v) in wanted for v in fsdp_keras.direct_trainable_variables(layer)):
            regularized = [v for v in owned if getattr(v, "regularizer", None) is not None]
            refused = [f"{v.path} ({type(v.regularizer).__name__})" for v in regularized
                       if not (piece_regularizers and type(v.regularizer) in ADDITIVE) and not gathered_regularizers]
            if refused:
                allowed = " or ".join(c.__name__ for c in ADDITIVE)
                which = (f"only {allowed} (sums over elements, taken on each piece) are supported here"
                         if piece_regularizers else "a mesh's stage-3 pieces take none yet")
                raise ConfigError(f"zero_stage=3: layer {layer.name!r} has regularizers ({refused}) that read whole "
                                  f"weights outside the layer's call; {which}. Remove them (or add the penalty to "
                                  "the loss inside the call) or use zero_stage=2.")
            units.append((layer, owned))
            return
        for sub in fsdp_keras.sublayers(layer):
            visit(sub)

    visit(model)
    covered = {id(v) for _, owned in units for v in owned}
    missing = [v.path for v in variables if id(v) not in covered]
    if missing:
        raise ConfigError(f"zero_stage=3: trainable variables {missing} belong to no layer of model "
                          f"{model.name!r}; every trainable weight must be created by a layer (add_weight).")
    return units
