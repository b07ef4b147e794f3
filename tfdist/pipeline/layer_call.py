"""Runs a layer's forward and backward ops on its stage's device, with explicit transfers in and out."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import keras
import tensorflow as tf

from tfdist._compat.captured_inputs import captured_inputs
from tfdist.pipeline.streams import StageStreams, TaskKey

__all__ = ["place_layer_call", "colocate_with_inputs", "canonical_device"]

# layer -> its own bound `call`, for layers whose call this module wrapped (on that instance only)
_original_calls: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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
    original = _original_calls.get(layer) or layer.call

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

        # Weights ZeRO-3 gathered for this layer, which it reads by closure: differentiated like inputs.
        captured = captured_inputs()

        @tf.custom_gradient
        def stage(*tensors):
            tensors, held = tensors[:len(slots)], list(tensors[len(slots):])
            waits = streams.after_previous(device) if streams else []
            with tf.device(device), tf.name_scope("to_stage"), tf.control_dependencies(waits):
                local = [tf.identity(t) for t in tensors]
            with tf.device(device):
                with tf.GradientTape(persistent=context is not None) as tape:
                    tape.watch(local + held)
                    outputs = run(local)
            local = local + held  # their gradients go where the inputs' go
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
                        streams.task(device, call, TaskKey.input_gradient(index, seq), copies, input_grads,
                                     ("B", index, seq))
                    if variables:  # W: deferred by `lag` micro-batches, then summed in order
                        copies, weight_grads = gradient(variables)
                        streams.task(device, call, TaskKey.weight_gradient(index, seq, lag), copies, weight_grads,
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
            return stage(*[flat[i] for i in slots], *captured)

    _original_calls[layer] = original
    layer.call = call


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
