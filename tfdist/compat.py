"""Every reach into TensorFlow and Keras private internals, in one place, behind a version check."""

from __future__ import annotations

import itertools
import warnings

import keras
import tensorflow as tf

# Versions this module was written and tested against. A TF or Keras upgrade should only have to
# revisit this file: every `tensorflow.python.*` / `keras.src.*` import in tfdist lives here.
TESTED_TF = ("2.21",)
TESTED_KERAS_MAJOR = 3


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


if _major_minor(tf.__version__) not in TESTED_TF:
    warnings.warn(
        f"tfdist was tested with TensorFlow {', '.join(TESTED_TF)}; found {tf.__version__}. "
        "Private TF internals used by tfdist (tfdist/compat.py) may have moved.",
        RuntimeWarning,
        stacklevel=2,
    )
if int(keras.__version__.split(".")[0]) != TESTED_KERAS_MAJOR:
    raise ImportError(
        f"tfdist needs Keras 3 (the default tf.keras of TF 2.16+); found keras {keras.__version__}. "
        "Install it with: pip install 'keras>=3.15'"
    )


# --- Collective keys -------------------------------------------------------------------------
# MirroredExtended numbers its collective groups from `container_strategy._collective_key_base`.
# Every stock MirroredStrategy starts at 0, so two strategies over different device sets in one
# process join the same group and fail ("joining a group with size 2, but that group has size 4").
# Giving each tfdist strategy its own base keeps them apart (TF's own tests do the same).
_KEY_STRIDE = 100_000
_key_bases = itertools.count(start=_KEY_STRIDE, step=_KEY_STRIDE)


def fresh_collective_key_base() -> int:
    """Returns a collective key base no other tfdist strategy in this process uses."""
    return next(_key_bases)


# --- Keras fit state ---------------------------------------------------------------------------
def keras_initial_epoch(model) -> int:
    """The epoch `fit` starts from: Keras' BackupAndRestore sets the private `model._initial_epoch`
    when it restores a checkpoint (keras/src/callbacks/backup_and_restore.py, `_load_model`)."""
    return int(getattr(model, "_initial_epoch", 0) or 0)


# --- Horovod strategy (tfdist/strategies/horovod.py, tfdist/comm/horovod.py) ------------------
# HorovodStrategy is a MirroredStrategy whose StrategyExtended knows about other processes. Keras
# only sees the public Strategy; the hooks below are the MirroredExtended internals it refines.
def mirrored_extended_class() -> type:
    """TF's `MirroredExtended` (the StrategyExtended behind tf.distribute.MirroredStrategy)."""
    from tensorflow.python.distribute.mirrored_strategy import MirroredExtended

    return MirroredExtended


def distribute_dataset_for_worker(extended, dataset, options, num_workers: int, worker_id: int):
    """`extended`'s distributed dataset, sharded for worker `worker_id` of `num_workers` (as MWMS does).

    Every worker iterates the same global batches; each gets its own 1/num_workers slice of each,
    split again over its local replicas, so a step's global batch is the dataset's batch.
    """
    from tensorflow.python.distribute import input_util

    context = tf.distribute.InputContext(num_input_pipelines=num_workers, input_pipeline_id=worker_id,
                                         num_replicas_in_sync=extended._num_replicas_in_sync)
    return input_util.get_distributed_dataset(
        dataset, extended._input_workers_with_options(options), extended._container_strategy(),
        num_replicas_in_sync=extended._num_replicas_in_sync, input_context=context, options=options)


def distribute_datasets_from_function_for_worker(extended, dataset_fn, options, num_workers: int,
                                                 worker_id: int):
    """`dataset_fn(InputContext)` for worker `worker_id` of `num_workers`, distributed over local replicas."""
    from tensorflow.python.distribute import input_util

    context = tf.distribute.InputContext(num_input_pipelines=num_workers, input_pipeline_id=worker_id,
                                         num_replicas_in_sync=extended._num_replicas_in_sync)
    return input_util.get_distributed_datasets_from_function(
        dataset_fn, extended._input_workers_with_options(options), [context], extended._container_strategy(),
        options)


def regroup_per_replica(values: list):
    """Wraps one value per local replica into a PerReplica (TF's distribute_utils.regroup)."""
    from tensorflow.python.distribute import distribute_utils

    return distribute_utils.regroup(values, always_wrap=True)


def regroup_mirrored(values: list):
    """Wraps one value per local device into a Mirrored value."""
    from tensorflow.python.distribute import distribute_utils, values as values_lib

    return distribute_utils.regroup(values, wrap_class=values_lib.Mirrored)


def is_mirrored(value) -> bool:
    """True for Mirrored values/variables (already equal on every local replica)."""
    from tensorflow.python.distribute import distribute_utils

    return distribute_utils.is_mirrored(value)


def reduce_non_distributed_value(reduce_op, value, destinations, num_replicas: int):
    """TF's rule for reducing a plain (non-PerReplica) value, e.g. a Python number, over replicas."""
    from tensorflow.python.distribute import cross_device_ops

    return cross_device_ops.reduce_non_distributed_value(reduce_op, value, destinations, num_replicas)


def local_values(value) -> list:
    """The per-local-device components of a DistributedValues (or [value] for a plain tensor)."""
    if isinstance(value, tf.distribute.DistributedValues):
        return list(value.values)
    return [value]


def devices_of(destinations) -> list[str]:
    """Canonical device names of a `destinations` argument of CrossDeviceOps (value, var or device)."""
    from tensorflow.python.distribute import cross_device_ops

    return list(cross_device_ops.get_devices_from(destinations))


# --- Optimizer-state partitioning (tfdist.sharding.zero) -----------------------------------------
# Keras 3 gives a strategy no handle on the optimizer before it creates its slots. Every Keras
# optimizer's build() calls BaseOptimizer.build() (via super()) before it creates any slot, so a
# hook there can turn the optimizer into a ZeRO one in time. The hook decides; for optimizers
# that are not under a ZeRO strategy it returns without doing anything.
_build_hooks: list = []


def install_optimizer_build_hook(hook) -> None:
    """Calls `hook(optimizer, variables)` at the start of every Keras optimizer's base build().

    Installed once per hook (idempotent); hooks run in installation order.
    """
    from keras.src.optimizers import base_optimizer

    if hook in _build_hooks:
        return
    _build_hooks.append(hook)
    base = base_optimizer.BaseOptimizer
    if getattr(base.build, "_tfdist_hooked", False):
        return
    original = base.build

    def build(self, variables):
        for h in list(_build_hooks):
            h(self, variables)
        return original(self, variables)

    build._tfdist_hooked = True
    build.__wrapped__ = original
    base.build = build


def optimizer_strategy(optimizer) -> tf.distribute.Strategy | None:
    """The tf.distribute strategy a Keras TF optimizer captured when it was created."""
    return getattr(optimizer, "_distribution_strategy", None)


def optimizer_variable_index(optimizer, variable) -> int:
    """Position of `variable` in the list the Keras optimizer was built with."""
    return optimizer._get_variable_index(variable)


def optimizer_all_reduce_sum(optimizer, grads: list, variables: list) -> list:
    """Keras' own gradient all-reduce (TFOptimizer._all_reduce_sum_gradients), in replica context.

    ZeRO-1 reduces exactly like stage 0 through this, so both see bit-identical gradients.
    """
    pairs = optimizer._all_reduce_sum_gradients(list(zip(grads, [getattr(v, "value", v) for v in variables])))
    return [g for g, _ in pairs]


def optimizer_apply_weight_decay(optimizer, variables: list) -> None:
    """Keras' decoupled weight decay of the optimizer (honours exclude_from_weight_decay)."""
    optimizer._apply_weight_decay(variables)


def override_method(obj, name: str, function) -> None:
    """Binds `function(obj, ...)` as `obj.name` on this instance only (no Keras/TF attribute tracking)."""
    import types

    object.__setattr__(obj, name, types.MethodType(function, obj))


class SavedTensor(tf.__internal__.tracking.Trackable):
    """A Trackable saved by tf.train.Checkpoint as one tensor, like a variable ("VARIABLE_VALUE").

    Subclasses implement `read() -> tf.Tensor` and `write(value)`; a checkpoint written from it
    reads back into a plain tf.Variable of the same shape, and the reverse.
    """

    def read(self) -> tf.Tensor:
        raise NotImplementedError

    def write(self, value) -> None:
        raise NotImplementedError

    def _serialize_to_tensors(self):
        return {"VARIABLE_VALUE": self.read()}

    def _restore_from_tensors(self, restored_tensors):
        self.write(restored_tensors["VARIABLE_VALUE"])
        return tf.no_op()


# --- Multi-worker collectives (tfdist.MultiWorkerMirroredStrategy) ---------------------------
from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2 as _coordination_pb2  # noqa: E402
from tensorflow.python.distribute import collective_all_reduce_strategy as _collective_strategy  # noqa: E402
from tensorflow.python.eager import context as _eager_context  # noqa: E402


def tf_context_initialized() -> bool:
    """True once TensorFlow has created its runtime (device list fixed, collectives no longer configurable)."""
    return bool(_eager_context.context()._initialized)


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


class CollectiveExtended(_collective_strategy.CollectiveAllReduceExtended):
    """MWMS's StrategyExtended with a chosen set of local devices per worker.

    Stock MWMS takes every GPU of a worker, or else one CPU, so N workers x M logical CPUs is out of
    reach. `local_device_type`/`local_indices` name the devices each worker contributes; the worker
    prefix (/job:worker/task:i) is added by TF. None keeps TF's choice.
    """

    def __init__(self, container_strategy, cluster_resolver, communication_options,
                 local_device_type: str | None = None, local_indices: tuple[int, ...] | None = None):
        self._tfdist_local = (local_device_type, local_indices)
        super().__init__(container_strategy, cluster_resolver=cluster_resolver,
                         communication_options=communication_options)

    def _initialize_local_devices(self, cluster_resolver, worker_device):
        kind, indices = self._tfdist_local
        if kind is None:
            return super()._initialize_local_devices(cluster_resolver, worker_device)
        return tuple(f"{worker_device}/device:{kind}:{i}" for i in indices), kind


def strategy_task(strategy) -> tuple[str | None, int | None, int]:
    """(task_type, task_id, number of workers) of a MultiWorkerMirroredStrategy; (None, None, 1) if local."""
    ext = strategy.extended
    return getattr(ext, "_task_type", None), getattr(ext, "_task_id", None), getattr(ext, "_num_workers", 1)


def set_initial_epoch(model: keras.Model, epoch: int) -> None:
    """Makes the next `fit` start at `epoch` (what keras.callbacks.BackupAndRestore does on restore)."""
    model._initial_epoch = epoch


# --- Layer placement (tfdist/placement, tfdist/strategies/layer_placement.py) ----------------
# Model parallelism needs a few things Keras 3 and tf.distribute keep private: the layer graph of
# a functional model, swapping the tf.Variable behind a Keras variable (placing a variable is only
# possible when it is created), the mirrored-strategy internals a placement-aware strategy extends,
# and TF's executed-graph and profiler records that prove where ops ran.


# (mirrored_extended_class, above in the Horovod section, serves placement too.)


def init_strategy(strategy: tf.distribute.Strategy, extended) -> None:
    """Runs the base `tf.distribute.Strategy.__init__` with a custom `extended` (what
    MirroredStrategy.__init__ does after building its own MirroredExtended)."""
    from tensorflow.python.distribute import distribute_lib

    distribute_lib.Strategy.__init__(strategy, extended)


class DeviceGroup:
    """Stands in for a mirrored variable as `colocate_with` of MirroredExtended._create_variable,
    which reads only `._devices`: the new variable gets one component per listed device."""

    def __init__(self, devices):
        self._devices = tuple(devices)


def model_graph(model) -> list[tuple]:
    """The layer graph of a built Keras model, in topological order.

    Returns (layer, parent_layers, input_shapes, output_shapes) per layer (InputLayers left out);
    shapes include the batch dimension (None). Sequential models are read through the functional
    model Keras builds inside them. A layer called twice lists the parents and shapes of all calls.
    """
    graph = getattr(model, "_functional", None) or model
    if not hasattr(graph, "_operations") or not hasattr(graph, "_nodes"):
        raise TypeError(f"{type(model).__name__} has no layer graph: build it with keras.Input "
                        "(Sequential or functional API) before placing it")
    from keras.src.ops.function import make_node_key

    input_layer = keras.layers.InputLayer
    out = []
    for op in graph._operations:
        if isinstance(op, input_layer):
            continue
        parents, in_shapes, out_shapes = [], [], []
        for i, node in enumerate(op._inbound_nodes):
            if make_node_key(op, i) not in graph._nodes:  # a call from another model
                continue
            for kt in node.arguments.keras_tensors:
                parent = kt._keras_history.operation
                in_shapes.append(tuple(kt.shape))
                if parent is not None and not isinstance(parent, input_layer) and parent not in parents:
                    parents.append(parent)
            out_shapes.extend(tuple(t.shape) for t in node.outputs)
        out.append((op, parents, in_shapes, out_shapes))
    return out


def swap_variable_value(keras_variable, new_tf_variable) -> None:
    """Makes a Keras variable use `new_tf_variable` (same shape/dtype) from now on.

    Keras 3 keeps the backend variable in `_value`; everything else (path, trainable, the
    optimizer's slot lists, .keras save/load) goes through the Keras variable object."""
    keras_variable._value = new_tf_variable


def reindex_optimizer(optimizer) -> None:
    """Rebuilds a built Keras optimizer's variable index after variables were swapped.

    The TF backend keys trainable variables by the unique id of the tf.Variable behind them
    (TFOptimizer._var_key), so swapped variables must be re-registered."""
    if not getattr(optimizer, "built", False):
        return
    optimizer._trainable_variables_indices = {
        optimizer._var_key(v): i for i, v in enumerate(optimizer._trainable_variables)
    }


def keras_model_of_step(fn, _depth: int = 0):
    """The Keras model whose step `fn` is, or None.

    Keras' TF trainer calls `strategy.run(self.train_step, ...)` (a bound method) for fit and
    evaluate, and `strategy.run(one_step_on_data, ...)` (a closure over the model, possibly a
    tf.function or wrapped) for predict. The strategy uses this to find the model on its first
    step and place it before any of its variables is read."""
    import inspect

    if fn is None or _depth > 4:
        return None
    fn = getattr(fn, "python_function", fn)  # tf.function
    try:
        fn = inspect.unwrap(fn)
    except ValueError:
        return None
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, keras.Model):
        return owner
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # empty cell
            continue
        if isinstance(value, keras.Model):
            return value
        if callable(value) and not isinstance(value, type):
            found = keras_model_of_step(value, _depth + 1)
            if found is not None:
                return found
    return None


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
        stack.extend(d for d in [getattr(current, "_input_dataset", None), *tf.nest.flatten(getattr(current, "_datasets", ()))]
                     if d is not None)
    return None


def executed_partition_devices(fn) -> dict[str, set[str]]:
    """Runs `fn()` once with TF's run-metadata collection on, and returns node name -> devices of
    every node in the partition graphs TF actually executed (after placement; a name used in
    several functions can map to several devices).

    Only functions instantiated while collecting are reported: call it on the first run of a
    tf.function (or after its first trace)."""
    from tensorflow.python.eager import context

    context.enable_run_metadata()
    try:
        fn()
        metadata = context.export_run_metadata()
    finally:
        context.disable_run_metadata()
    devices: dict[str, set[str]] = {}
    for graphs in metadata.function_graphs:
        for partition in graphs.partition_graphs:
            for node in partition.node:
                devices.setdefault(node.name, set()).add(node.device)
    return devices


def xspace_proto():
    """The XSpace protobuf class TF's profiler writes (*.xplane.pb)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    return xplane_pb2.XSpace


def variable_strategy(variable):
    """The tf.distribute strategy a (distributed) variable was created in, or None."""
    return getattr(variable, "_distribute_strategy", None)


def add_control_inputs(op, control_ops) -> None:
    """Makes graph `op` (already created) wait for `control_ops`. Used by the GPipe stage streams,
    whose backward order is only known once the tape has traced later ops."""
    op._add_control_inputs(list(control_ops))


# --- ZeRO across processes (tfdist.comm.tf_shards) -------------------------------------------
# The ZeRO engine's collectives under MultiWorkerMirroredStrategy are TF's V2 collectives, launched
# the way MWMS launches its own (cross_device_utils.CollectiveReplicaLauncher: instance keys taken
# at call time, so workers that trace at different moments still agree). They get their own group
# key, half a key stride above the strategy's (MWMS numbers its groups from base + 1 upwards), so
# they never share instance keys with the strategy's all-reduces. They share the strategy's
# per-device ordering token: every collective on a device, ours and the strategy's, then runs in
# program order, the same on every worker (unordered V2 collectives in one tf.function deadlock).
_ZERO_KEY_OFFSET = _KEY_STRIDE // 2


def zero_collective_launchers(strategy) -> list:
    """One collective launcher per local replica of a MultiWorkerMirroredStrategy, in a group of
    all its replicas, ordered together with the strategy's own collectives on each device."""
    from tensorflow.python.distribute import cross_device_utils

    ext = strategy.extended
    ops = ext._cross_device_ops
    keys = cross_device_utils.CollectiveKeys(group_key_start=1 + ext._collective_key_base + _ZERO_KEY_OFFSET)
    group_key = keys.get_group_key(list(ops._devices))
    launchers = []
    for device, own in zip(ops._devices, ops._launchers):
        launcher = cross_device_utils.CollectiveReplicaLauncher(group_key, ops._group_size, keys, device,
                                                                ops._options)
        launcher._ordering_token = own._ordering_token
        launchers.append(launcher)
    return launchers


def launcher_device(launcher) -> str:
    """The device a collective launcher runs on."""
    return launcher._device


def launcher_all_reduce_sum(launcher, tensor: tf.Tensor) -> tf.Tensor:
    """CollectiveReduceV2 (sum) of `tensor` over the launcher's group."""
    return launcher.all_reduce(tensor)


def launcher_all_gather(launcher, tensor: tf.Tensor) -> tf.Tensor:
    """CollectiveGatherV2: the group's tensors concatenated along axis 0, in group-rank order."""
    return launcher._all_gather(tensor, None)


def launcher_all_to_all(launcher, tensor: tf.Tensor) -> tf.Tensor:
    """CollectiveAllToAllV2: part r (of group_size equal parts along axis 0) of `tensor` goes to
    group rank r; the result holds, at position r, what rank r sent here."""
    from tensorflow.python.ops import collective_ops

    instance_key = launcher._next_instance_key()
    options = launcher._options
    with tf.device(launcher._device):
        return collective_ops.all_to_all_v2(
            tensor, launcher._group_size, launcher._group_key, instance_key,
            communication_hint=options.implementation.value, timeout=options.timeout_seconds or 0,
            ordering_token=launcher._get_ordering_token())


def first_global_replica_id(strategy) -> int:
    """Global replica index (replica_id_in_sync_group) of this worker's first local replica:
    MWMS numbers replicas worker by worker (chief first), local devices in order."""
    return int(strategy.extended._get_replica_id_in_sync_group(0))
