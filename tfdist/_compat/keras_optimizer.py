"""Keras optimizer internals: the build hook (active only inside a tfdist scope), variable index, gradient paths."""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Callable, Iterator

import tensorflow as tf
from keras.src.optimizers import base_optimizer as _base_optimizer

__all__ = ["apply_weight_decay", "build_hook", "keras_all_reduce_sum", "learning_rate_variable", "optimizer_strategy",
           "override_sharded_state", "record_slot_creation", "reindex", "track_variable", "variable_index"]

# --- The build hook ----------------------------------------------------------------------------------
# Keras 3 gives a strategy no handle on an optimizer before it creates its slots. Every Keras
# optimizer's build() calls BaseOptimizer.build() (via super()) before it creates any slot, so a hook
# there can turn the optimizer into a sharded one in time. The hook is installed on BaseOptimizer only
# while some tfdist strategy's scope (or run) is active, and the stock method is put back when the last
# one closes: plain Keras outside tfdist scopes runs the untouched class.
_lock = threading.RLock()
_active: dict[Callable, int] = {}  # hook -> number of open scopes that asked for it
_stock_build: Callable | None = None


def _build_with_hooks(self, variables):
    for hook in list(_active):
        hook(self, variables)
    return _stock_build(self, variables)


@contextlib.contextmanager
def build_hook(hook: Callable) -> Iterator[None]:
    """While open, `hook(optimizer, variables)` runs at the start of every Keras optimizer's base build().

    Re-entrant and thread-safe (counted per hook). Keras classes are modified only while at least
    one such block is open; each hook runs once per build however many blocks asked for it.
    """
    global _stock_build
    base = _base_optimizer.BaseOptimizer
    with _lock:
        if not _active:
            _stock_build = base.__dict__["build"]
            base.build = _build_with_hooks
        _active[hook] = _active.get(hook, 0) + 1
    try:
        yield
    finally:
        with _lock:
            _active[hook] -= 1
            if not _active[hook]:
                del _active[hook]
            if not _active:
                base.build = _stock_build
                _stock_build = None


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
def keras_all_reduce_sum(optimizer, grads: list, variables: list) -> list:
    """Keras' own gradient all-reduce (TFOptimizer._all_reduce_sum_gradients), in replica context.

    ZeRO-1 reduces exactly like stage 0 through this, so both see bit-identical gradients.
    """
    pairs = optimizer._all_reduce_sum_gradients(list(zip(grads, [getattr(v, "value", v) for v in variables])))
    return [g for g, _ in pairs]


def apply_weight_decay(optimizer, variables: list) -> None:
    """Keras' decoupled weight decay of the optimizer (honours exclude_from_weight_decay)."""
    optimizer._apply_weight_decay(variables)


# --- Changing one optimizer instance ---------------------------------------------------------------------
def _bind(obj, name: str, function) -> None:
    # On this instance only, without Keras' attribute tracking.
    object.__setattr__(obj, name, types.MethodType(function, obj))


def override_sharded_state(optimizer, *, add_slot: Callable, apply_gradients: Callable,
                           load_own_variables: Callable) -> None:
    """Makes this one optimizer instance keep its state elsewhere: slots come from
    `add_slot(optimizer, reference_variable, name=None, initializer="zeros")`, gradients (unscaled,
    None filtered; Keras' `_backend_apply_gradients`) go to `apply_gradients(optimizer, grads, variables)`
    and `.keras` loading goes through `load_own_variables(optimizer, store)`."""
    _bind(optimizer, "add_variable_from_reference", add_slot)
    _bind(optimizer, "_backend_apply_gradients", apply_gradients)
    _bind(optimizer, "load_own_variables", load_own_variables)


def track_variable(optimizer, variable) -> None:
    """Adds `variable` to `optimizer.variables` (what saving and loading iterate)."""
    optimizer._track_variable(variable)


def record_slot_creation(optimizer, created: dict) -> None:
    """Records every slot this optimizer instance creates: created[(id(reference), name)] = slot."""
    original = optimizer.add_variable_from_reference

    def record(ref, name=None, initializer="zeros"):
        var = original(ref, name=name, initializer=initializer)
        created[(id(ref), name)] = var
        return var

    object.__setattr__(optimizer, "add_variable_from_reference", record)
