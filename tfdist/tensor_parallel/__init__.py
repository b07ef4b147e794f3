"""Tensor parallelism (Keras calls it variable layout): a DeviceMesh, a LayoutMap, and the layers split by it.

A replica owns a row of "model"-axis devices; its first device is the *home* device, where replicated layers
run and where the replica's data arrives. The pieces, one concept per module:

- `mesh`, `layout_map`: `DeviceMesh` and `LayoutMap`, as in `keras.distribution`;
- `ops`: Megatron's conjugate operators `copy_to_shards` (f) and `reduce_from_shards` (g),
  gathers/scatters, `on_device` (a shard's forward and backward on its device), and the memory of which
  logical activation a column-parallel layer produced from which shards.
- `layers`: the split forward of Dense, Conv and Embedding, and `split_layer_call`.
- `einsum`: the split forward of EinsumDense (attention projections).
- `passing`: per-feature layers and attention heads that keep a split activation split.
- `count`: `collective_counts`/`collective_bytes`, the exchanges of a traced step.
- `shard`: splitting a built model's variables by a LayoutMap (`shard_model`);
- `span`, `row_reductions`, `horovod_mesh`: a mesh whose rows or batch axis span processes;
- `stages`: data x tensor x pipeline (stages on model-axis groups);
- `memory`: the bytes each mesh device holds.

Within one process an all-reduce whose result the next (replicated) layer needs in one place is a reduce to
the home device followed by the next f's copies: the same bytes as a ring all-reduce (2(T-1)/T of the tensor
per device, 2(T-1) tensors in all), with the replicated layers computed once instead of T times. A
column/row pair costs one all-reduce forward and one backward, as in Megatron.

Example:
    >>> from tfdist.tensor_parallel import collective_counts
    >>> collective_counts(step.get_concrete_function(x, y).graph)       # two column/row pairs, data input
    {'tp_all_reduce': 3, 'tp_all_gather': 0, 'tp_scatter': 0}
"""

from __future__ import annotations

from tfdist.lazy import exports

# public name -> the module that defines it, imported on first use
_LAZY = {
    "DeviceMesh": "tfdist.tensor_parallel.mesh",
    "LayoutMap": "tfdist.tensor_parallel.layout_map",
    "collective_counts": "tfdist.tensor_parallel.count",
    "collective_bytes": "tfdist.tensor_parallel.count",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = exports(__name__, _LAZY)
