"""Embedding lookups that read only the looked-up rows of a table sharded over parameter servers.

Keras' `Embedding.call` is `ops.take(self.embeddings, ids)`, which converts the table to one tensor:
for a table split over parameter servers (a ShardedVariable) that concatenates every shard on the
worker, each step. `attach(model)` gives each Embedding layer of one model (that instance only) a
`call` that, when the layer's table is sharded, looks rows up shard by shard instead:
`tf.nn.embedding_lookup` on the list of shards ("div" row ranges, as TensorFlow's parameter-server
strategy splits variables) partitions the ids on the worker, gathers each shard's rows on the shard's
own server (the gather is colocated with the shard) and stitches the rows back in order. Only the rows
travel; the gradient of each shard is an IndexedSlices of its rows.

Keras semantics are kept: ids of another dtype are cast to int32, negative ids count from the end (as
`ops.take` does), the output has the layer's compute dtype, and `mask_zero` is untouched (it lives in
`compute_mask`); ragged and sparse ids work as with `ops.take`. A layer whose table is not sharded, or
that is quantized or has LoRA enabled, runs Keras' own `call`.

Why here, in `training`: which rows live where is the parameter servers' business (the strategy shards
the variables); this module only changes how one model reads them, and the ParameterServerStrategy
attaches it (tfdist.parameter_server.coordinated, `attach_on_call`) to every model created in its scope.
"""

from __future__ import annotations

import functools
import weakref

import keras
import tensorflow as tf

from tfdist._compat import keras_model
from tfdist.parameter_server._tf_sharded import sharded_value

__all__ = ["attach", "attach_on_call", "lookup", "sharded_table"]

_stock_calls: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> its own bound `call`
_watched: weakref.WeakSet = weakref.WeakSet()  # models whose `call` attaches their layers first


def lookup(table, ids: tf.Tensor | tf.RaggedTensor | tf.SparseTensor) -> tf.Tensor | tf.RaggedTensor:
    """Rows `ids` of `table` (a ShardedVariable), gathered shard by shard on the shards' servers.
    Negative ids count from the end, as in `keras.ops.take`; SparseTensor ids give what `ops.take` gives
    for them (`safe_embedding_lookup_sparse`, missing entries as row 0)."""
    rows = int(table.shape[0])
    shards = list(table.variables)  # the list, not the container: eagerly, TF's ShardedVariable dispatch
    #                                  converts the container to one tensor first (sharded_variable.py)

    def gather(flat_ids):
        flat_ids = tf.where(flat_ids < 0, flat_ids + tf.cast(rows, flat_ids.dtype), flat_ids)
        return tf.nn.embedding_lookup(shards, flat_ids)

    if isinstance(ids, tf.RaggedTensor):
        return tf.ragged.map_flat_values(gather, ids)
    if isinstance(ids, tf.SparseTensor):
        values = ids.values
        ids = tf.SparseTensor(ids.indices, tf.where(values < 0, values + tf.cast(rows, values.dtype), values),
                              ids.dense_shape)
        out = tf.nn.safe_embedding_lookup_sparse(shards, tf.sparse.expand_dims(ids, axis=-1), default_id=0)
        out.set_shape(ids.shape + out.shape[len(ids.shape):])
        return out
    return gather(ids)


def sharded_table(layer: keras.layers.Embedding):
    """The layer's table as a ShardedVariable (one tf.Variable per server, in `.variables`), or None when it
    is not sharded, not built yet, quantized or has LoRA enabled (then Keras' own lookup runs)."""
    if not layer.built or layer.quantization_mode or layer.lora_enabled:
        return None
    return sharded_value(layer.embeddings)


def _sharded_call(layer: keras.layers.Embedding, stock):
    @functools.wraps(stock)
    def call(inputs, *args, **kwargs):
        table = sharded_table(layer)
        if table is None or args or kwargs or isinstance(inputs, keras.KerasTensor):
            return stock(inputs, *args, **kwargs)
        if tf.as_dtype(inputs.dtype) not in (tf.int32, tf.int64):
            inputs = tf.cast(inputs, tf.int32)
        return tf.cast(lookup(table, inputs), layer.compute_dtype)

    return call


def attach(model: keras.layers.Layer) -> int:
    """Gives every Embedding layer inside `model` (a model or a layer, itself included; those instances
    only) the sharded lookup; idempotent. Returns how many layers have it."""
    count = 0
    for layer in [model, *keras_model.all_layers(model)]:
        if not isinstance(layer, keras.layers.Embedding):
            continue
        if layer not in _stock_calls:
            _stock_calls[layer] = layer.call
            layer.call = _sharded_call(layer, layer.call)
        count += 1
    return count


def attach_on_call(model: keras.Model) -> None:
    """Makes `model` (that instance) run `attach(model)` at the start of every call, so its Embedding layers
    have the sharded lookup before they run. The strategy does this when it meets a model being created,
    before the model has layers (Keras' trainer __init__ runs before Layer.__init__, and Sequential and
    functional models add their layers after it); `attach` itself is idempotent and cheap."""
    if model in _watched:
        return
    stock = model.call

    @functools.wraps(stock)
    def call(*args, **kwargs):
        attach(model)
        return stock(*args, **kwargs)

    object.__setattr__(model, "call", call)  # Layer.__setattr__ needs Layer.__init__, not run yet
    _watched.add(model)
