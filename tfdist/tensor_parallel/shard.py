"""Splitting a built Keras model's variables by a LayoutMap: one shard variable per "model"-axis device."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfdist._compat import keras_model
from tfdist.errors import ConfigError
from tfdist.tensor_parallel import _keras_layers as tp_compat
from tfdist.tensor_parallel.einsum import fuse_projections
from tfdist.tensor_parallel.layers import split_layer_call
from tfdist.tensor_parallel.layout_map import LayoutMap
from tfdist.tensor_parallel.optimizer_state import first_copy_device, keep_logical_optimizer_saving
from tfdist.tensor_parallel.passing import pass_shards_through, split_attention
from tfdist.tensor_parallel.rules import layer_kind, split_axis
from tfdist.tensor_parallel.span import RowSpan, gather_lazily, gather_value, row_size, span_of

__all__ = ["ShardPlan", "SplitLayer", "keep_logical_optimizer_saving", "places_itself", "shard_model"]


@dataclasses.dataclass
class SplitLayer:
    """One split layer: how (`kind`), and its shard variables per role ("kernel", "bias", "embeddings")."""

    name: str
    kind: str
    shards: dict[str, list]
    logical: dict[str, object]


# Per-feature layers that keep a split activation split (see tensor_parallel_passing.pass_shards_through).
_PER_FEATURE = (keras.layers.MaxPooling1D, keras.layers.MaxPooling2D, keras.layers.MaxPooling3D,
                keras.layers.AveragePooling1D, keras.layers.AveragePooling2D, keras.layers.AveragePooling3D,
                keras.layers.Activation, keras.layers.ReLU, keras.layers.LeakyReLU, keras.layers.ELU)
_passing: weakref.WeakSet = weakref.WeakSet()

# Every layer split so far, and every MultiHeadAttention whose heads were split (split once, whatever model asks).
_split_layers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_attention_split: weakref.WeakSet = weakref.WeakSet()


@dataclasses.dataclass
class ShardPlan:
    """What `shard_model` did: the split layers, the mesh rows, and bytes of variables per device."""

    model_name: str
    grid: list[list[str]]
    layers: list[SplitLayer]
    bytes_per_device: dict[str, int]
    replicated_bytes: int  # what each device would hold with every variable replicated
    span: RowSpan | None = None  # a row across processes: this process's part of it (grid: its own devices)

    def __str__(self) -> str:
        lines = [f"model {self.model_name!r}: {len(self.layers)} split layer(s) over rows {self.grid}"]
        for split in self.layers:
            shapes = {role: [tuple(v.shape) for v in vs] for role, vs in split.shards.items()}
            lines.append(f"  {split.name}: {split.kind} {shapes}")
        for device, size in self.bytes_per_device.items():
            lines.append(f"  {device}: {size:,} B of variables ({size / max(self.replicated_bytes, 1):.1%} of "
                         "replicated)")
        return "\n".join(lines)


def shard_model(strategy: tf.distribute.Strategy, model: keras.Model, layout_map: LayoutMap,
                grid: Sequence[Sequence[str]], model_axis: str, batch_axis: str,
                devices_for_replica: Callable[[], Sequence[str]],
                groups: Callable[[keras.layers.Layer], tuple[list[list[str]], Callable[[], Sequence[str]]]]
                | None = None) -> ShardPlan:
    """Splits every variable `layout_map` assigns to `model_axis` into len(grid[0]) shards, shard k mirrored over
    grid[r][k] for every row r; swaps the shards in for the logical variables (which then read as the shards'
    concatenation) and makes the split layers compute from them. Call inside `strategy.scope()`, eagerly.

    `groups(layer)`, if given, overrides (grid, devices_for_replica) per layer: a pipeline stage's layers shard
    over that stage's model-axis group (`grid` then only lists every device, for the byte counts)."""
    def group_of(layer):
        return groups(layer) if groups is not None else (grid, devices_for_replica)

    everything = keras_model.all_layers(model)
    # Layers another model (a Sequential's inner functional model, a shared sub-model) already split stay so.
    done = [_split_layers[layer] for layer in everything if layer in _split_layers]
    layers = [layer for layer in everything if tp_compat.own_variables(layer) and layer not in _split_layers]
    owned = [(layer, kv) for layer in layers for kv in tp_compat.own_variables(layer)]
    layouts = layout_map.resolve([(kv.path, tuple(kv.shape)) for _, kv in owned], model_name=model.name)
    for path, layout in layouts.items():
        if batch_axis in layout:
            raise ConfigError(f"LayoutMap splits variable {path!r} over the batch axis {batch_axis!r} ({layout}); "
                              "variables can be split over the model axis only (data-parallel rows hold whole "
                              "copies). Use tfdist.zero (ZeRO) to split optimizer state over the batch axis.")
        other = [a for a in layout if a not in (None, model_axis)]
        if other:
            raise ConfigError(f"LayoutMap splits variable {path!r} over the axis {other[0]!r} ({layout}); variables "
                              f"can be split over the model axis {model_axis!r} only (a pipeline stage holds its "
                              "layers' variables whole or split over its model-axis group).")
    # devices per model-axis group (a row across processes: the whole row's, this process holding some of them)
    parts = row_size(group_of(everything[0])[0][0]) if everything else row_size(grid[0])
    plan_layers: list[SplitLayer] = list(done)
    for layer in layers:
        roles = {_role(layer, kv): kv for kv in tp_compat.own_variables(layer)}
        axes = {role: split_axis(layouts.get(kv.path), model_axis) for role, kv in roles.items()}
        kind, reason = layer_kind(layer, axes)
        if reason:
            raise ConfigError(f"LayoutMap for layer {layer.name!r}: {reason}; layouts given: "
                              f"{ {kv.path: layouts.get(kv.path) for kv in roles.values()} }.")
        if kind is None or parts == 1:
            continue
        if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
            raise ConfigError(f"layer {layer.name!r} uses LoRA or quantization, which cannot be split yet.")
        logical_order = tp_compat.own_variables(layer)
        shards = {}
        for role, kv in roles.items():
            axis = axes[role]
            if axis is None:
                continue
            shards[role] = _make_shards(strategy, layer, kv, axis, group_of(layer)[0])
        plan_layers.append(SplitLayer(layer.name, kind, shards, dict(roles)))
        _split_layers[layer] = plan_layers[-1]
        _keep_logical_saving(layer, logical_order)
        split_layer_call(layer, kind, shards, group_of(layer)[1], kernel_axis=axes.get("kernel"))
    for layer in everything:
        if isinstance(layer, _PER_FEATURE) and parts > 1 and layer not in _passing and _channels_last(layer):
            _passing.add(layer)
            pass_shards_through(layer, group_of(layer)[1])
    split_kinds = {id(layer): _split_layers[layer] for layer in everything if layer in _split_layers}
    for layer in everything:
        if isinstance(layer, keras.layers.MultiHeadAttention) and parts > 1 and layer not in _attention_split:
            query, key, value, _ = tp_compat.attention_projections(layer)
            if all(_splits_heads(split_kinds.get(id(p))) for p in (query, key, value)):
                _attention_split.add(layer)
                split_attention(layer, group_of(layer)[1])
                fuse_projections([(p, split_kinds[id(p)].shards) for p in (query, key, value)])
    span = span_of(grid[0])
    if span is not None:
        _gather_only_where_read(model, everything)
    _keep_logical_weights([model, *everything], plan_layers)
    return ShardPlan(model.name, [list(r) for r in grid], plan_layers, *_bytes(model, grid), span=span)


_ROW_KINDS = ("row", "einsum_row", "conv_row")


def _gather_only_where_read(model, everything) -> None:
    """Across processes a gather is a collective, which TF cannot prune: a split output that only row-parallel
    layers read (directly or through per-feature layers; an attention's heads read by its split output
    projection) is left ungathered (`gather_lazily`). Anything else reading it (another layer, a Keras op,
    the model's output) keeps the gather."""
    outputs = {id(layer) for layer in tp_compat.model_output_layers(model)}

    def only_shards_read(layer) -> bool:
        found = tp_compat.consumers(layer)
        if id(layer) in outputs or not found:
            return False
        for consumer in found:
            split = _split_layers.get(consumer) if isinstance(consumer, keras.layers.Layer) else None
            if split is not None and split.kind in _ROW_KINDS:
                continue
            if isinstance(consumer, keras.layers.Layer) and consumer in _passing and only_shards_read(consumer):
                continue
            return False
        return True

    for layer in everything:
        if layer in _split_layers and _split_layers[layer].kind not in _ROW_KINDS or layer in _passing:
            gather_lazily(layer, only_shards_read(layer))
    for layer in everything:
        if layer in _attention_split:
            query, key, value, output = tp_compat.attention_projections(layer)
            for projection in (query, key, value):  # read as heads by the split attention (else gathered then)
                gather_lazily(projection)
            split = _split_layers.get(output)
            gather_lazily(layer, split is not None and split.kind in _ROW_KINDS)


def places_itself(layer) -> bool:
    """True for a layer whose split forward (or per-feature pass-through) places every op itself: wrapping its
    tensors (a pipeline stage's custom gradient) would hide its output's shards from the next split layer."""
    return layer in _split_layers or layer in _passing


def _channels_last(layer) -> bool:
    return getattr(layer, "data_format", "channels_last") == "channels_last"


def _splits_heads(split: SplitLayer | None) -> bool:
    """An attention projection split along its output's heads axis (axis 2 of [batch, seq, heads, dim])."""
    return split is not None and split.kind == "einsum_column" and split.logical["kernel"].shape[1] != \
        split.shards["kernel"][0].shape[1]


def _role(layer, kv) -> str:
    return kv.path.rsplit("/", 1)[-1]


def _make_shards(strategy, layer, kv, axis: int, grid) -> list:
    span = span_of(grid[0])
    first = span.first if span is not None else 0  # a row across processes: this process makes its own shards
    value = np.asarray(kv.numpy())
    pieces = np.split(value, row_size(grid[0]), axis=axis)[first:first + len(grid[0])]
    shards = []
    with tf.init_scope(), strategy.scope(), keras.name_scope(layer.name):
        for k, piece in enumerate(pieces):
            with strategy.extended.creating_on([row[k] for row in grid]):
                shards.append(keras.Variable(piece, dtype=kv.dtype, trainable=kv.trainable,
                                             name=f"{kv.name}_shard_{first + k}"))
    tp_compat.replace_variable(layer, kv, shards)
    gather = None if span is None else (lambda local, axis_: gather_value(local, axis_, span))
    view = tp_compat.LogicalView(shards, axis, tuple(kv.shape), kv.dtype, first_copy_device(shards[0]), name=kv.path,
                                 gather=gather, first=first, parts=row_size(grid[0]))
    tp_compat.set_logical_view(kv, view)
    return shards

def _keep_logical_saving(layer, logical: list) -> None:
    """`.keras` files hold the layer's logical variables in Keras' own order, so plain Keras (and any mesh) loads
    them; loading one splits each value over the shards."""

    def save_own_variables(self, store):
        for i, variable in enumerate(logical):
            store[str(i)] = np.asarray(variable.numpy())

    def load_own_variables(self, store):
        if len(store.keys()) != len(logical):
            raise ConfigError(f"layer {self.name!r}: the file holds {len(store.keys())} variables, the layer has "
                              f"{len(logical)}; it was saved from a different model.")
        for i, variable in enumerate(logical):
            variable.assign(np.asarray(store[str(i)]))

    tp_compat.bind_method(layer, "save_own_variables", save_own_variables)
    tp_compat.bind_method(layer, "load_own_variables", load_own_variables)


def _logical_weights(obj) -> list:
    """`obj.weights` as plain Keras lists them: each split variable's shards give way, at the first shard, to the
    logical variable they stand for (full shape; reads gather the shards, writes split the value over them)."""
    inner = [obj, *keras_model.all_layers(obj)] if isinstance(obj, keras.layers.Layer) else [obj]
    logical_of = {id(shard): split.logical[role] for layer in inner if layer in _split_layers
                  for split in (_split_layers[layer],) for role, shards in split.shards.items() for shard in shards}
    found, seen = [], set()
    for variable in obj.weights:
        variable = logical_of.get(id(variable), variable)
        if id(variable) not in seen:
            seen.add(id(variable))
            found.append(variable)
    return found


def _keep_logical_weights(layers: list, splits: list[SplitLayer]) -> None:
    """`get_weights`/`set_weights` of the model and of every layer holding shards work on the logical variables,
    as in plain Keras (weights copied between models, or from a checkpoint made without the mesh, keep their
    shapes). `model.weights` keeps the shards: the optimizer and the gradients are per shard."""

    def get_weights(self):
        return [np.asarray(variable.numpy()) for variable in _logical_weights(self)]

    def set_weights(self, weights):
        variables = _logical_weights(self)
        if len(variables) != len(weights):  # Keras' own checks and messages (keras/src/layers/layer.py)
            raise ValueError(f"You called `set_weights(weights)` on layer '{self.name}' with a weight list of length "
                             f"{len(weights)}, but the layer was expecting {len(variables)} weights.")
        for variable, value in zip(variables, weights):
            if tuple(variable.shape) != tuple(np.shape(value)):
                raise ValueError(f"Layer {self.name} weight shape {tuple(variable.shape)} is not compatible with "
                                 f"provided weight shape {tuple(np.shape(value))}.")
        for variable, value in zip(variables, weights):
            variable.assign(value)

    shard_ids = {id(shard) for split in splits for shards in split.shards.values() for shard in shards}
    for layer in layers:
        if any(id(variable) in shard_ids for variable in layer.weights):
            tp_compat.bind_method(layer, "get_weights", get_weights)
            tp_compat.bind_method(layer, "set_weights", set_weights)


def _bytes(model, grid) -> tuple[dict[str, int], int]:
    """Bytes of model variables each device holds (every mirrored component counted where it lives), and what
    one device would hold with every variable whole (the shards of a variable add up to its logical size)."""
    per_device = {device: 0 for row in grid for device in row}
    keys = {(spec.device_type, spec.device_index): name
            for name, spec in ((n, tf.DeviceSpec.from_string(n)) for n in per_device)}
    replicated = 0
    for kv in model.weights:
        size = int(np.prod(kv.shape)) * tf.as_dtype(kv.dtype).size
        replicated += size
        for component in getattr(kv.value, "values", [kv.value]):
            spec = tf.DeviceSpec.from_string(component.device)
            name = keys.get((spec.device_type, spec.device_index))
            if name is not None:
                per_device[name] += size
    return per_device, replicated
