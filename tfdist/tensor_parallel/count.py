"""Counting the tensor-parallel exchanges of a traced step (the Megatron pairing rule, checked), and their bytes."""

from __future__ import annotations

import re

import tensorflow as tf

__all__ = ["collective_bytes", "collective_counts"]

# name scope of an exchange -> the op types that carry it (see tensor_parallel_ops): inside a process a sum or a
# concat on the home device; across processes the row's collective, TF's or Horovod's (its local sum or concat
# sits outside the scope)
KINDS = {"tp_all_reduce": ("AddN", "CollectiveReduceV2", "HorovodAllreduce"),
         "tp_all_gather": ("ConcatV2", "CollectiveGatherV2", "HorovodAllgather"), "tp_scatter": ("Split", "SplitV")}


def _scope(op_type: str, name: str) -> str | None:
    # TF makes a repeated name scope unique ("tp_all_reduce_1/AddN": the second backward all-reduce at top level)
    for scope, types in KINDS.items():
        if op_type in types and re.search(rf"(^|/){scope}(_\d+)?/", name):
            return scope
    return None


def _graph_exchanges(graph: tf.Graph) -> list[tuple[str, tf.Operation]]:
    """(scope, op) for the exchanges in the graph itself whose result something reads."""
    found = []
    for op in graph.get_operations():
        scope = _scope(op.type, op.name)
        if scope is not None and any(out.consumers() for out in op.outputs):
            found.append((scope, op))
    return found


def collective_counts(graph: tf.Graph) -> dict[str, int]:
    """How many tensor-parallel exchanges a traced step runs: AddN ops under `tp_all_reduce`, ConcatV2 under
    `tp_all_gather`, Split under `tp_scatter`, in the graph and every function in its library (Keras' step
    loop is one). Ops whose result nothing reads (a column-parallel output read only as shards) are left out:
    TF prunes them before running the step.

    Example:
        >>> collective_counts(step.get_concrete_function(x, y).graph)
        {'tp_all_reduce': 3, 'tp_all_gather': 0, 'tp_scatter': 0}
    """
    counts = dict.fromkeys(KINDS, 0)
    for scope, _ in _graph_exchanges(graph):
        counts[scope] += 1
    for fn in graph.as_graph_def().library.function:
        read = {name.lstrip("^").split(":")[0] for node in fn.node_def for name in node.input}
        read |= {value.split(":")[0] for value in fn.ret.values()}
        for node in fn.node_def:
            scope = _scope(node.op, node.name)
            if scope is not None and node.name in read:
                counts[scope] += 1
    return counts


def collective_bytes(graph: tf.Graph) -> dict[str, int]:
    """Bytes of the tensors each kind of exchange carries in a traced step: the all-reduced tensor of every
    `tp_all_reduce` (what Megatron's formula counts: one b×s×h activation per all-reduce), the gathered tensor
    of every `tp_all_gather`, the split tensor of every `tp_scatter`. Read from the static shapes of the
    graph's own ops: trace the step with fully defined input shapes (`get_concrete_function(x, y)` on
    tensors), not through Keras' `fit` loop (whose ops sit in library functions).

    Example:
        >>> collective_bytes(step.get_concrete_function(x).graph)   # 2 pairs behind a LayerNorm, x: 8×16 float32
        {'tp_all_reduce': 2048, 'tp_all_gather': 0, 'tp_scatter': 0}
    """
    exchanges = _graph_exchanges(graph)
    total = dict.fromkeys(KINDS, 0)
    for scope, op in exchanges:
        for out in op.outputs:
            if not out.shape.is_fully_defined():
                raise ValueError(f"collective_bytes: {op.name} has output shape {out.shape}; trace the step with "
                                 "fully defined shapes (get_concrete_function on tensors, not TensorSpecs with "
                                 "None).")
            total[scope] += out.shape.num_elements() * out.dtype.size
    counts = collective_counts(graph)
    if any(counts[s] != sum(1 for scope, _ in exchanges if scope == s) for s in KINDS):
        raise ValueError(f"collective_bytes: the graph's library functions hold exchanges too ({counts}); trace the "
                         "training step itself with tf.function (strategy.run inside it), not Keras' fit loop.")
    return total
