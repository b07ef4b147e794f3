"""Keras optimizer internals: the build hook (active only inside a tfdist scope), variable index, gradient paths."""

from __future__ import annotations

import contextlib
import threading
import types
import weakref
from collections.abc import Callable, Iterator

import keras
import tensorflow as tf
from keras.src.optimizers import base_optimizer as _base_optimizer

__all__ = ["applying", "apply_weight_decay", "hook_instance_build", "iteration_counter", "keras_all_reduce_sum",
           "learning_rate_variable", "moving_averages", "optimizer_hooks", "optimizer_strategy",
           "override_apply_gradients", "override_check_finite", "override_sharded_state", "overwrite_with_average",
           "record_slot_creation", "reindex", "stock_apply_gradients", "stock_check_finite", "track_variable",
           "trained_variables", "update_variables", "uses_weight_decay", "variable_index"]

# --- The build hooks ----------------------------------------------------------------------------------
# Keras 3 gives a strategy no handle on an optimizer before it creates its slots. Every Keras
# optimizer's build() calls BaseOptimizer.build() (via super()) before it creates any slot, so a hook
# there can turn the optimizer into a sharded one in time. The hooks are installed on BaseOptimizer only
# while some tfdist strategy's scope (or run) is open, and the stock methods are put back when the last
# one closes: plain Keras outside tfdist scopes runs the untouched classes. An optimizer created while
# a scope is open can get the build hook on its own instance (`hook_instance_build`), so that a later
# `optimizer.build(...)` outside the scope is seen too.
_lock = threading.RLock()
_open: dict[tuple, int] = {}  # (on_build, on_create) -> number of open blocks that asked for them
_stock: dict[str, Callable] = {}


def _build_with_hooks(self, variables):
    for on_build, _ in list(_open):
        on_build(self, variables)
    return _stock["build"](self, variables)


_applying: list = []  # the optimizers inside apply() now, in any thread (see `applying`)


def applying() -> tuple:
    """The Keras optimizers whose apply() is running now, in any thread, while tfdist's hooks are open. A
    MirroredStrategy's replicas meet in a merge_call in the caller's thread, so this is process-wide: while it is
    not empty, every replica is inside apply, and a reduction they meet in is the gradients' (not, say, a
    synchronized BatchNormalization's sums, which the forward makes)."""
    with _lock:
        return tuple(_applying)


def _apply_with_hooks(self, grads, trainable_variables=None):
    # Custom training loops (TF's tutorial pattern) build the optimizer lazily, in its first
    # apply_gradients inside a tf.function. Its variables then come from the function's graph, and TF's
    # lifted initialisers under a MirroredStrategy fail at run time ("You must feed a value for placeholder
    # tensor 'cond/...'", keras#19246). Build it eagerly, in the strategy it was created under, instead.
    if not self.built and trainable_variables is not None and tf.inside_function():
        variables = list(trainable_variables)

        def build_eagerly(*_):
            strategy = optimizer_strategy(self)
            with tf.init_scope(), strategy.scope() if strategy is not None else contextlib.nullcontext():
                self.build(variables)

        replica = tf.distribute.get_replica_context()
        if replica is not None and tf.distribute.has_strategy():
            replica.merge_call(build_eagerly)  # once, in cross-replica context, while the replicas wait
        else:
            build_eagerly()
    with _applying_now(self):
        return _stock["apply"](self, grads, trainable_variables)


def _loss_scale_apply_with_hooks(self, grads, trainable_variables=None):
    # LossScaleOptimizer overrides apply(): counted too, so `applying()` shows that the step is loss-scaled
    with _applying_now(self):
        return _stock["loss_scale_apply"](self, grads, trainable_variables)


@contextlib.contextmanager
def _applying_now(optimizer) -> Iterator[None]:
    with _lock:
        _applying.append(optimizer)
    try:
        yield
    finally:
        with _lock:
            _applying.remove(optimizer)


def _init_with_hooks(self, *args, **kwargs):
    _stock["__init__"](self, *args, **kwargs)
    for _, on_create in list(_open):
        if on_create is not None:
            on_create(self)


@contextlib.contextmanager
def optimizer_hooks(on_build: Callable, on_create: Callable | None = None) -> Iterator[None]:
    """While open, `on_build(optimizer, variables)` runs at the start of every Keras optimizer's base
    build(), and `on_create(optimizer)` after every optimizer's base __init__(); an optimizer first applied
    inside a tf.function is built eagerly first (see `_apply_with_hooks`).

    Re-entrant and thread-safe (counted per pair of hooks). Keras classes are modified only while at
    least one such block is open; each hook runs once per call however many blocks asked for it.
    """
    base, loss_scale = _base_optimizer.BaseOptimizer, keras.optimizers.LossScaleOptimizer
    key = (on_build, on_create)
    with _lock:
        if not _open:
            _stock.update(build=base.__dict__["build"], __init__=base.__dict__["__init__"],
                          apply=base.__dict__["apply"], loss_scale_apply=loss_scale.__dict__["apply"])
            base.build, base.__init__, base.apply = _build_with_hooks, _init_with_hooks, _apply_with_hooks
            loss_scale.apply = _loss_scale_apply_with_hooks
        _open[key] = _open.get(key, 0) + 1
    try:
        yield
    finally:
        with _lock:
            _open[key] -= 1
            if not _open[key]:
                del _open[key]
            if not _open:
                base.build, base.__init__, base.apply = _stock.pop("build"), _stock.pop("__init__"), _stock.pop("apply")
                loss_scale.apply = _stock.pop("loss_scale_apply")


def hook_instance_build(optimizer, on_build: Callable) -> None:
    """Makes `optimizer.build(variables)` (this instance only) call `on_build(optimizer, variables)` first."""
    if _build_hooks.get(optimizer) is on_build:
        return

    def build(self, variables):
        on_build(self, variables)
        return type(self).build(self, variables)

    _bind(optimizer, "build", build)
    _build_hooks[optimizer] = on_build


# Which build hook an optimizer instance carries. Kept beside the instance, not on it: an attribute of our own
# would show in dir(optimizer) and make it differ from the same optimizer rebuilt from its config.
_build_hooks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# --- Reading an optimizer ------------------------------------------------------------------------------
def optimizer_strategy(optimizer) -> tf.distribute.Strategy | None:
    """The tf.distribute strategy a Keras TF optimizer captured when it was created."""
    return getattr(optimizer, "_distribution_strategy", None)


def variable_index(optimizer, variable) -> int:
    """Position of `variable` in the list the Keras optimizer was built with."""
    return optimizer._get_variable_index(variable)


def learning_rate_variable(optimizer):
    """The variable holding a constant learning rate (None with a schedule)."""
    return getattr(optimizer, "_learning_rate", None)


def reindex(optimizer) -> None:
    """Rebuilds a built Keras optimizer's variable index after the tf.Variables behind its variables
    were swapped: the TF backend keys trainable variables by the unique id of the tf.Variable."""
    if not getattr(optimizer, "built", False):
        return
    optimizer._trainable_variables_indices = {
        optimizer._var_key(v): i for i, v in enumerate(optimizer._trainable_variables)
    }


# --- Gradient path pieces --------------------------------------------------------------------------------
def keras_all_reduce_sum(optimizer, grads: list, tf_variables: list) -> list:
    """Keras' own gradient all-reduce (TFOptimizer._all_reduce_sum_gradients), in replica context, for
    gradients of `tf_variables` (the tf.Variables, not Keras variables).

    ZeRO-1 reduces exactly like stage 0 through this, so both see bit-identical gradients.
    """
    pairs = optimizer._all_reduce_sum_gradients(list(zip(grads, tf_variables)))
    return [g for g, _ in pairs]


def apply_weight_decay(optimizer, variables: list) -> None:
    """Keras' decoupled weight decay of the optimizer (honours exclude_from_weight_decay); replica context."""
    optimizer._apply_weight_decay(variables)


def update_variables(optimizer, strategy, grads_and_vars: list, learning_rate) -> None:
    """Keras' own update of each (reduced gradient, tf.Variable) pair through `strategy.extended.update`
    (TFOptimizer._distributed_tf_update_step); cross-replica context."""
    optimizer._distributed_tf_update_step(strategy, grads_and_vars, learning_rate)


def trained_variables(optimizer) -> list:
    """The variables the optimizer was built with, in its order (what its EMA averages follow)."""
    return list(optimizer._trainable_variables)


def moving_averages(optimizer) -> list:
    """The EMA "average" slots (`use_ema`), one per built variable (None where Keras keeps none)."""
    return list(optimizer._model_variables_moving_average)


def overwrite_with_average(optimizer) -> None:
    """Keras' copy of the EMA averages into the model's variables (TFOptimizer's version: one
    `extended.update` per variable, which needs no merge_call in cross-replica context)."""
    optimizer._overwrite_model_variables_with_average_value(optimizer._trainable_variables)


def uses_weight_decay(optimizer, variable) -> bool:
    """Whether Keras' decoupled weight decay applies to `variable` (exclude_from_weight_decay)."""
    return bool(optimizer._use_weight_decay(variable))


def iteration_counter(optimizer):
    """The variable counting every `apply` call (micro-steps under gradient accumulation, where the
    public `iterations` is this counter // gradient_accumulation_steps and not a variable)."""
    return optimizer._iterations


# --- Changing one optimizer instance ---------------------------------------------------------------------
def _bind(obj, name: str, function) -> None:
    # On this instance only, without Keras' attribute tracking.
    object.__setattr__(obj, name, types.MethodType(function, obj))


def override_sharded_state(optimizer, *, add_slot: Callable, apply_gradients: Callable,
                           load_own_variables: Callable, overwrite_with_average: Callable) -> None:
    """Makes this one optimizer instance keep its state elsewhere: slots come from
    `add_slot(optimizer, reference_variable, name=None, initializer="zeros")`, gradients (unscaled,
    None filtered; Keras' `_backend_apply_gradients`, which also runs accumulation and EMA) go to
    `apply_gradients(optimizer, grads, variables)`, `.keras` loading goes through
    `load_own_variables(optimizer, store)` and writing the EMA into the model (end of `fit`) through
    `overwrite_with_average(optimizer, variables)`."""
    _bind(optimizer, "add_variable_from_reference", add_slot)
    _bind(optimizer, "_backend_apply_gradients", apply_gradients)
    _bind(optimizer, "load_own_variables", load_own_variables)
    _bind(optimizer, "_overwrite_model_variables_with_average_value", overwrite_with_average)


def override_apply_gradients(optimizer, apply_gradients: Callable) -> None:
    """Makes this one optimizer instance send its gradients (unscaled, None filtered; Keras'
    `_backend_apply_gradients`: clipping, decay, the update, accumulation and EMA) to
    `apply_gradients(optimizer, grads, variables)`; `stock_apply_gradients` still runs Keras' own."""
    _bind(optimizer, "_backend_apply_gradients", apply_gradients)


def override_check_finite(optimizer, check_finite: Callable) -> None:
    """Makes this one LossScaleOptimizer decide whether a step's gradients are finite with
    `check_finite(optimizer, grads)`; `stock_check_finite` still runs Keras' own."""
    _bind(optimizer, "check_finite", check_finite)


def stock_check_finite(optimizer, grads: list):
    """Keras' own `LossScaleOptimizer.check_finite` of the optimizer's class: whether `grads` are all finite."""
    return type(optimizer).check_finite(optimizer, grads)


def stock_apply_gradients(optimizer, grads: list, variables: list) -> None:
    """Keras' own `_backend_apply_gradients` of the optimizer's class (whatever the instance overrides)."""
    type(optimizer)._backend_apply_gradients(optimizer, grads, variables)


def track_variable(optimizer, variable) -> None:
    """Adds `variable` to `optimizer.variables` (what saving and loading iterate)."""
    optimizer._track_variable(variable)


def record_slot_creation(optimizer, created: dict, device_of: Callable | None = None) -> None:
    """Records every slot this optimizer instance creates: created[(id(reference), name)] = slot.

    With `device_of(reference) -> device`, each slot is created on that device instead of next to its
    reference variable: TFOptimizer.add_variable_from_reference colocates with the reference (an eager
    device scope that would win over ours), so the base class's version runs under our device. Only for an
    optimizer used outside any strategy (ZeRO's shard optimizers), where that colocation is all it adds."""
    original = optimizer.add_variable_from_reference

    def record(ref, name=None, initializer="zeros"):
        if device_of is None:
            var = original(ref, name=name, initializer=initializer)
        else:
            with tf.device(device_of(ref)):
                var = _base_optimizer.BaseOptimizer.add_variable_from_reference(
                    optimizer, ref, name=name, initializer=initializer)
        created[(id(ref), name)] = var
        return var

    object.__setattr__(optimizer, "add_variable_from_reference", record)
