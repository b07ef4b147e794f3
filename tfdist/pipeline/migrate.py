"""Moving a built model's variables, and the optimizer slots next to them, onto their stages' devices."""

from __future__ import annotations

from collections.abc import Iterable

import tensorflow as tf

from tfdist._compat import distribute as tf_distribute
from tfdist._compat import keras_model, keras_optimizer
from tfdist.errors import ConfigError
from tfdist.pipeline.layer_call import canonical_device
from tfdist.pipeline.plan import StagePlan

__all__ = ["move_model_variables"]


def move_model_variables(strategy: tf.distribute.Strategy, model, graph: list[tuple], plan: StagePlan,
                         optimizers: Iterable = ()) -> None:
    """Recreates every variable of `model` on its layer's stage device in each pipeline replica.

    Placing a variable is only possible when it is created, so each one is created again under
    `strategy.extended.creating_on(devices)` (a `tfdist._compat.distribute.PlacementExtended`) and
    swapped in behind its Keras variable. Slots of the model's optimizer, and of `optimizers` (e.g. one a
    custom training loop built before its first step), follow their variable, and each optimizer's
    variable index is rebuilt. Call it inside `strategy.scope()`.
    """
    moved: dict[int, list[str]] = {}  # id(old tf variable) -> devices it moved to
    done: set[int] = set()
    for layer, *_ in graph:
        devices = [row[plan.stage_of[layer.name]] for row in plan.devices]
        for kv in getattr(layer, "variables", ()):  # functional ops (x + y) have no variables
            if id(kv) not in done:
                done.add(id(kv))
                _move(strategy, kv, devices, moved)
    candidates = {id(o): o for o in (getattr(model, "optimizer", None), *optimizers) if o is not None}
    for optimizer in candidates.values():
        if not getattr(optimizer, "built", False):
            continue
        for kv in optimizer.variables:
            reference = strategy.extended.slot_reference(kv.value)
            if reference is not None and id(reference) in moved:
                _move(strategy, kv, moved[id(reference)], {})
        keras_optimizer.reindex(optimizer)


def _move(strategy, kv, devices: list[str], moved: dict) -> None:
    old = kv.value
    if tf_distribute.variable_strategy(old) is not strategy:
        raise ConfigError(f"variable {kv.path!r} was not created inside this strategy's scope(); build the "
                          "model (and compile it) inside `with strategy.scope():`.")
    if [canonical_device(v.device) for v in old.values] == [canonical_device(d) for d in devices]:
        return
    with strategy.extended.creating_on(devices):
        new = tf.Variable(old.values[0].read_value(), trainable=old.trainable, dtype=old.dtype,
                          name=old.name.split(":")[0], aggregation=old.aggregation,
                          synchronization=old.synchronization)
    moved[id(old)] = devices
    keras_model.swap_variable_value(kv, new)
