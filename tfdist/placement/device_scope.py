"""Runs a layer's forward and backward ops on its stage's device, with explicit transfers in and out."""

from __future__ import annotations

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
    """One op stream per device in a traced step, in GPipe order: a placed layer call on a device
    starts after the previous one there has finished (forward: in trace order, which is
    micro-batch by micro-batch); in the backward, micro-batch m's gradients on a device start
    after all of micro-batch m-1's gradients there.

    This is what a real accelerator does (one compute stream runs one kernel after another) and
    what GPipe's clock schedule assumes: stage k works on micro-batch m while stage k+1 works on
    m+1. Logical CPU devices of one process share one inter-op thread pool instead, so without it
    the executor runs two micro-batches of the *same* stage on both cores while the other stage
    idles (measured: both threads on stage 1, then both on stage 0, in the backward). The tape
    traces the backward layer by layer (every micro-batch's last layer first), so backward edges
    are added to already created ops once both ends exist. No cycle: forward edges point from an
    earlier traced op to a later one, backward edges from micro-batch m-1 to m, which never
    depends on m's gradients.

    Example:
        >>> streams = StageStreams()
        >>> place_layer_call(layer, lambda: "/device:CPU:1", streams)
    """

    def __init__(self) -> None:
        self._tails: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> {device: tensors}
        self._backward: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> {(dev, m): ...}
        self._lock = threading.Lock()  # MirroredStrategy traces replicas in threads
        self._local = threading.local()

    @contextlib.contextmanager
    def micro_batch(self, index: int):
        """Layer calls traced inside belong to micro-batch `index` (set by the pipelined model call)."""
        previous = getattr(self._local, "index", None)
        self._local.index = index
        try:
            yield
        finally:
            self._local.index = previous

    def current_micro_batch(self) -> int | None:
        return getattr(self._local, "index", None)

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

    def backward(self, device: str, index: int | None, entries: list, exits: list) -> None:
        """Micro-batch `index`'s backward on `device` starts with the ops `entries` and ends with
        the tensors `exits`: order it after micro-batch index-1 there, and index+1 after it."""
        if index is None:
            return
        entries = [t.op for t in entries if tf.is_tensor(t)]
        exits = [t.op for t in exits if tf.is_tensor(t)]
        graph = tf.compat.v1.get_default_graph()
        with self._lock:
            book = self._backward.setdefault(graph, {})
            mine = book.setdefault((device, index), ([], []))
            before = book.get((device, index - 1), ([], []))[1]
            after = book.get((device, index + 1), ([], []))[0]
            mine[0].extend(entries)
            mine[1].extend(exits)
        for op in entries:
            if before:
                compat.add_control_inputs(op, before)
        for op in after:
            if exits:
                compat.add_control_inputs(op, exits)


def place_layer_call(layer: keras.layers.Layer, device_for_replica: Callable[[], str],
                     streams: StageStreams | None = None) -> None:
    """Wraps `layer.call` so that, in a traced (graph) step, its ops run on one device.

    `device_for_replica()` names the device for the calling replica (the stage's device in that
    replica's pipeline). In graph mode the layer runs inside a `tf.custom_gradient`:
    - inputs are copied to the device explicitly (`tf.identity` under `tf.device`), so a tensor
      crossing stages is one visible transfer;
    - the forward ops run under `tf.device` and are recorded by an inner tape;
    - the backward (input and weight gradients) is computed from that tape under the same device,
      after an explicit copy of the incoming gradients. Without this, TF builds every backward op
      where `tape.gradient` is called, i.e. on the first device.
    With `streams`, calls on one device are chained in trace order (see `StageStreams`).
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
        index = streams.current_micro_batch() if streams else None

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
                with tf.GradientTape() as tape:
                    tape.watch(local)
                    outputs = run(local)
            flat_out = tf.nest.flatten(outputs)
            if streams:
                streams.record(device, flat_out)

            def grad(*dys, variables=None):
                variables = list(variables or [])
                with tf.device(device), tf.name_scope(f"{layer.name}_backward"):
                    # Only float outputs carry gradients (an argmax or lookup output has none).
                    pairs = [(y, tf.identity(d)) for y, d in zip(flat_out, dys)
                             if d is not None and _differentiable(y)]
                    grads = tape.gradient([y for y, _ in pairs], local + variables,
                                          output_gradients=[d for _, d in pairs],
                                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
                if streams:
                    streams.backward(device, index, [d for _, d in pairs], grads)
                return grads[:len(local)], grads[len(local):]

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
