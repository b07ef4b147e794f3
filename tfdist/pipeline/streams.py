"""StageStreams: one op stream per device in a traced pipeline step, in GPipe order, weight gradients deferred."""

from __future__ import annotations

import bisect
import contextlib
import threading
import weakref
from dataclasses import dataclass

import tensorflow as tf

from tfdist._compat import tf_runtime

__all__ = ["StageStreams", "TaskKey"]


@dataclass(frozen=True, order=True)
class TaskKey:
    """Where a backward task sits in its device's chain; keys compare field by field.

    slot: the micro-batch slot it runs in (m for an input gradient, m + lag for a weight gradient
    deferred by `lag` micro-batches); kind: 0 for an input gradient (B), which comes first in its
    slot, 1 for a weight gradient (W); layer: minus the layer call's position on the device, so later
    layers come first (the backward order); part: 0 for the gradient itself, 1 for adding it to the
    running sum of its micro-batches.
    """

    slot: int
    kind: int
    layer: int
    part: int = 0

    @classmethod
    def input_gradient(cls, micro_batch: int, seq: int) -> "TaskKey":
        return cls(micro_batch, 0, -seq)

    @classmethod
    def weight_gradient(cls, micro_batch: int, seq: int, lag: int) -> "TaskKey":
        return cls(micro_batch + lag, 1, -seq)

    @classmethod
    def running_sum(cls, micro_batch: int, seq: int, lag: int) -> "TaskKey":
        return cls(micro_batch + lag, 1, -seq, 1)


class StageStreams:
    """One op stream per device in a traced step, in GPipe order, with deferred weight gradients.

    Forward: a placed layer call on a device starts after the previous one there has finished
    (trace order, i.e. micro-batch by micro-batch). Backward: each layer call's gradient is two
    tasks, the input gradient B (what the previous stage waits for) and the weight gradient W
    (what nobody waits for until the optimizer step), and each device runs its tasks one after
    another in the order
        B(0), W(0 - lag), B(1), W(1 - lag), ..., W(M-1)
    where W(m) of stage k is deferred by lag = k micro-batches (within a micro-batch, later layers
    first). This is the bubble-filling idea of zero-bubble pipeline schedules (Qi et al. 2023):
    stage k finishes its backward k slots before stage 0 does, so its deferred weight gradients
    run in that tail instead of delaying the input gradients upstream stages wait for. Stage 0
    (lag 0) is plain GPipe order. The gradients are the same; only their order changes.

    With `accumulate` each layer's weight gradients are summed micro-batch by micro-batch on its
    device, right after each W task, instead of in one M-way sum after the last micro-batch.

    This is what a real accelerator does (one compute stream runs one kernel after another) and
    what GPipe's clock schedule assumes: stage k works on micro-batch m while stage k+1 works on
    m+1. Logical CPU devices of one process share one inter-op thread pool instead, so without it
    the executor runs two micro-batches (or a B and a W) of the *same* stage on both cores while
    the other stage idles. The tape traces the backward layer by layer (every micro-batch's last
    layer first), so a task is inserted into its device's chain once it exists, with control
    edges to its nearest existing neighbours. No cycle: forward edges point from an earlier traced
    op to a later one; a backward task only waits for tasks that come earlier in its device's
    order, and data only flows from B tasks of later layers or later stages, which come earlier.

    Example:
        >>> streams = StageStreams()
        >>> tfdist.pipeline.layer_call.place_layer_call(layer, lambda: "/device:CPU:1", streams, lag=1)
    """

    def __init__(self, accumulate: bool = True) -> None:
        self.accumulate = accumulate
        self._tails: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # graph -> {device: tensors}
        self._chains: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> {(call, dev): [...]}
        self._calls: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # graph -> {(call, dev, m): n}
        self._pending: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> {(call, dev, seq): {m: W}}
        self._lock = threading.Lock()  # MirroredStrategy traces replicas in threads
        self._local = threading.local()

    @contextlib.contextmanager
    def micro_batch(self, index: int, call: object = None, micro_batches: int | None = None):
        """Layer calls traced inside belong to micro-batch `index` of the pipelined model call
        `call` (a token, one per traced call) of `micro_batches` (set by the pipelined model call)."""
        previous = getattr(self._local, "context", None)
        self._local.context = (index, call, micro_batches)
        try:
            yield
        finally:
            self._local.context = previous

    def current(self) -> tuple | None:
        """(micro-batch index, call token, micro-batches) of the layer call being traced, or None."""
        return getattr(self._local, "context", None)

    def next_call(self, device: str) -> int:
        """The position of a new layer call on `device` within the current micro-batch."""
        index, call, _ = self.current()
        graph = tf.compat.v1.get_default_graph()
        with self._lock:
            counts = self._calls.setdefault(graph, {})
            key = (id(call), device, index)
            counts[key] = counts.get(key, -1) + 1
            return counts[key]

    def after_previous(self, device: str) -> list:
        """Tensors the next forward call on `device` in the current graph must wait for."""
        graph = tf.compat.v1.get_default_graph()
        with self._lock:
            return list(self._tails.get(graph, {}).get(device, []))

    def record(self, device: str, tensors) -> None:
        """Marks `tensors` as the end of the latest forward call on `device` in the current graph."""
        tensors = [t for t in tf.nest.flatten(tensors) if tf.is_tensor(t)]
        if tensors:
            graph = tf.compat.v1.get_default_graph()
            with self._lock:
                self._tails.setdefault(graph, {})[device] = tensors

    def task(self, device: str, call: object, key: TaskKey, entries: list, exits: list, label: tuple = ()) -> None:
        """Inserts a backward task (its first ops `entries`, its results `exits`) into `device`'s
        chain for model call `call` at position `key` (see the class docstring for the order);
        `label` names it in `schedule()`."""
        entries = [t.op if tf.is_tensor(t) else t for t in entries if t is not None]
        exits = [t.op if tf.is_tensor(t) else t for t in exits if t is not None]
        graph = tf.compat.v1.get_default_graph()
        with self._lock:
            chain = self._chains.setdefault(graph, {}).setdefault((id(call), device), [])
            pos = bisect.bisect([task[0] for task in chain], key)
            before = next((task[2] for task in reversed(chain[:pos]) if task[2]), [])
            after = next((task[1] for task in chain[pos:] if task[1]), [])
            chain.insert(pos, (key, entries, exits, label))
        if before:
            for op in entries:
                tf_runtime.add_control_inputs(op, before)
        if exits:
            for op in after:
                tf_runtime.add_control_inputs(op, exits)

    def sum_weight_gradients(self, device: str, call: object, seq: int, index: int, lag: int,
                             micro_batches: int, grads: list) -> list:
        """Collects micro-batch `index`'s weight gradients of layer call `seq`; once all
        `micro_batches` are traced, returns their running sums (added in micro-batch order on
        `device`, each add right after its W task in the device's chain); None until then."""
        graph = tf.compat.v1.get_default_graph()
        with self._lock:
            book = self._pending.setdefault(graph, {}).setdefault((id(call), device, seq), {})
            book[index] = grads
            if len(book) < micro_batches:
                return [None] * len(grads)
            parts = [book[m] for m in sorted(book)]
            book.clear()
        sums = list(parts[0])
        for m, grads_m in enumerate(parts[1:], start=1):
            with tf.name_scope(f"accumulate_{m}"):
                sums = [s + g for s, g in zip(sums, grads_m)]
            self.task(device, call, TaskKey.running_sum(m, seq, lag), sums, sums, ("sum", m, seq))
        return sums

    def schedule(self, graph=None) -> dict[str, list[tuple]]:
        """The backward order per device in `graph` (default: the current one): a list of
        (label, entry ops, exit ops) per device, label = (kind, micro-batch, layer call) with kind
        "B" (input gradient), "W" (weight gradient) or "sum" (adding it to the running sum)."""
        graph = graph or tf.compat.v1.get_default_graph()
        out: dict[str, list[tuple]] = {}
        with self._lock:
            for (_, device), chain in self._chains.get(graph, {}).items():
                out.setdefault(device, []).extend((label, entries, exits) for _, entries, exits, label in chain)
        return out
