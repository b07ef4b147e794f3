"""How ZeRO attaches: strategies register themselves, optimizers get an engine when built in their scope.

Nothing here modifies Keras for the whole process. A strategy registers its `ZeroConfig` (or None for
plain data parallelism) with `register_strategy`; while that strategy's `scope()` or `run()` is active it
opens `building_optimizers()`, and only then does every Keras optimizer's base `build()` call
`_on_build`, which gives an optimizer built for a registered ZeRO strategy its `ZeroEngine`. Optimizers
created in that scope carry the hook on their own instance, for builds outside the scope.
`engine_of(optimizer)` finds it again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterator

import keras
import tensorflow as tf

from tfdist._compat import distribute as tf_distribute
from tfdist._compat import keras_model, keras_optimizer
from tfdist.errors import ConfigError
from tfdist.zero.config import ZeroConfig, check_unit_bytes
from tfdist.zero.engine import ZeroEngine
from tfdist.zero.fsdp.engine import enable_stage3
from tfdist.zero.loss_scale import agree_on_finite_gradients
from tfdist.zero.replica_values import tf_variable
from tfdist.zero.stage0_update import SummedGradientUpdate

__all__ = ["building_optimizers", "configure_stage3", "cross_process_engine",
           "engine_of", "gathered_state", "register_engine", "register_strategy"]

_strategies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # strategy -> ZeroConfig | None
_engines: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> ZeroEngine
_models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # stage-3 strategy -> WeakSet of its models


def register_strategy(strategy: tf.distribute.Strategy, config: ZeroConfig | None) -> None:
    """Declares `strategy` a tfdist data-parallel strategy; `config` None (or stage 0) shards nothing.

    Every registered strategy, even at stage 0, gets the clear error for an optimizer created
    outside its scope.
    """
    _strategies[strategy] = config


def register_engine(optimizer, engine) -> None:
    """Records `engine` as the holder of `optimizer`'s sharded state, for a strategy that builds its engine
    itself (ModelParallelStrategy's `GroupedZeroEngine`); `engine_of(optimizer)` then finds it."""
    _engines[optimizer] = engine


def configure_stage3(strategy: tf.distribute.Strategy, *, unit_bytes: int | None = None,
                     reshard_after_forward: bool = True, prefetch: bool = False) -> None:
    """Sets ZeRO stage 3's options on a `zero_stage=3` strategy. Call it before the model's optimizer
    is built (before the first `fit`).

    - `unit_bytes` (the wrap policy): a layer whose trainable weights (its sublayers' included) total
      at most `unit_bytes` bytes is gathered as one unit; None (the default) makes every layer that
      owns weights its own unit.
    - `reshard_after_forward`: True (the default) frees each unit's gathered parameters after its
      forward and gathers them again for its backward; False keeps them until the backward (one
      all-gather per unit and step instead of two, all units' parameters in memory at the peak).
    - `prefetch`: True issues each unit's all-gather when the unit before it (in forward, then
      backward order) starts, so it can overlap that unit's compute; False (the default) waits for
      the unit's own inputs (or output gradients), which holds fewer gathered units at once.

    Example:
        >>> strategy = tfdist.MirroredStrategy(zero_stage=3)
        >>> tfdist.zero.configure_stage3(strategy, unit_bytes=4 * 2**20)   # blocks up to 4 MiB
    """
    for name, flag in (("reshard_after_forward", reshard_after_forward), ("prefetch", prefetch)):
        if not isinstance(flag, bool):
            raise ConfigError(f"{name} must be True or False, got {flag!r}.")
    config = _strategies.get(strategy)
    if config is None or config.stage != 3:
        stage = 0 if config is None else config.stage
        check_unit_bytes(unit_bytes, stage)  # a bad value first, then the stage
        raise ConfigError(f"configure_stage3 needs a tfdist strategy created with zero_stage=3 (got stage {stage}).")
    _strategies[strategy] = dataclasses.replace(config, unit_bytes=check_unit_bytes(unit_bytes),
                                                reshard_after_forward=reshard_after_forward, prefetch=prefetch)


def engine_of(optimizer_or_model) -> ZeroEngine | None:
    """The ZeRO engine that holds an optimizer's sharded state, or None for an unsharded optimizer
    (under `ModelParallelStrategy(zero_stage=...)` a `GroupedZeroEngine`: one ZeroEngine per device group).

    Accepts an optimizer, a `LossScaleOptimizer` (its inner optimizer is the one sharded) or a
    model (its optimizer).

    Example:
        >>> engine = tfdist.zero.engine_of(model.optimizer)   # after the first fit step
        >>> engine.stage, engine.state.names
        (2, ['momentum', 'velocity'])
    """
    optimizer = getattr(optimizer_or_model, "optimizer", optimizer_or_model)
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    try:
        return _engines.get(optimizer)
    except TypeError:  # not weak-referenceable: no optimizer
        return None


def cross_process_engine(optimizer_or_model) -> ZeroEngine | None:
    """The ZeRO engine of a model's optimizer when some of its shards live in other processes, else None."""
    engine = engine_of(optimizer_or_model)
    if engine is None:
        return None
    local = engine.comm.all_local if isinstance(engine, ZeroEngine) else engine.all_local  # GroupedZeroEngine
    return None if local else engine


@contextlib.contextmanager
def gathered_state(model_or_optimizer) -> Iterator[None]:
    """Collective: inside it, the full optimizer state of a multi-process ZeRO run is readable on
    every rank without further collectives (for saving on the chief only). Every rank must enter
    it at the same point; without multi-process ZeRO it does nothing.

    Example:
        >>> with tfdist.zero.gathered_state(model):   # on every rank
        ...     if strategy.is_chief:
        ...         model.save("model.keras")             # full logical Adam state, plain-Keras loadable
    """
    engine = cross_process_engine(model_or_optimizer)
    if engine is None:
        yield
        return
    with engine.state.gathered():
        yield


@contextlib.contextmanager
def building_optimizers() -> Iterator[None]:
    """A context in which Keras optimizers built for a registered strategy get their ZeRO engine.

    Optimizers created inside it for a registered strategy keep the build hook on their instance,
    so `optimizer.build(...)` called later outside the scope shards them too. Under a zero_stage=3
    strategy, Keras models created inside it are also recorded (stage 3 wraps their layers when
    their optimizer is built).
    """
    config = _strategies.get(tf.distribute.get_strategy())
    models = keras_model.model_hooks(_on_model_create) if config is not None and config.stage == 3 \
        else contextlib.nullcontext()
    with keras_optimizer.optimizer_hooks(_on_build, _on_create), models:
        yield


def _on_model_create(model) -> None:
    strategy = tf.distribute.get_strategy()
    if strategy in _strategies:
        _models.setdefault(strategy, weakref.WeakSet()).add(model)


def _on_create(optimizer) -> None:
    if tf.distribute.get_strategy() in _strategies:
        keras_optimizer.hook_instance_build(optimizer, _on_build)


def _on_build(optimizer, variables) -> None:
    """Build hook: turns `optimizer` into a ZeRO optimizer when its variables live under a ZeRO strategy."""
    if engine_of(optimizer) is not None:
        return
    owners = [s for s in (getattr(tf_variable(v), "distribute_strategy", None) for v in variables) if s is not None]
    target = next((s for s in [*owners, tf.distribute.get_strategy()] if s in _strategies), None)
    if target is None:
        return
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):  # its inner optimizer is the one sharded
        if target.num_replicas_in_sync > 1:
            agree_on_finite_gradients(optimizer)
        return
    if keras_optimizer.optimizer_strategy(optimizer) is not target:
        raise ConfigError(
            f"optimizer {optimizer.name!r} was created outside the strategy's scope, but the model's "
            "variables belong to it. Create the optimizer (or pass its name, e.g. optimizer='adam', to "
            "model.compile) inside `with strategy.scope():`.")
    config = _strategies[target]
    if config is None or config.stage == 0:
        if optimizer.gradient_accumulation_steps and tf_distribute.uses_merge_call(target):
            # Keras puts an accumulating update inside tf.cond; local replicas meet in a merge_call, which
            # cannot run there (stock MirroredStrategy fails the same way, deep inside TensorFlow).
            raise ConfigError(
                f"gradient_accumulation_steps={optimizer.gradient_accumulation_steps} at zero_stage=0 needs one "
                f"device per process (this process runs {len(target.extended.worker_devices)} replicas). Use "
                "zero_stage=1 or higher (its engine accumulates), or strategy.no_sync() in a custom loop.")
        # Stock Keras clips each replica's own gradient and cannot run its EMA overwrite over merge_call
        # replicas; clip the summed gradient and average as ZeRO does, as one device with the global batch.
        if target.num_replicas_in_sync > 1 and SummedGradientUpdate.needed(optimizer):
            SummedGradientUpdate.attach(optimizer)
        return
    if config.stage == 3:
        _engines[optimizer] = enable_stage3(optimizer, list(variables), config, _model_of(target, variables))
        return
    _engines[optimizer] = ZeroEngine(optimizer, list(variables), config)


def _model_of(strategy, variables):
    """The model created in `strategy`'s scope that holds `variables` (stage 3 wraps its layers)."""
    wanted = {id(v) for v in variables}
    for model in list(_models.get(strategy, ())):
        if wanted <= {id(v) for v in model.trainable_variables}:
            return model
    raise ConfigError("zero_stage=3 shards the parameters of a Keras model created inside the strategy's scope; "
                      "the optimizer is being built for variables of no such model. A stage-3 weight is gathered "
                      "only around its layer's call, and a bare variable has no call to gather it for. Create the "
                      "model (and compile it) inside `with strategy.scope():`, or use zero_stage=2 for bare "
                      "variables (optimizer state and gradients sharded, parameters replicated).")
