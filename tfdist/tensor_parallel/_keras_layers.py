"""Keras internals for tensor parallelism: a layer's own variable lists, per-instance methods, logical views.

A split layer keeps its Keras variables (`layer.kernel`: what `.keras` files, `tf.train.Checkpoint` and users
see, full logical shape) but their storage is a `LogicalView` over the shards; the shards themselves (one
Keras variable per "model"-axis device) take the logical variable's place in the layer's
`_trainable_variables` list, so gradients and the optimizer see the shards.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from tfdist._compat.keras_model import swap_variable_value
from tfdist._compat.tf_runtime import SavedTensor

__all__ = ["LogicalView", "attention_projections", "bind_method", "consumers", "model_output_layers",
           "optimizer_trainables", "override_checkpoint_children", "own_variables", "replace_variable",
           "set_logical_view", "set_mask", "tracked_list", "wrap_compute_attention"]


def own_variables(layer) -> list:
    """The layer's own variables (not its sublayers'), in the order Keras saves them."""
    return list(layer._trainable_variables) + list(layer._non_trainable_variables)


def replace_variable(layer, old, new: Sequence) -> None:
    """Puts the Keras variables `new` where `old` stands in the layer's variable lists."""
    for lst in (layer._trainable_variables, layer._non_trainable_variables):
        for i, v in enumerate(lst):
            if v is old:
                lst[i:i + 1] = list(new)
                return
    raise ValueError(f"{old.path} is not a variable of layer {layer.name}")


def set_mask(x, mask) -> None:
    """Attaches a Keras mask to an eager/graph tensor, as `ReversibleEmbedding.call` does itself (its
    `compute_mask` returns None, so Keras' own call wrapper sets none)."""
    from keras.src.backend import set_keras_mask  # after tfdist._compat's version check (imported above)

    set_keras_mask(x, mask)


def bind_method(obj, name: str, function: Callable) -> None:
    """`obj.name` becomes `function` bound to obj (this instance only, outside Keras' attribute tracking)."""
    object.__setattr__(obj, name, types.MethodType(function, obj))


class LogicalView(SavedTensor):
    """The full (logical) value of a split variable: reads concatenate the shards along `axis`, writes split.

    Stands behind the layer's original Keras variable: `.numpy()`, `assign`, `.keras` save/load and
    `tf.train.Checkpoint` (saved as one tensor of the full shape) go through it.

    A row across processes: `shards` are this process's, pieces `first`.. of `parts`, and `gather(local, axis)`
    (a collective every process of the row calls) gives the whole value; a write keeps this process's pieces.
    """

    def __init__(self, shards: Sequence, axis: int, shape: tuple, dtype, save_device: str, name: str = "logical",
                 gather: Callable | None = None, first: int = 0, parts: int | None = None):
        self.shards, self.axis = list(shards), axis
        self.gather, self.first, self.parts = gather, first, parts or len(self.shards)
        self._shared_name = name  # what Keras' Variable reports to tf.train.Checkpoint as its name
        self.shape = tf.TensorShape(shape)
        self.dtype = tf.as_dtype(dtype)
        self.save_device = save_device
        self.trainable = False

    def read(self) -> tf.Tensor:
        with tf.device(self.save_device):
            local = tf.concat([tf.convert_to_tensor(s.value) for s in self.shards], axis=self.axis)
            return local if self.gather is None else self.gather(local, self.axis)

    def write(self, value) -> None:
        value = tf.convert_to_tensor(value, dtype=self.dtype)
        if not value.shape.is_compatible_with(self.shape):
            raise ValueError(f"value of shape {value.shape} for a variable of shape {self.shape}")
        if not value.shape.is_fully_defined():  # a checkpoint restore reads it inside a graph
            value = tf.ensure_shape(value, self.shape)
        pieces = tf.split(value, self.parts, axis=self.axis)[self.first:self.first + len(self.shards)]
        for shard, part in zip(self.shards, pieces):
            shard.assign(part)

    # the parts of the tf.Variable interface Keras' Variable forwards to its backend value
    def assign(self, value, *args, **kwargs):
        self.write(value)
        return self

    def read_value(self) -> tf.Tensor:
        return self.read()

    def value(self) -> tf.Tensor:
        return self.read()

    def numpy(self) -> np.ndarray:
        return self.read().numpy()

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.numpy(), dtype=dtype)

    def __tf_tensor__(self, dtype=None, name=None):
        return tf.convert_to_tensor(self.read(), dtype=dtype, name=name)

    def __repr__(self) -> str:
        return f"<LogicalView shape={self.shape} over {len(self.shards)} shards (axis {self.axis})>"


def consumers(layer) -> list:
    """The operations (layers, or Keras ops of a functional model) that read `layer`'s symbolic outputs."""
    return [node.operation for node in layer._outbound_nodes]


def model_output_layers(model) -> list:
    """The layers whose outputs a functional (or Sequential) model returns."""
    return [t._keras_history.operation for t in tf.nest.flatten(getattr(model, "outputs", None) or [])]


def set_logical_view(keras_variable, view: LogicalView) -> None:
    """Makes a Keras variable's storage `view` (the full-size tf.Variable behind it is dropped)."""
    swap_variable_value(keras_variable, view)


def attention_projections(layer) -> tuple:
    """(query, key, value, output) EinsumDense sublayers of a built keras.layers.MultiHeadAttention."""
    return layer._query_dense, layer._key_dense, layer._value_dense, layer._output_dense


def wrap_compute_attention(layer, make: Callable[[Callable], Callable]) -> None:
    """Replaces this MultiHeadAttention instance's `_compute_attention` (the per-head attention between the
    projections) by `make(original)`; MultiHeadAttention.call looks it up on the instance."""
    original = layer._compute_attention
    object.__setattr__(layer, "_compute_attention", make(original))


def optimizer_trainables(optimizer) -> list:
    """The variables a built Keras optimizer was built on, in order."""
    return list(optimizer._trainable_variables)


def override_checkpoint_children(obj, children: Callable[[dict], dict]) -> None:
    """This instance's tf.train.Checkpoint dependencies become `children(stock dependencies)` (saving and
    restoring both look them up through `_trackable_children`)."""
    stock = type(obj)._trackable_children

    def trackable_children(self, save_type="checkpoint", **kwargs):
        found = stock(self, save_type, **kwargs)
        return children(dict(found)) if save_type == "checkpoint" else found

    object.__setattr__(obj, "_trackable_children", types.MethodType(trackable_children, obj))


def tracked_list(items: Sequence):
    """A list tf.train.Checkpoint saves element by element ("name/0", "name/1", ...), like Keras' own lists."""
    return tf.__internal__.tracking.wrap(list(items))
