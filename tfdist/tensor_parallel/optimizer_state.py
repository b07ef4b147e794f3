"""Optimizer state of a split model saved as plain Keras has it: one logical slot per logical variable.

The slots of a split variable's shards are written (`.keras` and `tf.train.Checkpoint`) as one slot of the
logical shape, concatenated like the variable, in Keras' order; loading splits them again. So optimizer state
moves between mesh shapes and plain Keras.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tensorflow as tf

from tfdist.errors import ConfigError
from tfdist.tensor_parallel import _keras_layers as tp_compat
from tfdist.tensor_parallel.span import gather_value

__all__ = ["first_copy_device", "keep_logical_optimizer_saving", "logical_keys"]


def first_copy_device(shard) -> str:
    # The fully qualified device (/job:localhost/...) of the first copy: a checkpoint whose tensors name
    # devices in two spellings counts two tasks and restores inside a tf.function, where Keras cannot.
    value = shard.value
    return getattr(value, "values", [value])[0].device


def logical_keys(plans: list, variables: list) -> list[int]:
    """For each variable, the index of the logical variable it is part of (the shards of one split variable share
    it; any other variable has its own), numbered in order of first appearance: what clipnorm's norm is taken over.

    Example:
        >>> # tests/tp_models.mlp on a 2 x 2 mesh: up1/kernel_shard_0, up1/kernel_shard_1, up1/bias_shard_0, ...
        >>> logical_keys([strategy.shard(model)], model.trainable_variables)
        [0, 0, 1, 1, 2, 2, 3, 4, 4, 5, 5, 6, 6, 7, 8, 9]
    """
    logical_of = {id(shard): id(split.logical[role]) for plan in plans for split in plan.layers
                  for role, shards in split.shards.items() for shard in shards}
    dense: dict[int, int] = {}
    return [dense.setdefault(logical_of.get(id(v), id(v)), len(dense)) for v in variables]


def keep_logical_optimizer_saving(optimizer, plans: Callable[[], list], slot_reference: Callable) -> None:
    """Makes the optimizer's `.keras` state the one plain Keras has for the unsplit model: the slots of a split
    variable's shards are written as one slot of the logical shape (concatenated like the variable), in Keras'
    order; loading splits them again. So optimizer state, too, moves between mesh shapes and plain Keras.

    `plans()` gives the current shard plans, `slot_reference(optimizer_variable)` the tf variable a slot was
    created next to (None for other optimizer variables; under ZeRO the slots are logical views of sharded state)."""

    def logical_entries(self) -> list[tuple]:
        """[(None, variable)] for plain variables, [(axis, [slot per shard])] for slots of split variables (a row
        across processes: this process's shards; `spans` then maps id(list) to the row's span)."""
        owner = {}  # id(shard tf variable) -> (id of its logical variable, shard index, axis, shards)
        spans.clear()
        for plan in plans():
            span = getattr(plan, "span", None)
            for split in plan.layers:
                for role, shards in split.shards.items():
                    axis = next(i for i, (a, b) in enumerate(zip(split.logical[role].shape, shards[0].shape))
                                if a != b)
                    for k, shard in enumerate(shards):
                        owner[id(shard.value)] = (id(split.logical[role]), k, axis, len(shards))
                        if span is not None:
                            spans[id(split.logical[role])] = span
        entries, groups, seen = [], {}, {}
        for variable in self.variables:
            reference = slot_reference(variable)
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
                if logical_id in spans:
                    spans[id(groups[key])] = spans[logical_id]
            groups[key][k] = variable
        return entries

    spans: dict = {}  # id(logical variable or slot list) -> RowSpan, for rows across processes

    def whole(item, axis) -> np.ndarray:
        """A split variable's slot, whole: its shards' slots concatenated (across processes, a collective)."""
        local = np.concatenate([np.asarray(v.numpy()) for v in item], axis=axis)
        span = spans.get(id(item))
        return local if span is None else np.asarray(gather_value(tf.constant(local), axis, span))

    def mine(value: np.ndarray, item, axis) -> list:
        span = spans.get(id(item))
        if span is None:
            return np.split(value, len(item), axis=axis)
        return np.split(value, span.size, axis=axis)[span.first:span.first + len(item)]

    def save_own_variables(self, store):
        for i, (axis, item) in enumerate(logical_entries(self)):
            store[str(i)] = np.asarray(item.numpy()) if axis is None else whole(item, axis)

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
                for variable, part in zip(item, mine(value, item, axis)):
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
            items = [item if axis is None else _slot_view(item, axis, spans.get(id(item))) for axis, item in entries]
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


def _slot_view(slots: list, axis: int, span=None):
    shape = list(slots[0].shape)
    shape[axis] *= len(slots) if span is None else span.size
    first = 0 if span is None else span.first
    gather = None if span is None else (lambda local, axis_: gather_value(local, axis_, span))
    return tp_compat.LogicalView(slots, axis, tuple(shape), slots[0].dtype, first_copy_device(slots[0]),
                                 name=slots[0].path.replace(f"_shard_{first}", ""), gather=gather, first=first,
                                 parts=None if span is None else span.size)
