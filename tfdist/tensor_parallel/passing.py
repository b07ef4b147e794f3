"""Split activations that stay split: per-feature layers (pooling, activations) run on each shard, and a
MultiHeadAttention whose projections are split over the heads computes each device's heads there."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import keras

from tfdist.tensor_parallel.ops import gather_from_shards, on_device, remember_shards, shards_of
from tfdist.tensor_parallel.span import gathers_lazily, logical_value, row_of

__all__ = ["pass_shards_through", "split_attention"]


def pass_shards_through(layer, devices_for_replica: Callable[[], Sequence[str]]) -> None:
    """Makes a per-feature layer (pooling, an activation) keep a split activation split: fed the output of a
    column-parallel layer, it runs on each shard on the shard's device, so the next row-parallel layer still
    needs no exchange. Fed anything else, it runs as usual."""
    original = layer.call

    @functools.wraps(original)
    def call(inputs, *args, **kwargs):
        if isinstance(inputs, keras.KerasTensor):
            return original(inputs, *args, **kwargs)
        devices = row_of(devices_for_replica())
        shards = shards_of(inputs, devices)
        if shards is None:
            return original(logical_value(inputs), *args, **kwargs)
        outs = [on_device(device, lambda t: original(t, *args, **kwargs), shard)
                for device, shard in zip(devices, shards)]
        logical = gather_from_shards(outs, devices[0], devices=devices, lazy=gathers_lazily(layer))
        remember_shards(logical, devices, outs)
        return logical

    layer.call = call


def split_attention(layer, devices_for_replica: Callable[[], Sequence[str]]) -> None:
    """Makes a MultiHeadAttention whose query/key/value projections are split over the heads compute each
    device's heads there: the attention of head slice k runs on device k from the projections' shards, and its
    output stays split for the (row-parallel) output projection. Attention scores asked for, or projections
    not split alike, fall back to the layer's own (replicated) attention."""
    from tfdist.tensor_parallel._keras_layers import wrap_compute_attention

    def make(original):
        def compute(query, key, value, attention_mask=None, training=None, return_attention_scores=False,
                    **kwargs):
            devices = row_of(devices_for_replica())
            shards = [shards_of(t, devices, axis=2) for t in (query, key, value)]
            if return_attention_scores or any(s is None for s in shards):
                query, key, value = (logical_value(t) for t in (query, key, value))  # across processes: gathered
                return original(query, key, value, attention_mask, training, return_attention_scores, **kwargs)
            outs = []
            for k, device in enumerate(devices):
                def heads(q, kk, v):
                    return original(q, kk, v, attention_mask, training, False, **kwargs)[0]

                outs.append(on_device(device, heads, shards[0][k], shards[1][k], shards[2][k]))
            logical = gather_from_shards(outs, devices[0], axis=2, devices=devices, lazy=gathers_lazily(layer))
            remember_shards(logical, devices, outs, axis=2)
            return logical, None

        return compute

    wrap_compute_attention(layer, make)
