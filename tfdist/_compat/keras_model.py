"""Keras model and variable internals: layer graph, initial epoch, the model of a step, backend variables."""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator

import keras
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer as _TFTrainer
from keras.src.ops.function import make_node_key as _make_node_key

__all__ = ["all_layers", "initial_epoch", "layer_graph", "model_hooks", "model_of_step", "set_initial_epoch", "strategy_of",
           "swap_variable_value", "using_strategy"]


def initial_epoch(model) -> int:
    """The epoch `fit` starts from: Keras' BackupAndRestore sets the private `model._initial_epoch`
    when it restores a checkpoint (keras/src/callbacks/backup_and_restore.py, `_load_model`)."""
    return int(getattr(model, "_initial_epoch", 0) or 0)


def set_initial_epoch(model: keras.Model, epoch: int) -> None:
    """Makes the next `fit` start at `epoch` (what keras.callbacks.BackupAndRestore does on restore)."""
    model._initial_epoch = epoch


def layer_graph(model) -> list[tuple]:
    """The layer graph of a built Keras model, in topological order.

    Returns (layer, parent_layers, input_shapes, output_shapes) per layer (InputLayers left out);
    shapes include the batch dimension (None). Sequential models are read through the functional
    model Keras builds inside them. A layer called twice lists the parents and shapes of all calls.
    """
    graph = getattr(model, "_functional", None) or model
    if not hasattr(graph, "_operations") or not hasattr(graph, "_nodes"):
        raise TypeError(f"{type(model).__name__} has no layer graph: build it with keras.Input "
                        "(Sequential or functional API) before placing it")
    input_layer = keras.layers.InputLayer
    out = []
    for op in graph._operations:
        if isinstance(op, input_layer):
            continue
        parents, in_shapes, out_shapes = [], [], []
        for i, node in enumerate(op._inbound_nodes):
            if _make_node_key(op, i) not in graph._nodes:  # a call from another model
                continue
            for kt in node.arguments.keras_tensors:
                parent = kt._keras_history.operation
                in_shapes.append(tuple(kt.shape))
                if parent is not None and not isinstance(parent, input_layer) and parent not in parents:
                    parents.append(parent)
            out_shapes.extend(tuple(t.shape) for t in node.outputs)
        out.append((op, parents, in_shapes, out_shapes))
    return out


def all_layers(model) -> list:
    """Every layer inside `model` (nested models and layers of layers, any depth), not the model itself:
    Keras' `Layer._flatten_layers` (keras/src/layers/layer.py); `model.layers` lists the top level only."""
    return list(model._flatten_layers(include_self=False, recursive=True))


def swap_variable_value(keras_variable, new_tf_variable) -> None:
    """Makes a Keras variable use `new_tf_variable` (same shape/dtype) from now on.

    Keras 3 keeps the backend variable in `_value`; everything else (path, trainable, the
    optimizer's slot lists, .keras save/load) goes through the Keras variable object."""
    keras_variable._value = new_tf_variable


def _cell_values(fn) -> list:
    values = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # empty cell
            continue
    return values


def model_of_step(fn):
    """The Keras model whose step `fn` is, or None.

    Keras' TF trainer calls `strategy.run(self.train_step, ...)` (a bound method) for fit and
    evaluate, and `strategy.run(one_step_on_data, ...)` (a closure over the model, possibly a
    tf.function or wrapped) for predict. The placement strategy uses this to find the model on its
    first step and place it before any of its variables is read."""
    return next(step_objects(fn, keras.Model), None)


def step_objects(fn, kind: type) -> Iterator:
    """The objects of type `kind` that the step `fn` uses, nearest first (lazily, each once): the object a
    bound method belongs to, its closure cells (following the functions among them a few levels deep),
    then the module-level names it reads (TF's custom-loop tutorial keeps `model` and `optimizer` global)."""
    seen: set[int] = set()
    for obj in _step_objects(fn, kind, 0):
        if id(obj) not in seen:
            seen.add(id(obj))
            yield obj


def _step_objects(fn, kind: type, depth: int) -> Iterator:
    if fn is None or depth > 4:
        return
    fn = getattr(fn, "python_function", fn)  # tf.function
    try:
        fn = inspect.unwrap(fn)
    except ValueError:
        return
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, kind):
        yield owner
    for value in _cell_values(fn):
        if isinstance(value, kind):
            yield value
        elif callable(value) and not isinstance(value, (type, keras.Model)):
            yield from _step_objects(value, kind, depth + 1)
    names = getattr(getattr(fn, "__code__", None), "co_names", ())
    module = getattr(fn, "__globals__", {})
    yield from (module[n] for n in names if isinstance(module.get(n), kind))


# --- Models created inside a scope -----------------------------------------------------------------------
# A strategy that changes how `fit` runs (the parameter-server strategy) must meet each model built in
# its scope. Every Keras model on the TF backend runs TensorFlowTrainer.__init__, which records the
# strategy in scope; a hook after it sees the model. Installed only while such a scope is open.
_hook_lock = threading.RLock()
_model_hooks: dict[Callable, int] = {}
_stock_trainer_init: list[Callable] = []


def _trainer_init_with_hooks(self, *args, **kwargs):
    _stock_trainer_init[0](self, *args, **kwargs)
    for on_create in list(_model_hooks):
        on_create(self)


@contextlib.contextmanager
def model_hooks(on_create: Callable[[keras.Model], None]) -> Iterator[None]:
    """While open, `on_create(model)` runs after every Keras model's trainer __init__ (re-entrant,
    counted per hook; the stock class comes back when the last block closes)."""
    with _hook_lock:
        if not _model_hooks:
            _stock_trainer_init.append(_TFTrainer.__dict__["__init__"])
            _TFTrainer.__init__ = _trainer_init_with_hooks
        _model_hooks[on_create] = _model_hooks.get(on_create, 0) + 1
    try:
        yield
    finally:
        with _hook_lock:
            _model_hooks[on_create] -= 1
            if not _model_hooks[on_create]:
                del _model_hooks[on_create]
            if not _model_hooks:
                _TFTrainer.__init__ = _stock_trainer_init.pop()


def strategy_of(model) -> object | None:
    """The tf.distribute strategy the model was created under (None: the default one)."""
    return getattr(model, "_distribute_strategy", None)


@contextlib.contextmanager
def using_strategy(model, strategy) -> Iterator[None]:
    """Makes Keras run `model`'s fit/evaluate/predict under `strategy` (None: the default strategy)
    for the duration of the block: Keras reads the strategy a model was created under from
    `model._distribute_strategy`."""
    saved = model._distribute_strategy
    model._distribute_strategy = strategy
    try:
        yield
    finally:
        model._distribute_strategy = saved
