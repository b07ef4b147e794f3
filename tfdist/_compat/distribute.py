"""tf.distribute internals: StrategyExtended subclasses, collective keys and launchers, per-worker input."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import tensorflow as tf
from tensorflow.python.distribute import collective_all_reduce_strategy as _collective_strategy
from tensorflow.python.distribute import cross_device_ops as _cross_device_ops
from tensorflow.python.distribute import cross_device_utils as _cross_device_utils
from tensorflow.python.distribute import distribute_lib as _distribute_lib
from tensorflow.python.distribute import distribute_utils as _distribute_utils
from tensorflow.python.distribute import input_util as _input_util
from tensorflow.python.distribute.mirrored_strategy import MirroredExtended
from tensorflow.python.ops import collective_ops as _collective_ops

from tfdist._compat.ring import subdivide_ring

__all__ = [
    "COMM_KEY_BASE", "CollectiveExtended", "MirroredExtended", "MultiProcessExtended", "PipelineExtended",
    "PlacementExtended",
    "ProcessCrossDeviceOps", "ProcessGroup", "collective_launchers", "collective_server", "devices_of",
    "first_global_replica_id", "init_strategy", "is_mirrored", "launcher_all_gather", "launcher_all_reduce_sum",
    "launcher_all_to_all", "launcher_device", "launcher_timeout", "local_values",
    "reduce_non_distributed_value", "regroup_per_replica", "strategy_task", "uses_merge_call", "variable_strategy",
]

# --- Strategy construction and collective keys ----------------------------------------------------
# MirroredExtended numbers its collective groups from `container_strategy._collective_key_base`. Every stock
# strategy starts at 0, so two over different device sets in one process join the same group and fail ("joining
# a group with size 2, but that group has size 4"); each tfdist strategy gets its own base (as TF's tests do).
#
# Group keys from COMM_KEY_BASE up belong to tfdist.comm's collectives for users (the MWMS that starts
# its server numbers its few groups from COMM_KEY_BASE + 1; its world, new_group()s and send/recv pairs
# lie above): constants, so every process agrees on them, and above every strategy's keys.
_KEY_STRIDE = 100_000
_key_bases = itertools.count(start=_KEY_STRIDE, step=_KEY_STRIDE)
COMM_KEY_BASE = 1 << 30


def init_strategy(strategy: tf.distribute.Strategy, make_extended: Callable[[], object]) -> None:
    """Gives `strategy` its own collective keys, builds its StrategyExtended with `make_extended()`
    and runs the base `tf.distribute.Strategy.__init__` with it (what MirroredStrategy.__init__
    does with its own MirroredExtended). The one way every tfdist strategy is initialised."""
    base = next(_key_bases)
    if base + _KEY_STRIDE > COMM_KEY_BASE:
        raise RuntimeError(f"tfdist has created {base // _KEY_STRIDE - 1} strategies in this process; the next one's "
                           "collective keys would reach tfdist.comm's (from 2**30). Create strategies once and reuse "
                           "them.")
    strategy._collective_key_base = base
    _distribute_lib.Strategy.__init__(strategy, make_extended())


class _ServerStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    """A stock MultiWorkerMirroredStrategy whose own groups (its start-up barrier) take keys from
    COMM_KEY_BASE + 1, not 1, 2, ... like every stock strategy's: every group key tfdist.comm's TF
    backend uses lies in its own range."""

    _collective_key_base = COMM_KEY_BASE


def collective_server(resolver: tf.distribute.cluster_resolver.ClusterResolver,
                      options: tf.distribute.experimental.CommunicationOptions) -> tf.distribute.Strategy:
    """Starts this process's gRPC server and TF's collective ops for the cluster of `resolver` (blocks
    until every task has started: MWMS's start-up barrier). tfdist.comm's TF backend keeps the result
    only so the server lives; it runs its own collectives with keys from COMM_KEY_BASE up."""
    return _ServerStrategy(resolver, communication_options=options)


def collective_key_base(strategy: tf.distribute.Strategy) -> int:
    """The first collective key of `strategy`'s groups."""
    return int(strategy._collective_key_base)


# --- Values ----------------------------------------------------------------------------------------
def regroup_per_replica(values: list):
    """Wraps one value per local replica into a PerReplica (TF's distribute_utils.regroup)."""
    return _distribute_utils.regroup(values, always_wrap=True)


def uses_merge_call(strategy: tf.distribute.Strategy) -> bool:
    """True when the strategy's replicas meet in a merge_call (several local replicas), which cannot sit inside
    tf.cond (Keras' gradient accumulation puts its update there)."""
    return bool(strategy.extended._use_merge_call())


def is_mirrored(value) -> bool:
    """True for Mirrored values/variables (already equal on every local replica)."""
    return _distribute_utils.is_mirrored(value)


def reduce_non_distributed_value(reduce_op, value, destinations, num_replicas: int):
    """TF's rule for reducing a plain (non-PerReplica) value, e.g. a Python number, over replicas."""
    return _cross_device_ops.reduce_non_distributed_value(reduce_op, value, destinations, num_replicas)


def local_values(value) -> list:
    """The per-local-device components of a DistributedValues (or [value] for a plain tensor)."""
    if isinstance(value, tf.distribute.DistributedValues):
        return list(value.values)
    return [value]


def devices_of(destinations) -> list[str]:
    """Canonical device names of a `destinations` argument of CrossDeviceOps (value, var or device)."""
    return list(_cross_device_ops.get_devices_from(destinations))


def variable_strategy(variable):
    """The tf.distribute strategy a (distributed) variable was created in, or None."""
    return getattr(variable, "_distribute_strategy", None)


# --- Cross-device ops that span processes -----------------------------------------------------------
class ProcessCrossDeviceOps(tf.distribute.CrossDeviceOps):
    """A CrossDeviceOps whose reductions span `num_processes` processes.

    TF's `reduce`/`batch_reduce` copy instead of reducing when the strategy has one between-graph
    worker and one local value: with one device per process that would skip the all-reduce. This
    base reports `num_processes` there. Subclasses implement the public `reduce_implementation`,
    `batch_reduce_implementation` and `gather_implementation(value, destinations, axis)`.
    """

    num_processes: int = 1

    @property
    def _num_between_graph_workers(self) -> int:
        return self.num_processes

    def _gather_implementation(self, per_replica_value, destinations, axis, options):
        del options
        return self.gather_implementation(per_replica_value, destinations, axis)

    def gather_implementation(self, per_replica_value, destinations, axis):
        raise NotImplementedError


class ProcessGroup(Protocol):
    """What `MultiProcessExtended` needs from the processes it spans (e.g. a Horovod job)."""

    rank: int
    size: int

    def on_variable_created(self, variable) -> None:
        """Makes a new variable start equal on every process (called once per variable, every rank)."""


class MultiProcessExtended(MirroredExtended):
    """MirroredExtended over this process's devices whose replicas are those of every process.

    Replica numbers are global (rank * local devices + local index), `num_replicas_in_sync` counts
    every process, every reduction goes through `cross_device_ops` (which span the processes and
    offer `replica_all_reduce(reduce_op, values)` for the no-merge-call path), input is sharded by
    (size, rank) as MultiWorkerMirroredStrategy does, and `group.on_variable_created` runs for every
    new variable.
    """

    def __init__(self, container_strategy, devices: Sequence[str], cross_device_ops, group: ProcessGroup):
        self.group = group
        super().__init__(container_strategy, devices=list(devices), cross_device_ops=cross_device_ops)

    # -- replicas: global count, global ids --------------------------------------------------------
    @property
    def _num_replicas_in_sync(self) -> int:
        return len(self._devices) * self.group.size

    def _get_replica_id_in_sync_group(self, replica_id: int) -> int:
        return self.group.rank * len(self._devices) + replica_id

    def _get_local_replica_id(self, replica_id_in_sync_group: int) -> int:
        return replica_id_in_sync_group - self.group.rank * len(self._devices)

    def _in_multi_worker_mode(self) -> bool:
        return self.group.size > 1

    # -- reductions: everything through the cross-process ops -------------------------------------
    def _get_cross_device_ops(self, value):
        return self._cross_device_ops  # every dtype, every destination: it spans the processes

    def _use_merge_call(self) -> bool:
        # One device per process: replicas reduce right where they run, with no merge_call. That
        # is what lets an all-reduce sit inside tf.cond, as Keras 3's gradient_accumulation_steps
        # needs (it reduces only on update steps). Several local devices need merge_call to meet
        # in one thread first (as in stock MirroredStrategy).
        return len(self._devices) > 1

    def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
        if self._use_merge_call():
            return super()._replica_ctx_all_reduce(reduce_op, value, options)
        flat = tf.nest.flatten(value)
        return tf.nest.pack_sequence_as(value, self._cross_device_ops.replica_all_reduce(reduce_op, flat))

    def _reduce_to(self, reduce_op, value, destinations, options):
        # MirroredExtended sends reductions to a CPU destination (metrics, strategy.reduce) through a
        # local ReductionToOneDevice; here they go through the cross-process ops too.
        if is_mirrored(value) and reduce_op == tf.distribute.ReduceOp.MEAN:
            return value

        def one(v):
            if not isinstance(v, tf.distribute.DistributedValues):
                if self.group.size == 1:
                    return reduce_non_distributed_value(reduce_op, v, destinations, len(self._devices))
                # As in MultiWorkerMirroredStrategy, a plain value is this process's contribution
                # (tf.data uses a SUM of one to agree across workers on whether data is left).
                v = tf.convert_to_tensor(v)
            return self._cross_device_ops.reduce(reduce_op, v, destinations=destinations)

        return tf.nest.map_structure(one, value)

    # -- input: each process reads its own shard --------------------------------------------------
    def _input_context(self) -> tf.distribute.InputContext:
        return tf.distribute.InputContext(num_input_pipelines=self.group.size, input_pipeline_id=self.group.rank,
                                          num_replicas_in_sync=self._num_replicas_in_sync)

    def _experimental_distribute_dataset(self, dataset, options):
        # Every process iterates the same global batches; each gets its own 1/size slice of each,
        # split again over its local replicas, so a step's global batch is the dataset's batch.
        return _input_util.get_distributed_dataset(
            dataset, self._input_workers_with_options(options), self._container_strategy(),
            num_replicas_in_sync=self._num_replicas_in_sync, input_context=self._input_context(), options=options)

    def _distribute_datasets_from_function(self, dataset_fn, options):
        return _input_util.get_distributed_datasets_from_function(
            dataset_fn, self._input_workers_with_options(options), [self._input_context()],
            self._container_strategy(), options)

    def _experimental_distribute_values_from_function(self, value_fn):
        n = len(self._devices)
        return regroup_per_replica([
            value_fn(tf.distribute.experimental.ValueContext(self.group.rank * n + i, self._num_replicas_in_sync))
            for i in range(n)])

    # -- variables: identical start on every process -----------------------------------------------
    def _create_variable(self, next_creator, **kwargs):
        var = super()._create_variable(next_creator, **kwargs)
        if self.group.size > 1:
            self.group.on_variable_created(var)
        return var


class _DeviceGroup:
    """Stands in for a mirrored variable as `colocate_with` of MirroredExtended._create_variable,
    which reads only `._devices`: the new variable gets one component per listed device."""

    def __init__(self, devices):
        self._devices = tuple(devices)


class PlacementExtended(MirroredExtended):
    """MirroredExtended whose replicas each span a pipeline of devices.

    A replica's "device" (where its step starts, and its data arrives) is its first stage; a
    variable is mirrored over one device per replica: its layer's stage in every pipeline. Inside
    `creating_on(devices)` new variables get one component per device of `devices`; optimizer slots
    (created colocated with a variable) are remembered, so they can follow their variable when it moves.
    """

    def __init__(self, container_strategy, devices: Sequence[str], cross_device_ops):
        super().__init__(container_strategy, devices=list(devices), cross_device_ops=cross_device_ops)
        self._target_devices: list[str] | None = None
        self._slot_references: dict[int, tuple] = {}  # id(slot var) -> (slot var, reference var)

    @contextlib.contextmanager
    def creating_on(self, devices: Sequence[str]) -> Iterator[None]:
        self._target_devices = list(devices)
        try:
            yield
        finally:
            self._target_devices = None

    def slot_reference(self, variable):
        """The variable an optimizer slot was created next to, or None if `variable` is no slot."""
        entry = self._slot_references.get(id(variable))
        return entry[1] if entry is not None and entry[0] is variable else None

    def _create_variable(self, next_creator, **kwargs):
        reference = kwargs.get("colocate_with")
        if reference is None and self._target_devices is not None:
            kwargs["colocate_with"] = _DeviceGroup(self._target_devices)
        var = super()._create_variable(next_creator, **kwargs)
        if reference is not None:
            self._slot_references[id(var)] = (var, reference)
        return var


class PipelineExtended(PlacementExtended):
    """PlacementExtended of LayerPlacementStrategy: with one pipeline (one replica) there is nothing for a
    merge_call to gather, and without it an update can sit inside tf.cond, as Keras 3's
    gradient_accumulation_steps needs. (Meshes keep merge_call: their rows' collectives are keyed by it.)"""

    def _use_merge_call(self) -> bool:
        return len(self._devices) > 1 and super()._use_merge_call()


# --- MultiWorkerMirroredStrategy ------------------------------------------------------------------
class CollectiveExtended(_collective_strategy.CollectiveAllReduceExtended):
    """MWMS's StrategyExtended with a chosen set of local devices per worker.

    Stock MWMS takes every GPU of a worker, or else one CPU, so N workers x M logical CPUs is out of
    reach. `local_device_type`/`local_indices` name the devices each worker contributes; the worker
    prefix (/job:worker/task:i) is added by TF. None keeps TF's choice.
    """

    def __init__(self, container_strategy, cluster_resolver, communication_options,
                 local_device_type: str | None = None, local_indices: tuple[int, ...] | None = None,
                 ring_piece_bytes: int | None = None):
        self._tfdist_local = (local_device_type, local_indices)
        self._tfdist_ring_piece_bytes = ring_piece_bytes
        super().__init__(container_strategy, cluster_resolver=cluster_resolver,
                         communication_options=communication_options)
        subdivide_ring(self, ring_piece_bytes)

    def _configure(self, *args, **kwargs):  # rebuilds the cross-device ops: every worker subdivides again
        super()._configure(*args, **kwargs)
        subdivide_ring(self, self._tfdist_ring_piece_bytes)

    def _initialize_local_devices(self, cluster_resolver, worker_device):
        kind, indices = self._tfdist_local
        if kind is None:
            return super()._initialize_local_devices(cluster_resolver, worker_device)
        return tuple(f"{worker_device}/device:{kind}:{i}" for i in indices), kind


def strategy_task(strategy) -> tuple[str | None, int | None, int]:
    """(task_type, task_id, number of workers) of a MultiWorkerMirroredStrategy; (None, None, 1) if local."""
    ext = strategy.extended
    return getattr(ext, "_task_type", None), getattr(ext, "_task_id", None), getattr(ext, "_num_workers", 1)


def first_global_replica_id(strategy) -> int:
    """Global replica index (replica_id_in_sync_group) of this worker's first local replica:
    MWMS numbers replicas worker by worker (chief first), local devices in order."""
    return int(strategy.extended._get_replica_id_in_sync_group(0))


# The ZeRO engine's collectives under MultiWorkerMirroredStrategy are TF's V2 collectives, launched
# the way MWMS launches its own (cross_device_utils.CollectiveReplicaLauncher: instance keys taken
# at call time, so workers that trace at different moments still agree). They get their own group
# key, half a key stride above the strategy's (MWMS numbers its groups from base + 1 upwards), so
# they never share instance keys with the strategy's all-reduces. They share the strategy's
# per-device ordering token: every collective on a device, ours and the strategy's, then runs in
# program order, the same on every worker (unordered V2 collectives in one tf.function deadlock).
_OWN_GROUP_OFFSET = _KEY_STRIDE // 2


def collective_launchers(strategy) -> list:
    """One collective launcher per local replica of a MultiWorkerMirroredStrategy, in a group of
    all its replicas, ordered together with the strategy's own collectives on each device."""
    ext = strategy.extended
    ops = ext._cross_device_ops
    keys = _cross_device_utils.CollectiveKeys(group_key_start=1 + ext._collective_key_base + _OWN_GROUP_OFFSET)
    group_key = keys.get_group_key(list(ops._devices))
    launchers = []
    for device, own in zip(ops._devices, ops._launchers):
        launcher = _cross_device_utils.CollectiveReplicaLauncher(group_key, ops._group_size, keys, device,
                                                                 ops._options)
        launcher._ordering_token = own._ordering_token
        launchers.append(launcher)
    return launchers


def launcher_device(launcher) -> str:
    """The device a collective launcher runs on."""
    return launcher._device


def launcher_timeout(launcher) -> float | None:
    """The `timeout_seconds` a collective launcher gives its ops (the strategy's CommunicationOptions)."""
    return launcher._options.timeout_seconds


def _options(timeout_s: float | None):
    """Options overriding only the op's timeout (None: the launcher's own; 0: none)."""
    return None if timeout_s is None else tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout_s)


def launcher_all_reduce_sum(launcher, tensor: tf.Tensor, timeout_s: float | None = None) -> tf.Tensor:
    """CollectiveReduceV2 (sum) of `tensor` over the launcher's group (`timeout_s`: see `_options`)."""
    return launcher.all_reduce(tensor, options=_options(timeout_s))


def launcher_all_gather(launcher, tensor: tf.Tensor, timeout_s: float | None = None) -> tf.Tensor:
    """CollectiveGatherV2: the group's tensors concatenated along axis 0, in group-rank order."""
    return launcher._all_gather(tensor, _options(timeout_s))


def launcher_all_to_all(launcher, tensor: tf.Tensor, timeout_s: float | None = None) -> tf.Tensor:
    """CollectiveAllToAllV2: part r (of group_size equal parts along axis 0) of `tensor` goes to
    group rank r; the result holds, at position r, what rank r sent here."""
    instance_key = launcher._next_instance_key()
    options = launcher._options.merge(_options(timeout_s))
    with tf.device(launcher._device):
        return _collective_ops.all_to_all_v2(
            tensor, launcher._group_size, launcher._group_key, instance_key,
            communication_hint=options.implementation.value, timeout=options.timeout_seconds or 0,
            ordering_token=launcher._get_ordering_token())

