"""ZeRO stage 3 (fully sharded data parallelism): parameters, gradients and optimizer state, each 1/N per replica."""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from tfdist._compat import fsdp_keras, keras_model, keras_optimizer, tf_runtime
from tfdist.errors import ConfigError
from tfdist.sharding.config import ZeroConfig
from tfdist.sharding.fsdp_param import FsdpParam
from tfdist.sharding.fsdp_unit import FsdpUnit
from tfdist.sharding.zero import ZeroEngine
from tfdist.sharding.zero3_layout import ParamShardLayout
from tfdist.sharding.zero3_state import Zero3State

__all__ = ["Zero3Engine", "enable_stage3"]


class Zero3Engine(ZeroEngine):
    """ZeRO stage 3 on the ZeroEngine: the same flat state shards and element-wise update, over a
    `ParamShardLayout`, so that replica i's optimizer shard covers exactly its pieces of the
    parameters (`FsdpParam.components[i]`).

    The gradients reach `apply` already reduce-scattered (each FSDP unit's backward does it), one
    piece per variable and replica. A step concatenates a replica's pieces into its flat gradient
    shard, clips (on the global gradient), decays, copies its parameter pieces into the shard
    variable, runs the optimizer's own `update_step` and writes the result back into the pieces:
    no all-gather, the units gather the parameters when they next need them.

    Example:
        >>> # zero_stage=3 on 4 replicas, Sequential([Input((8,)), Dense(16), Dense(10)]), after one fit
        >>> engine = tfdist.sharding.engine_of(model)
        >>> engine.stage, engine.layout.shard_size, engine.state.names   # 32 + 4 + 40 + 3 elements
        (3, 79, ['momentum', 'velocity'])
    """

    def __init__(self, optimizer, variables: list, config: ZeroConfig):
        self.params: list[FsdpParam] = []  # filled by enable_stage3 once the variables are converted
        self.units: list[FsdpUnit] = []
        super().__init__(optimizer, variables, config)
        self.reduce_scatters = True

    def _make_state(self, slots: dict[str, list], owner: str) -> Zero3State:
        # Saving then reads the parameters collectively too.
        return Zero3State(slots, self.layout, self.comm, self.state_devices, self.config.host_device, owner=owner,
                          params=lambda: self.params)

    def _make_layout(self, shapes: list) -> ParamShardLayout:
        return ParamShardLayout(shapes, self.comm.num_shards)

    def apply(self, grads: list, variables: list) -> None:
        """Replica context: `grads[j]` is this replica's reduce-scattered piece of variable j's gradient."""
        ctx, grads = self._replica_context(), self._in_variable_order(grads, variables)
        for j, g in enumerate(grads):
            if g.shape.rank != 1 or g.shape[0] not in (None, self.layout.piece_sizes[j]):
                raise ConfigError(
                    f"ZeRO stage 3: the gradient of {self.variables[j].path} has shape {tuple(g.shape)}, not its "
                    f"piece's ({self.layout.piece_sizes[j]},): the model ran before its parameters were sharded "
                    "(the optimizer was first built inside this step). Build the optimizer before the first "
                    "step, inside the scope: `optimizer.build(model.trainable_variables)` (model.fit does).")
        ctx.merge_call(self._step, args=(grads, self.optimizer.learning_rate))

    def _step(self, strategy, grads, learning_rate) -> None:
        n = len(self.comm.devices)
        local = strategy.experimental_local_results
        grads = [local(g) for g in grads]
        params = [p.components for p in self.params]
        distributed = isinstance(learning_rate, tf.distribute.DistributedValues)
        lrs = local(learning_rate) if distributed else [learning_rate] * n
        shards = []
        for i, device in enumerate(self.comm.devices):
            with tf.device(device):
                shards.append(tf.concat([tf.cast(g[i], self.dtype) for g in grads], 0))
        self.kept_gradient_bytes = [int(np.prod(s.shape)) * s.dtype.size for s in shards]
        self._apply_shards(shards, params, lrs)

    def _pieces(self, tensors: list, shard: int) -> tf.Tensor:
        # Stage 3: `tensors` are already replica `shard`'s pieces of each variable.
        return tf.concat([tf.identity(t) for t in tensors], 0) if len(tensors) > 1 else tf.identity(tensors[0])

    def _update(self, shards: list, params: list, lrs: list) -> None:
        opt = self.optimizer
        shards = self._clip(shards)
        self._decay(params, lrs)  # here, on the pieces (Keras decays the Keras variable, which has no value)
        for i, device in enumerate(self.state_devices):
            with tf.device(device), tf.control_dependencies(shards):
                self.shard_params[i].assign(self._pieces([p[i] for p in params], i))
        counter = keras_optimizer.iteration_counter(self.inner)
        counter.assign(tf.cast(keras_optimizer.iteration_counter(opt), counter.dtype))
        for i, device in enumerate(self.state_devices):
            with tf.device(device):
                self.inner.update_step(tf.identity(shards[i]), self.shard_params[i], tf.cast(lrs[i], self.dtype))
        written = self._write_pieces([s.value for s in self.shard_params], params)
        for i, device in enumerate(self.state_devices):
            with tf.device(device), tf.control_dependencies(written[i]):
                self.shard_params[i].value.assign(tf.zeros([0], self.dtype))  # free it until the next step

    def _write_pieces(self, flats: list, params: list) -> list[list]:
        """Splits replica i's flat shard `flats[i]` into its pieces of each variable."""
        done = []
        for i, device in enumerate(self.comm.devices):
            with tf.device(device):
                parts = tf.split(tf.identity(flats[i]), self.layout.piece_sizes)
                done.append([p[i].assign(part) for p, part in zip(params, parts)])
        return done

    def overwrite_with_average(self, params: list | None = None) -> None:
        """Keras' EMA overwrite: each replica writes its average shard into its parameter pieces."""
        params = params if params is not None else [p.components for p in self.params]
        self._write_pieces([tf.identity(a) for a in self.state.shards("average")], params)

    def _decay(self, params: list, lrs: list) -> None:
        opt = self.optimizer
        if not opt.weight_decay:
            return
        for j, variable in enumerate(self.variables):
            if not keras_optimizer.uses_weight_decay(opt, variable):
                continue
            for i, device in enumerate(self.comm.devices):
                with tf.device(device):
                    wd, lr = tf.cast(opt.weight_decay, self.dtype), tf.cast(lrs[i], self.dtype)
                    params[j][i].assign_sub(params[j][i] * wd * lr)


def enable_stage3(optimizer, variables: list, config: ZeroConfig, model) -> Zero3Engine:
    """Shards `model`'s trainable `variables` (those `optimizer` is being built for) ZeRO-3 style:
    checks, builds the engine (optimizer state), replaces every variable's replicated value with an
    `FsdpParam` (pieces on the replicas' devices, the replicated copies are dropped) and wraps each
    layer that owns some of them as an `FsdpUnit`."""
    variables = list(variables)
    _check_variables(variables)
    units = _find_units(model, variables, config.unit_bytes)
    engine = Zero3Engine(optimizer, variables, config)
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
                    pieces.append(tf.Variable(flat[r * k:(r + 1) * k], trainable=True,
                                              name=f"{v.path.replace('/', '_')}_fsdp{r}"))
            made.append(FsdpParam(v.path, v.shape, v.dtype, pieces, comm.num_shards, config.host_device,
                                  shard_ids=list(comm.shard_ids), gather=engine.state.gather_param))
        return made

    engine.params = tf_runtime.outside_any_strategy(build)
    for v, p in zip(variables, engine.params):
        keras_model.swap_variable_value(v, p)  # the replicated tf.Variable has no other holder: freed
    param_of = {id(v): p for v, p in zip(variables, engine.params)}
    for layer, owned in units:
        engine.units.append(FsdpUnit(layer, [(v, param_of[id(v)]) for v in owned], comm,
                                     reshard_after_forward=config.reshard_after_forward, prefetch=config.prefetch))
    fsdp_keras.reset_step_functions(model)
    return engine


def keras_optimizer_value(variable) -> tf.Tensor:
    """The current full value of a (still replicated) Keras variable."""
    return tf.convert_to_tensor(variable.value)


def _check_variables(variables: list) -> None:
    bad = [f"{v.path} ({what})" for v in variables
           for what in ("constraint",) if getattr(v, "constraint", None) is not None]
    if bad:
        raise ConfigError(f"zero_stage=3: these weights have a constraint, which would read the whole weight "
                          f"after every update: {bad}. Remove the constraints or use zero_stage=2.")


def _find_units(model, variables: list, unit_bytes: int | None = None) -> list[tuple]:
    """(layer, its trainable variables to shard) for the top-most layers that own some of `variables`
    directly, or (with `unit_bytes`) whose weights, sublayers' included, total at most `unit_bytes`;
    a unit includes the variables of its sublayers (like FSDP's size-based auto-wrap, top-down)."""
    wanted = {id(v) for v in variables}
    units, seen = [], set()

    def visit(layer) -> None:
        if id(layer) in seen:
            return
        seen.add(id(layer))
        owned = [v for v in layer.trainable_variables if id(v) in wanted]
        small = unit_bytes is not None and owned and \
            sum(math.prod(v.shape) * tf.as_dtype(v.dtype).size for v in owned) <= unit_bytes
        if small or any(id(v) in wanted for v in fsdp_keras.direct_trainable_variables(layer)):
            attributes = ("kernel_regularizer", "bias_regularizer", "embeddings_regularizer")
            regularized = [v.path for v in owned if getattr(v, "regularizer", None) is not None] + [
                f"{layer.name}.{a}" for a in attributes if getattr(layer, a, None) is not None]
            if regularized:
                raise ConfigError(f"zero_stage=3: layer {layer.name!r} has regularizers ({regularized}), which read "
                                  "whole weights outside the layer's call. Remove them (or add the penalty to the "
                                  "loss inside the call) or use zero_stage=2.")
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
