"""Runs a layer's forward and backward ops on its stage's device, with explicit transfers in and out."""

from __future__ import annotations

import bisect
import contextlib
import functools
import threading
import weakref
from collections.abc import Callable

import keras
import tensorflow as tf

from tfdist import compat

__all__ = ["place_layer_call", "colocate_with_inputs", "canonical_device", "StageStreams"]

# Attribute set on a layer whose call was wrapped, holding the original bound call.
_ORIGINAL = "_tfdist_original_call"


def canonical_device(name: str) -> str:
    """'/device:CPU:1', '/job:localhost/replica:0/task:0/device:CPU:1' -> 'CPU:1' (for comparisons)."""
    spec = tf.DeviceSpec.from_string(name or "")
    if spec.device_type is None:
        return ""
    return f"{spec.device_type.upper()}:{spec.device_index or 0}"


def _is_symbolic(values) -> bool:
    return any(isinstance(v, keras.KerasTensor) for v in tf.nest.flatten(values))


def _differentiable(t) -> bool:
    return tf.is_tensor(t) and t.dtype.is_floating


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
        >>> place_layer_call(layer, lambda: "/device:CPU:1", streams, lag=1)
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

    def current_micro_batch(self) -> int | None:
        context = getattr(self._local, "context", None)
        return context[0] if context else None

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

    def task(self, device: str, call: object, key: tuple, entries: list, exits: list, label: tuple = ()) -> None:
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
                compat.add_control_inputs(op, before)
        if exits:
            for op in after:
                compat.add_control_inputs(op, exits)

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
            self.task(device, call, (m + lag, 1, -seq, 1), sums, sums, ("sum", m, seq))
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


def place_layer_call(layer: keras.layers.Layer, device_for_replica: Callable[[], str],
                     streams: StageStreams | None = None, lag: int = 0) -> None:
    """Wraps `layer.call` so that, in a traced (graph) step, its ops run on one device.

    `device_for_replica()` names the device for the calling replica (the stage's device in that
    replica's pipeline). In graph mode the layer runs inside a `tf.custom_gradient`:
    - inputs are copied to the device explicitly (`tf.identity` under `tf.device`), so a tensor
      crossing stages is one visible transfer;
    - the forward ops run under `tf.device` and are recorded by an inner tape;
    - the backward (input and weight gradients) is computed from that tape under the same device,
      after an explicit copy of the incoming gradients. Without this, TF builds every backward op
      where `tape.gradient` is called, i.e. on the first device.
    With `streams`, calls on one device are chained in trace order, and inside a pipelined model
    call the backward is split into input and weight gradients, the latter deferred by `lag`
    micro-batches (the stage's index) and summed as they come (see `StageStreams`).
    Eager calls (run_eagerly=True, model(x) outside tf.function) run the forward under the device
    and leave the backward to TF. Symbolic calls (building, KerasTensors) are passed through.
    Calling it again re-targets the layer.
    """
    original = getattr(layer, _ORIGINAL, None) or layer.call

    @functools.wraps(original)
    def call(*args, **kwargs):
        if _is_symbolic((args, kwargs)):
            return original(*args, **kwargs)
        device = device_for_replica()
        if tf.executing_eagerly() or not tf.inside_function():
            with tf.device(device):
                return original(*args, **kwargs)
        flat = tf.nest.flatten(args)
        slots = [i for i, t in enumerate(flat) if _differentiable(t)]
        context = streams.current() if streams else None
        seq = streams.next_call(device) if context else None

        def run(tensors):
            values = list(flat)
            for i, t in zip(slots, tensors):
                values[i] = t
            return original(*tf.nest.pack_sequence_as(args, values), **kwargs)

        @tf.custom_gradient
        def stage(*tensors):
            waits = streams.after_previous(device) if streams else []
            with tf.device(device), tf.name_scope("to_stage"), tf.control_dependencies(waits):
                local = [tf.identity(t) for t in tensors]
            with tf.device(device):
                with tf.GradientTape(persistent=context is not None) as tape:
                    tape.watch(local)
                    outputs = run(local)
            flat_out = tf.nest.flatten(outputs)
            if streams:
                streams.record(device, flat_out)

            def grad(*dys, variables=None):
                variables = list(variables or [])
                with tf.device(device), tf.name_scope(f"{layer.name}_backward"):
                    # Only float outputs carry gradients (an argmax or lookup output has none).
                    pairs = [(y, d) for y, d in zip(flat_out, dys) if d is not None and _differentiable(y)]
                    ys = [y for y, _ in pairs]

                    def gradient(sources):
                        # The incoming gradients are copied to this device explicitly.
                        copies = [tf.identity(d) for _, d in pairs]
                        return copies, tape.gradient(ys, sources, output_gradients=copies,
                                                     unconnected_gradients=tf.UnconnectedGradients.ZERO)

                    if context is None:
                        _, grads = gradient(local + variables)
                        return grads[:len(local)], grads[len(local):]
                    index, call, micro_batches = context
                    input_grads, weight_grads = [], []
                    if local:  # B: what the previous stage waits for
                        copies, input_grads = gradient(local)
                        streams.task(device, call, (index, 0, -seq, 0), copies, input_grads, ("B", index, seq))
                    if variables:  # W: deferred by `lag` micro-batches, then summed in order
                        copies, weight_grads = gradient(variables)
                        streams.task(device, call, (index + lag, 1, -seq, 0), copies, weight_grads,
                                     ("W", index, seq))
                        if streams.accumulate and all(isinstance(g, tf.Tensor) for g in weight_grads):
                            weight_grads = streams.sum_weight_gradients(device, call, seq, index, lag,
                                                                        micro_batches, weight_grads)
                return input_grads, weight_grads

            return outputs, grad

        # With no float inputs (integer ids into an Embedding) `stage` has no arguments and
        # still returns the weight gradients. The device scope also covers the IdentityN that
        # custom_gradient adds around the outputs, so outputs stay on the stage.
        with tf.device(device):
            return stage(*[flat[i] for i in slots])

    setattr(layer, _ORIGINAL, original)
    layer.call = call


def unplace_layer_call(layer: keras.layers.Layer) -> None:
    """Restores the layer's own `call`."""
    original = getattr(layer, _ORIGINAL, None)
    if original is not None:
        del layer.call
        delattr(layer, _ORIGINAL)


def colocate_with_inputs(default: str) -> Callable:
    """A graph device function for ops created outside layers inside a replica's step.

    Ops that already have a device (from a layer's stage scope, or an update under its
    variable's device) keep it; an op whose inputs all live on one device goes there (gradient
    sums over micro-batches, the loss on the last stage's output, the micro-batch concat);
    anything else goes to `default` (the replica's first stage).
    """

    def device_fn(op) -> str:
        if op.device:
            return op.device
        devices = {t.device for t in op.inputs if t.device}
        if len(devices) == 1:
            return devices.pop()
        return default

    return device_fn
