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
import weakref
from collections.abc import Iterator

import keras
import tensorflow as tf

from tfdist._compat import keras_optimizer
from tfdist.errors import ConfigError
from tfdist.sharding.config import ZeroConfig
from tfdist.sharding.zero import ZeroEngine, tf_variable

__all__ = ["building_optimizers", "cross_process_engine", "engine_of", "gathered_state", "register_strategy"]

_strategies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # strategy -> ZeroConfig | None
_engines: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> ZeroEngine


def register_strategy(strategy: tf.distribute.Strategy, config: ZeroConfig | None) -> None:
    """Declares `strategy` a tfdist data-parallel strategy; `config` None (or stage 0) shards nothing.

    Every registered strategy, even at stage 0, gets the clear error for an optimizer created
    outside its scope.
    """
    _strategies[strategy] = config


def engine_of(optimizer_or_model) -> ZeroEngine | None:
    """The ZeRO engine that holds an optimizer's sharded state, or None for an unsharded optimizer.

    Accepts an optimizer, a `LossScaleOptimizer` (its inner optimizer is the one sharded) or a
    model (its optimizer).

    Example:
        >>> engine = tfdist.sharding.engine_of(model.optimizer)   # after the first fit step
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
    return engine if engine is not None and not engine.comm.all_local else None


@contextlib.contextmanager
def gathered_state(model_or_optimizer) -> Iterator[None]:
    """Collective: inside it, the full optimizer state of a multi-process ZeRO run is readable on
    every rank without further collectives (for saving on the chief only). Every rank must enter
    it at the same point; without multi-process ZeRO it does nothing.

    Example:
        >>> with tfdist.sharding.gathered_state(model):   # on every rank
        ...     if strategy.is_chief:
        ...         model.save("model.keras")             # full logical Adam state, plain-Keras loadable
    """
    engine = cross_process_engine(model_or_optimizer)
    if engine is None:
        yield
        return
    with engine.state.gathered():
        yield


def building_optimizers():
    """A context in which Keras optimizers built for a registered strategy get their ZeRO engine.

    Optimizers created inside it for a registered strategy keep the build hook on their instance,
    so `optimizer.build(...)` called later outside the scope shards them too.
    """
    return keras_optimizer.optimizer_hooks(_on_build, _on_create)


def _on_create(optimizer) -> None:
    if tf.distribute.get_strategy() in _strategies:
        keras_optimizer.hook_instance_build(optimizer, _on_build)


def _on_build(optimizer, variables) -> None:
    """Build hook: turns `optimizer` into a ZeRO optimizer when its variables live under a ZeRO strategy."""
    if engine_of(optimizer) is not None or isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return
    owners = [s for s in (getattr(tf_variable(v), "distribute_strategy", None) for v in variables) if s is not None]
    target = next((s for s in [*owners, tf.distribute.get_strategy()] if s in _strategies), None)
    if target is None:
        return
    if keras_optimizer.optimizer_strategy(optimizer) is not target:
        raise ConfigError(
            f"optimizer {optimizer.name!r} was created outside the strategy's scope, but the model's "
            "variables belong to it. Create the optimizer (or pass its name, e.g. optimizer='adam', to "
            "model.compile) inside `with strategy.scope():`.")
    config = _strategies[target]
    if config is None or config.stage == 0:
        return
    _engines[optimizer] = ZeroEngine(optimizer, list(variables), config)
