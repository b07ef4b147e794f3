"""Every reach into TensorFlow and Keras private internals, in one place, behind a version check."""

from __future__ import annotations

import itertools
import warnings

import keras
import tensorflow as tf

# Versions this module was written and tested against. A TF or Keras upgrade should only have to
# revisit this file: every `tensorflow.python.*` / `keras.src.*` import in tfdist lives here.
TESTED_TF = ("2.21",)
TESTED_KERAS_MAJOR = 3


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


if _major_minor(tf.__version__) not in TESTED_TF:
    warnings.warn(
        f"tfdist was tested with TensorFlow {', '.join(TESTED_TF)}; found {tf.__version__}. "
        "Private TF internals used by tfdist (tfdist/compat.py) may have moved.",
        RuntimeWarning,
        stacklevel=2,
    )
if int(keras.__version__.split(".")[0]) != TESTED_KERAS_MAJOR:
    raise ImportError(
        f"tfdist needs Keras 3 (the default tf.keras of TF 2.16+); found keras {keras.__version__}. "
        "Install it with: pip install 'keras>=3.15'"
    )


# --- Collective keys -------------------------------------------------------------------------
# MirroredExtended numbers its collective groups from `container_strategy._collective_key_base`.
# Every stock MirroredStrategy starts at 0, so two strategies over different device sets in one
# process join the same group and fail ("joining a group with size 2, but that group has size 4").
# Giving each tfdist strategy its own base keeps them apart (TF's own tests do the same).
_KEY_STRIDE = 100_000
_key_bases = itertools.count(start=_KEY_STRIDE, step=_KEY_STRIDE)


def fresh_collective_key_base() -> int:
    """Returns a collective key base no other tfdist strategy in this process uses."""
    return next(_key_bases)


# --- Layer placement (tfdist/placement, tfdist/strategies/layer_placement.py) ----------------
# Model parallelism needs a few things Keras 3 and tf.distribute keep private: the layer graph of
# a functional model, swapping the tf.Variable behind a Keras variable (placing a variable is only
# possible when it is created), the mirrored-strategy internals a placement-aware strategy extends,
# and TF's executed-graph and profiler records that prove where ops ran.


def mirrored_extended_class():
    """TF's `MirroredExtended`, the StrategyExtended of MirroredStrategy, for subclassing."""
    from tensorflow.python.distribute.mirrored_strategy import MirroredExtended

    return MirroredExtended


def init_strategy(strategy: tf.distribute.Strategy, extended) -> None:
    """Runs the base `tf.distribute.Strategy.__init__` with a custom `extended` (what
    MirroredStrategy.__init__ does after building its own MirroredExtended)."""
    from tensorflow.python.distribute import distribute_lib

    distribute_lib.Strategy.__init__(strategy, extended)


class DeviceGroup:
    """Stands in for a mirrored variable as `colocate_with` of MirroredExtended._create_variable,
    which reads only `._devices`: the new variable gets one component per listed device."""

    def __init__(self, devices):
        self._devices = tuple(devices)


def model_graph(model) -> list[tuple]:
    """The layer graph of a built Keras model, in topological order.

    Returns (layer, parent_layers, input_shapes, output_shapes) per layer (InputLayers left out);
    shapes include the batch dimension (None). Sequential models are read through the functional
    model Keras builds inside them. A layer called twice lists the parents and shapes of all calls.
    """
    graph = getattr(model, "_functional", None) or model
    if not hasattr(graph, "_operations") or not hasattr(graph, "_nodes"):
        raise TypeError(f"{type(model).__name__} has no layer graph: build it with keras.Input "
                        "(Sequential or functional API) before placing it")
    from keras.src.ops.function import make_node_key

    input_layer = keras.layers.InputLayer
    out = []
    for op in graph._operations:
        if isinstance(op, input_layer):
            continue
        parents, in_shapes, out_shapes = [], [], []
        for i, node in enumerate(op._inbound_nodes):
            if make_node_key(op, i) not in graph._nodes:  # a call from another model
                continue
            for kt in node.arguments.keras_tensors:
                parent = kt._keras_history.operation
                in_shapes.append(tuple(kt.shape))
                if parent is not None and not isinstance(parent, input_layer) and parent not in parents:
                    parents.append(parent)
            out_shapes.extend(tuple(t.shape) for t in node.outputs)
        out.append((op, parents, in_shapes, out_shapes))
    return out


def swap_variable_value(keras_variable, new_tf_variable) -> None:
    """Makes a Keras variable use `new_tf_variable` (same shape/dtype) from now on.

    Keras 3 keeps the backend variable in `_value`; everything else (path, trainable, the
    optimizer's slot lists, .keras save/load) goes through the Keras variable object."""
    keras_variable._value = new_tf_variable


def reindex_optimizer(optimizer) -> None:
    """Rebuilds a built Keras optimizer's variable index after variables were swapped.

    The TF backend keys trainable variables by the unique id of the tf.Variable behind them
    (TFOptimizer._var_key), so swapped variables must be re-registered."""
    if not getattr(optimizer, "built", False):
        return
    optimizer._trainable_variables_indices = {
        optimizer._var_key(v): i for i, v in enumerate(optimizer._trainable_variables)
    }


def keras_model_of_step(fn, _depth: int = 0):
    """The Keras model whose step `fn` is, or None.

    Keras' TF trainer calls `strategy.run(self.train_step, ...)` (a bound method) for fit and
    evaluate, and `strategy.run(one_step_on_data, ...)` (a closure over the model, possibly a
    tf.function or wrapped) for predict. The strategy uses this to find the model on its first
    step and place it before any of its variables is read."""
    import inspect

    if fn is None or _depth > 4:
        return None
    fn = getattr(fn, "python_function", fn)  # tf.function
    try:
        fn = inspect.unwrap(fn)
    except ValueError:
        return None
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, keras.Model):
        return owner
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # empty cell
            continue
        if isinstance(value, keras.Model):
            return value
        if callable(value) and not isinstance(value, type):
            found = keras_model_of_step(value, _depth + 1)
            if found is not None:
                return found
    return None


def dataset_batch_size(dataset) -> int | None:
    """The batch size a tf.data pipeline was batched with: a `.batch(n)` with a constant n found
    walking its input datasets (through zips too), or a static batch dimension; None otherwise.

    Keras' own NumPy-array pipelines slice batches by index and show no batch size."""
    for spec in tf.nest.flatten(getattr(dataset, "element_spec", None)):
        shape = getattr(spec, "shape", None)
        if shape is not None and shape.rank and shape[0] is not None:
            return int(shape[0])
    stack, seen = [dataset], 0
    while stack and seen < 64:
        current = stack.pop()
        seen += 1
        size = getattr(current, "_batch_size", None)
        if size is not None:
            value = tf.get_static_value(size)
            return int(value) if value is not None else None
        stack.extend(d for d in [getattr(current, "_input_dataset", None), *tf.nest.flatten(getattr(current, "_datasets", ()))]
                     if d is not None)
    return None


def executed_partition_devices(fn) -> dict[str, set[str]]:
    """Runs `fn()` once with TF's run-metadata collection on, and returns node name -> devices of
    every node in the partition graphs TF actually executed (after placement; a name used in
    several functions can map to several devices).

    Only functions instantiated while collecting are reported: call it on the first run of a
    tf.function (or after its first trace)."""
    from tensorflow.python.eager import context

    context.enable_run_metadata()
    try:
        fn()
        metadata = context.export_run_metadata()
    finally:
        context.disable_run_metadata()
    devices: dict[str, set[str]] = {}
    for graphs in metadata.function_graphs:
        for partition in graphs.partition_graphs:
            for node in partition.node:
                devices.setdefault(node.name, set()).add(node.device)
    return devices


def xspace_proto():
    """The XSpace protobuf class TF's profiler writes (*.xplane.pb)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    return xplane_pb2.XSpace


def variable_strategy(variable):
    """The tf.distribute strategy a (distributed) variable was created in, or None."""
    return getattr(variable, "_distribute_strategy", None)
