"""The TF runtime: eager context, coordination service, call-time values in tf.function, run metadata, profiler
protos, tracking, tf.data."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import tensorflow as tf
from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2 as _coordination_pb2
from tensorflow.python.eager import context as _eager_context
from tensorflow.python.training.saving import saveable_object as _saveable_object
from tensorflow.python.util import _pywrap_util_port

__all__ = ["SavedTensor", "abort_collectives", "add_control_inputs", "call_time_value", "configure_coordination",
           "context_initialized", "dataset_batch_size", "executed_partition_devices", "executed_partition_graphs",
           "onednn_enabled", "outside_any_strategy", "partition_devices", "xspace_proto"]

T = TypeVar("T")


def context_initialized() -> bool:
    """True once TensorFlow has created its runtime (device list fixed, collectives no longer configurable)."""
    return bool(_eager_context.context()._initialized)


def onednn_enabled() -> bool:
    """Whether this TensorFlow runs its CPU kernels and CPU allocator through oneDNN. TF turns it on by itself only
    on CPUs with AVX-512 VNNI/BF16 or AMX (`TF_ENABLE_ONEDNN_OPTS` decides otherwise); without it there are no CPU
    allocator statistics, and bfloat16 matmuls round their partial sums to bfloat16."""
    return bool(_pywrap_util_port.IsMklEnabled())


def configure_coordination(leader: str, jobs: dict[str, int], *, register_timeout_s: float,
                           heartbeat_timeout_s: float, shutdown_timeout_s: float) -> None:
    """Turns on TF's coordination service with our timeouts, before MWMS would with its defaults.

    MWMS configures the service itself only when none is configured, with TF's defaults: a peer that
    never starts is waited for indefinitely (registration timeout off), and a dead peer is noticed only
    after the default heartbeat timeout. `register_timeout_s` bounds the wait for all tasks at start-up;
    `heartbeat_timeout_s` is how long a silent task counts as alive; both errors name the task.
    """
    coordinated = [_coordination_pb2.CoordinatedJob(name=job, num_tasks=n) for job, n in jobs.items()]
    _eager_context.context().configure_coordination_service(
        service_type="standalone", service_leader=leader, enable_health_check=True,
        cluster_register_timeout_in_ms=int(register_timeout_s * 1000),
        heartbeat_timeout_in_ms=int(heartbeat_timeout_s * 1000),
        shutdown_barrier_timeout_in_ms=int(shutdown_timeout_s * 1000),
        coordinated_jobs=coordinated)


def abort_collectives(message: str) -> None:
    """Fails every collective op of this process, running or to come, with DeadlineExceeded(`message`).

    Unlike an op's own `timeout_seconds`, the abort completes a pending op only after its cancelled receive has
    let go of the op (TF 2.21 frees the op's cancellation manager first on its timer path: a use after free that
    can kill the process). Collectives cannot run again in this process afterwards.
    """
    _eager_context.context().abort_collective_ops(tf.errors.DEADLINE_EXCEEDED, message)


def call_time_value(make: Callable[[], tf.Tensor], spec: tf.TensorSpec) -> tf.Tensor | None:
    """While a tf.function is being traced: a placeholder that takes the value `make()` (run eagerly)
    at every call of the function. None outside a function (eagerly, or in a TF1 graph).

    The capture is made in the function graph itself, above any tf.cond / while_loop branch graph,
    so `make()` runs once per call of the function, in the order the values were captured (trace
    order). It is how collectives get instance keys that agree across processes even when the
    processes trace at different moments (TF's CollectiveReplicaLauncher does the same).
    """
    graph = tf.compat.v1.get_default_graph()
    while getattr(graph, "is_control_flow_graph", False):
        graph = graph.outer_graph
    if not getattr(graph, "building_function", False):
        return None
    with graph.as_default():
        return graph.capture_call_time_value(make, spec)


def outside_any_strategy(fn: Callable[[], T]) -> T:
    """Runs `fn()` with no tf.distribute strategy in scope and returns its result.

    TF keeps the strategy stack per thread, so a fresh thread starts in the default strategy: there,
    variables are plain ones on the device in scope instead of being mirrored on every replica.
    Exceptions are re-raised in the caller's thread.
    """
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - re-raised below
            box["error"] = err

    worker = threading.Thread(target=run, name="tfdist-outside-strategy")
    worker.start()
    worker.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


class SavedTensor(tf.__internal__.tracking.Trackable):
    """A Trackable saved by tf.train.Checkpoint as one tensor, like a variable ("VARIABLE_VALUE").

    Subclasses implement `read() -> tf.Tensor` and `write(value)` and set `dtype` and
    `save_device` (where `read` puts its result); a checkpoint written from it reads back into a
    plain tf.Variable of the same shape, and the reverse.
    """

    dtype: tf.DType
    save_device: str = "/cpu:0"

    def read(self) -> tf.Tensor:
        raise NotImplementedError

    def write(self, value) -> None:
        raise NotImplementedError

    def _serialize_to_tensors(self):
        # A deferred read: TF also calls this when *restoring*, only to learn names and dtypes, and a
        # read can be a collective (sharded state across processes) that a restore must not start.
        spec = _saveable_object.SaveSpec(self.read, "", "", dtype=tf.as_dtype(self.dtype), device=self.save_device)
        return {"VARIABLE_VALUE": spec}

    def _restore_from_tensors(self, restored_tensors):
        self.write(restored_tensors["VARIABLE_VALUE"])
        return tf.no_op()


def add_control_inputs(op, control_ops) -> None:
    """Makes graph `op` (already created) wait for `control_ops`. Used by the GPipe stage streams,
    whose backward order is only known once the tape has traced later ops."""
    op._add_control_inputs(list(control_ops))


def dataset_batch_size(dataset) -> int | None:
    """The batch size a tf.data pipeline was batched with: a `.batch(n)` with a constant n found
    walking its input datasets (through zips too), or a static batch dimension; None otherwise.

    Keras' own NumPy-array pipelines slice batches by index and show no batch size."""
    for spec in tf.nest.flatten(getattr(dataset, "element_spec", None)):
        shape = getattr(spec, "shape", None)
        if shape is not None and shape.rank and shape[0] is not None:
            return int(shape[0])
    stack, seen = [dataset], 0
    while stack and seen < 64:
        current = stack.pop()
        seen += 1
        size = getattr(current, "_batch_size", None)
        if size is not None:
            value = tf.get_static_value(size)
            return int(value) if value is not None else None
        inputs = [getattr(current, "_input_dataset", None), *tf.nest.flatten(getattr(current, "_datasets", ()))]
        stack.extend(d for d in inputs if d is not None)
    return None


def executed_partition_graphs(fn: Callable[[], object]) -> list:
    """Runs `fn()` once with TF's run-metadata collection on, and returns the partition graphs (GraphDefs, one per
    function and device, after placement) TF actually executed.

    Only functions instantiated while collecting are reported: call it on the first run of a
    tf.function (or after its first trace)."""
    _eager_context.enable_run_metadata()
    try:
        fn()
        metadata = _eager_context.export_run_metadata()
    finally:
        _eager_context.disable_run_metadata()
    return [partition for graphs in metadata.function_graphs for partition in graphs.partition_graphs]


def executed_partition_devices(fn: Callable[[], object]) -> dict[str, set[str]]:
    """Runs `fn()` once (as `executed_partition_graphs`) and returns node name -> devices of every node TF executed
    (a name used in several functions can map to several devices)."""
    return partition_devices(executed_partition_graphs(fn))


def partition_devices(partitions: list) -> dict[str, set[str]]:
    devices: dict[str, set[str]] = {}
    for partition in partitions:
        for node in partition.node:
            devices.setdefault(node.name, set()).add(node.device)
    return devices


def xspace_proto():
    """The XSpace protobuf class TF's profiler writes (*.xplane.pb)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    return xplane_pb2.XSpace
