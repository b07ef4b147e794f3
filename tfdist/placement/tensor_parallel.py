"""Feature splitting inside one replica (tensor parallelism): the public names, gathered from their modules.

A replica owns a row of "model"-axis devices; its first device is the *home* device, where replicated layers
run and where the replica's data arrives. The pieces, one concept per module:

- `tensor_parallel_ops`: Megatron's conjugate operators `copy_to_shards` (f) and `reduce_from_shards` (g),
  gathers/scatters, `on_device` (a shard's forward and backward on its device), and the memory of which
  logical activation a column-parallel layer produced from which shards.
- `tensor_parallel_layers`: the split forward of Dense, Conv and Embedding, and `split_layer_call`.
- `tensor_parallel_einsum`: the split forward of EinsumDense (attention projections).
- `tensor_parallel_passing`: per-feature layers and attention heads that keep a split activation split.
- `tensor_parallel_count`: `collective_counts`/`collective_bytes`, the exchanges of a traced step.
- `tensor_parallel_shard`: splitting a built model's variables by a LayoutMap (`shard_model`).

Within one process an all-reduce whose result the next (replicated) layer needs in one place is a reduce to
the home device followed by the next f's copies: the same bytes as a ring all-reduce (2(T-1)/T of the tensor
per device, 2(T-1) tensors in all), with the replicated layers computed once instead of T times. A
column/row pair costs one all-reduce forward and one backward, as in Megatron.

Example:
    >>> from tfdist.placement.tensor_parallel import collective_counts
    >>> collective_counts(step.get_concrete_function(x, y).graph)       # two column/row pairs, data input
    {'tp_all_reduce': 3, 'tp_all_gather': 0, 'tp_scatter': 0}
"""

from __future__ import annotations

from tfdist.placement.tensor_parallel_count import collective_bytes, collective_counts
from tfdist.placement.tensor_parallel_einsum import layer_split_axis
from tfdist.placement.tensor_parallel_layers import KINDS, split_layer_call
from tfdist.placement.tensor_parallel_ops import (SCOPES, copy_to_shards, gather_from_shards, on_device,
                                                  reduce_from_shards, split_to_shards)
from tfdist.placement.tensor_parallel_passing import pass_shards_through, split_attention

__all__ = ["KINDS", "SCOPES", "collective_bytes", "collective_counts", "copy_to_shards", "gather_from_shards",
           "layer_split_axis", "on_device", "pass_shards_through", "reduce_from_shards", "split_attention",
           "split_layer_call", "split_to_shards"]
