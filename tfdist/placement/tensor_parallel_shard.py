"""Splitting a built Keras model's variables by a LayoutMap: one shard variable per "model"-axis device."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfdist._compat import keras_model
from tfdist._compat import tensor_parallel as tp_compat
from tfdist.errors import ConfigError
from tfdist.placement.layout_map import LayoutMap
from tfdist.placement.tensor_parallel import pass_shards_through, split_attention, split_layer_call

__all__ = ["ShardPlan", "SplitLayer", "keep_logical_optimizer_saving", "shard_model"]


@dataclasses.dataclass
class SplitLayer:
    """One split layer: how (`kind`), and its shard variables per role ("kernel", "bias", "embeddings")."""

    name: str
    kind: str
    shards: dict[str, list]
    logical: dict[str, object]


_CONVS = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)
# Per-feature layers that keep a split activation split (see tensor_parallel.pass_shards_through).
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

    def __str__(self) -> str:
        lines = [f"model {self.model_name!r}: {len(self.layers)} split layer(s) over rows {self.grid}"]
        for split in self.layers:
            shapes = {role: [tuple(v.shape) for v in vs] for role, vs in split.shards.items()}
            lines.append(f"  {split.name}: {split.kind} {shapes}")
        for device, size in self.bytes_per_device.items():
            lines.append(f"  {device}: {size:,} B of variables ({size / max(self.replicated_bytes, 1):.1%} of "
                         "replicated)")
        return "\n".join(lines)


def _split_axis(layout, model_axis: str) -> int | None:
    if not layout or model_axis not in layout:
        return None
    return list(layout).index(model_axis)


def _kind(layer, axes: dict[str, int | None]) -> tuple[str | None, str]:
    """(kind or None for replicated, reason if the layout cannot be honoured)."""
    if isinstance(layer, keras.layers.Dense):
        kernel, bias = axes.get("kernel"), axes.get("bias")
        if kernel == 1:
            return "column", ""
        if kernel == 0:
            if bias is not None:
                return None, ("a row-parallel Dense (kernel split on its input dimension) adds its bias after the "
                              "all-reduce: leave the bias replicated (no rule, or (None,))")
            return "row", ""
        if bias is not None:
            return None, "a Dense bias can be split only together with its kernel's output dimension (None, 'model')"
        return None, ""
    if isinstance(layer, keras.layers.EinsumDense):
        kernel, bias = axes.get("kernel"), axes.get("bias")
        if kernel is None:
            return None, ("an EinsumDense bias can be split only together with its kernel" if bias is not None
                          else "")
        _, kernel_spec, out_spec = layer.equation.replace("->", ",").split(",")
        if kernel_spec[kernel] in out_spec:
            return "einsum_column", ""
        if bias is not None:
            return None, ("an EinsumDense split along a contracted dimension adds its bias after the all-reduce: "
                          "leave the bias replicated")
        return "einsum_row", ""
    if isinstance(layer, _CONVS):
        kernel, bias = axes.get("kernel"), axes.get("bias")
        rank = len(layer.kernel.shape)
        if kernel is None and bias is None:
            return None, ""
        if layer.data_format != "channels_last" or layer.groups != 1:
            return None, "a convolution can be split only with data_format='channels_last' and groups=1"
        if kernel == rank - 1:
            return "conv_column", ""
        if kernel == rank - 2 and bias is None:
            return "conv_row", ""
        return None, (f"a {type(layer).__name__} kernel can be split on its output channels (dimension {rank - 1}, "
                      f"bias split alike or replicated) or its input channels (dimension {rank - 2}, bias replicated)")
    if isinstance(layer, keras.layers.Embedding):
        table = axes.get("embeddings")
        return {0: "vocab", 1: "embedding_features", None: None}[table], ""
    if any(a is not None for a in axes.values()):
        return None, (f"{type(layer).__name__} cannot be split yet (supported: Dense, EinsumDense, Embedding, "
                      "Conv1D/2D/3D, MultiHeadAttention's projections); remove its rule "
                      "from the LayoutMap to run it replicated")
    return None, ""


def shard_model(strategy: tf.distribute.Strategy, model: keras.Model, layout_map: LayoutMap,
                grid: Sequence[Sequence[str]], model_axis: str, batch_axis: str,
                devices_for_replica: Callable[[], Sequence[str]]) -> ShardPlan:
    """Splits every variable `layout_map` assigns to `model_axis` into len(grid[0]) shards, shard k mirrored over
    grid[r][k] for every row r; swaps the shards in for the logical variables (which then read as the shards'
    concatenation) and makes the split layers compute from them. Call inside `strategy.scope()`, eagerly."""
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
                              "copies). Use tfdist.sharding (ZeRO) to split optimizer state over the batch axis.")
    parts = len(grid[0])
    plan_layers: list[SplitLayer] = list(done)
    for layer in layers:
        roles = {_role(layer, kv): kv for kv in tp_compat.own_variables(layer)}
        axes = {role: _split_axis(layouts.get(kv.path), model_axis) for role, kv in roles.items()}
        kind, reason = _kind(layer, axes)
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
            shards[role] = _make_shards(strategy, layer, kv, axis, grid)
        plan_layers.append(SplitLayer(layer.name, kind, shards, dict(roles)))
        _split_layers[layer] = plan_layers[-1]
        _keep_logical_saving(layer, logical_order)
        split_layer_call(layer, kind, shards, devices_for_replica, kernel_axis=axes.get("kernel"))
    for layer in everything:
        if isinstance(layer, _PER_FEATURE) and parts > 1 and layer not in _passing and _channels_last(layer):
            _passing.add(layer)
            pass_shards_through(layer, devices_for_replica)
    split_kinds = {id(layer): _split_layers[layer] for layer in everything if layer in _split_layers}
    for layer in everything:
        if isinstance(layer, keras.layers.MultiHeadAttention) and parts > 1 and layer not in _attention_split:
            query, key, value, _ = tp_compat.attention_projections(layer)
            if all(_splits_heads(split_kinds.get(id(p))) for p in (query, key, value)):
                _attention_split.add(layer)
                split_attention(layer, devices_for_replica)
    return ShardPlan(model.name, [list(r) for r in grid], plan_layers, *_bytes(model, grid))


def _channels_last(layer) -> bool:
    return getattr(layer, "data_format", "channels_last") == "channels_last"


def _splits_heads(split: SplitLayer | None) -> bool:
    """An attention projection split along its output's heads axis (axis 2 of [batch, seq, heads, dim])."""
    return split is not None and split.kind == "einsum_column" and split.logical["kernel"].shape[1] != \
        split.shards["kernel"][0].shape[1]


def _role(layer, kv) -> str:
    return kv.path.rsplit("/", 1)[-1]


def _make_shards(strategy, layer, kv, axis: int, grid) -> list:
    parts = len(grid[0])
    value = np.asarray(kv.numpy())
    pieces = np.split(value, parts, axis=axis)
    shards = []
    with tf.init_scope(), strategy.scope(), keras.name_scope(layer.name):
        for k, piece in enumerate(pieces):
            with strategy.extended.creating_on([row[k] for row in grid]):
                shards.append(keras.Variable(piece, dtype=kv.dtype, trainable=kv.trainable,
                                             name=f"{kv.name}_shard_{k}"))
    tp_compat.replace_variable(layer, kv, shards)
    tp_compat.set_logical_view(kv, tp_compat.LogicalView(shards, axis, tuple(kv.shape), kv.dtype, _full_name(shards[0]),
                                                                name=kv.path))
    return shards


def _full_name(shard) -> str:
    # The fully qualified device (/job:localhost/...) of the first copy: a checkpoint whose tensors name
    # devices in two spellings counts two tasks and restores inside a tf.function, where Keras cannot.
    value = shard.value
    return getattr(value, "values", [value])[0].device


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


def keep_logical_optimizer_saving(optimizer, plans: Callable[[], list[ShardPlan]], slot_reference: Callable) -> None:
    """Makes the optimizer's `.keras` state the one plain Keras has for the unsplit model: the slots of a split
    variable's shards are written as one slot of the logical shape (concatenated like the variable), in Keras'
    order; loading splits them again. So optimizer state, too, moves between mesh shapes and plain Keras.

    `plans()` gives the current shard plans, `slot_reference(tf_variable)` the variable a slot was created next
    to (None for other optimizer variables)."""

    def logical_entries(self) -> list[tuple]:
        """[(None, variable)] for plain variables, [(axis, [slot per shard])] for slots of split variables."""
        owner = {}  # id(shard tf variable) -> (id of its logical variable, shard index, axis, shards)
        for plan in plans():
            for split in plan.layers:
                for role, shards in split.shards.items():
                    axis = next(i for i, (a, b) in enumerate(zip(split.logical[role].shape, shards[0].shape))
                                if a != b)
                    for k, shard in enumerate(shards):
                        owner[id(shard.value)] = (id(split.logical[role]), k, axis, len(shards))
        entries, groups, seen = [], {}, {}
        for variable in self.variables:
            reference = slot_reference(variable.value)
            found = owner.get(id(reference)) if reference is not None else None
            if found is None:
                entries.append((None, variable))
                continue
            logical_id, k, axis, parts = found
            index = seen.get(id(reference), 0)  # the index-th slot created for this shard (momentum, velocity)
            seen[id(reference)] = index + 1
            key = (logical_id, index)
            if key not in groups:
                groups[key] = [None] * parts
                entries.append((axis, groups[key]))
            groups[key][k] = variable
        return entries

    def save_own_variables(self, store):
        for i, (axis, item) in enumerate(logical_entries(self)):
            store[str(i)] = (np.asarray(item.numpy()) if axis is None
                             else np.concatenate([np.asarray(v.numpy()) for v in item], axis=axis))

    def load_own_variables(self, store):
        entries = logical_entries(self)
        if len(store.keys()) != len(entries):
            raise ConfigError(f"optimizer {self.name!r}: the file holds {len(store.keys())} optimizer variables, this "
                              f"optimizer has {len(entries)} (logical); it was saved for a different model or "
                              "optimizer.")
        for i, (axis, item) in enumerate(entries):
            value = np.asarray(store[str(i)])
            if axis is None:
                item.assign(value)
            else:
                for variable, part in zip(item, np.split(value, len(item), axis=axis)):
                    variable.assign(part)

    cache: dict = {}

    def checkpoint_children(children: dict) -> dict:
        # tf.train.Checkpoint: the lists plain Keras saves ("_trainable_variables/i", "_variables/i") hold the
        # logical variables and logical slots, so a checkpoint moves between mesh shapes and plain Keras.
        if not getattr(optimizer, "built", False):
            return children
        entries = logical_entries(optimizer)
        key = tuple(id(v) for _, item in entries for v in (item if isinstance(item, list) else [item]))
        if cache.get("key") != key:
            logical_of = {id(shard): split.logical[role] for plan in plans() for split in plan.layers
                          for role, shards in split.shards.items() for shard in shards}
            trainables = []
            for v in tp_compat.optimizer_trainables(optimizer):
                v = logical_of.get(id(v), v)
                if not trainables or trainables[-1] is not v:
                    trainables.append(v)
            items = [item if axis is None else _slot_view(item, axis) for axis, item in entries]
            cache.update(key=key, trainables=tp_compat.tracked_list(trainables), items=tp_compat.tracked_list(items))
        children["_trainable_variables"] = cache["trainables"]
        children["_variables"] = cache["items"]
        # Keras' per-slot lists (Adam's "_momentums", "_velocities") name the same slots again: leave out those
        # holding shard slots (plain Keras finds its slots through "_variables").
        split_slots = {id(v) for axis, item in entries if axis is not None for v in item}
        for name, child in list(children.items()):
            if name not in ("_trainable_variables", "_variables") and isinstance(child, (list, tuple)) and any(
                    id(v) in split_slots for v in child):
                del children[name]
        return children

    tp_compat.bind_method(optimizer, "save_own_variables", save_own_variables)
    tp_compat.bind_method(optimizer, "load_own_variables", load_own_variables)
    tp_compat.override_checkpoint_children(optimizer, checkpoint_children)


def _slot_view(slots: list, axis: int):
    shape = list(slots[0].shape)
    shape[axis] *= len(slots)
    return tp_compat.LogicalView(slots, axis, tuple(shape), slots[0].dtype, _full_name(slots[0]),
                                 name=slots[0].path.replace("_shard_0", ""))
