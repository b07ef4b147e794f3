"""tf.distribute input internals: distributed datasets that keep one multi-device iterator and rewind it for each
new pass, instead of building a new one per epoch and destroying the old one.

Why: over several local devices, TF's distributed iterator is an `OwnedMultiDeviceIterator` — a host
iterator feeding one generator-and-prefetch iterator per device. Keras 3 calls `iter()` on the distributed dataset
at the start of every epoch and of every validation (and once more right after each pass, a spare it then
discards), so per epoch TF builds several of them (tracing 3 remote functions per device) and destroys as many.
Destroying one blocks in `~RootDataset::Iterator` until the tf.data autotune thread of each of its pipelines
(`Model::OptimizeLoop`) returns from a timed wait that cancellation does not cut short; the waits double with the
iterator's age, hence slow first steps after validation (figures: docs/benchmarks.md, "Epoch boundary").

What this module does instead (`rewinding(distributed)`), for TF's `DistributedDataset` and
`DistributedDatasetsFromFunction` when they feed devices through multi-device iterators:
- the first eager `iter()` builds one multi-device iterator per input worker, whose per-device pipelines run
  without tf.data autotuning (a generator and a one-element prefetch: nothing to tune) and whose host pipeline
  runs without it unless the dataset's options ask for it (`autotune.enabled` set): no autotune thread, nothing
  to wait for;
- a later eager `iter()` rewinds that iterator in place, as TF's own `MultiDeviceIterator._eager_reset` does:
  a new incarnation of the host iterator and new per-device pipelines from the per-device functions traced
  the first time (no tracing), in the same iterator resources: the same `DistributedIterator` object comes
  back, so Keras' traced step takes it without retracing;
- a pass that was never pulled is not rewound again: the host pipeline raises a flag on its first element
  after a rewind, and `iter()` rewinds only when the flag is up. Keras asks for its spare iterator right after
  an epoch's last step (rewound there, before validation) and for the next epoch's after `on_epoch_begin`:
  that second call costs nothing, so the first step after validation is an ordinary step.

The price: one distributed dataset has one iterator. A new eager `iter()` starts a new pass for every holder of
an earlier one (Keras and the usual `for x in dataset` loops hold one at a time); iterate one dataset in two
places at once by distributing it twice. Inside `tf.function`, `iter()` is TF's (a new iterator per trace).
A pass that ends without yielding a single element does not raise the flag: the next `iter()` then returns the
same exhausted iterator (another empty pass), also where TF would have started over.
"""

from __future__ import annotations

import tfdist._compat  # noqa: F401  (the TF/Keras version check, before any reach-in below)

import dataclasses

import tensorflow as tf
from tensorflow.python.data.ops import multi_device_iterator_ops as _mdi
from tensorflow.python.distribute import device_util as _device_util
from tensorflow.python.distribute import input_lib as _input_lib
from tensorflow.python.eager import context as _context
from tensorflow.python.framework import ops as _ops
from tensorflow.python.ops import gen_dataset_ops as _gen_dataset_ops

__all__ = ["IteratorCounts", "is_rewinding", "iterator_counts", "next_pass", "pipeline_options", "rewinding",
           "total_counts"]


@dataclasses.dataclass
class IteratorCounts:
    """What `iter()` did on one rewinding distributed dataset (or, from `total_counts()`, on all of them)."""

    built: int = 0  # multi-device iterators built (tracing their per-device functions)
    rewound: int = 0  # passes started by rewinding the existing iterator
    reused: int = 0  # iter() calls that returned the iterator as it was (no pull since the last rewind)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


_TOTAL = IteratorCounts()


def total_counts() -> IteratorCounts:
    """Counts over every rewinding dataset of this process (a copy)."""
    return dataclasses.replace(_TOTAL)


def _device_options() -> tf.data.Options:
    # The per-device pipelines are a generator and a prefetch of fixed size: no tunable parameter, so the
    # autotune thread has nothing to do but to delay their teardown; static rewrites buy nothing either.
    options = tf.data.Options()
    options.autotune.enabled = False
    options.experimental_optimization.apply_default_optimizations = False
    return options


class _HostValue:
    """A host-side scalar resource (not a tf.Variable: iter() may run inside a strategy's scope, whose variable
    creator would mirror a tf.Variable over the replicas). In a function being traced, it converts to a read of
    its current value (`__tf_tensor__`), so a traced function sees every later `assign`."""

    def __init__(self, device: str, value, dtype):
        self.dtype = dtype
        with _ops.device(device):
            self.handle = tf.raw_ops.VarHandleOp(dtype=dtype, shape=[], container="",
                                                 shared_name=_context.anonymous_name())
            self.assign(value)

    def assign(self, value) -> None:
        tf.raw_ops.AssignVariableOp(resource=self.handle, value=tf.cast(value, self.dtype))

    def read(self):
        return tf.raw_ops.ReadVariableOp(resource=self.handle, dtype=self.dtype)

    def __tf_tensor__(self, dtype=None, name=None):
        return self.read()


class _PullFlag(_HostValue):
    """Raised by the host pipeline on every element it produces; `next_pass` reads and lowers it."""

    def __init__(self, device: str):
        super().__init__(device, False, tf.bool)

    def is_up(self) -> bool:
        return bool(self.read().numpy())

    def marking(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        """`dataset`, raising the flag whenever an element is produced (elements unchanged)."""
        handle, spec = self.handle, dataset.element_spec

        def mark(*element):
            tf.raw_ops.AssignVariableOp(resource=handle, value=tf.constant(True))  # kept: a stateful op
            return element if isinstance(spec, tuple) else element[0]

        return dataset.map(mark)


class RewindableMultiDeviceIterator(_mdi.OwnedMultiDeviceIterator):
    """TF's OwnedMultiDeviceIterator (same resources, same TypeSpec: inside tf.function it is TF's class) that
    can `rewind()` in place and raises `flag` on every host element.

    Unlike TF's, its per-device pipelines read the host iterator's incarnation at run time (from a host-side
    value) instead of capturing it: they are built once, and a rewind re-initialises the per-device iterators
    from the same datasets, whose functions stay instantiated (TF rebuilds and re-optimises them per pass)."""

    def __init__(self, dataset, devices, flag: _PullFlag, max_buffer_size=1, prefetch_buffer_size=1,
                 source_device="/cpu:0"):
        options = tf.data.Options()
        options.experimental_distribute.num_devices = len(devices)
        if prefetch_buffer_size == 0:
            options.experimental_optimization.inject_prefetch = False
        if dataset.options().autotune.enabled is None:  # the user did not ask for it: off (see module doc)
            options.autotune.enabled = False
        dataset = flag.marking(dataset).with_options(options)
        self._dataset = dataset._apply_debug_options()
        self._element_spec = dataset.element_spec
        self._devices = devices
        self._source_device = source_device
        self._max_buffer_size = max(max_buffer_size, prefetch_buffer_size)
        with _ops.device(source_device):
            self._multi_device_iterator_resource = _gen_dataset_ops.anonymous_multi_device_iterator_v3(
                devices=devices, **self._dataset._flat_structure)
            self._incarnation = _HostValue(source_device, self._init_host(), tf.int64)
        source_device_tensor = _ops.convert_to_tensor(source_device)
        slack = dataset.options().experimental_slack
        self._device_datasets, self._device_iterators = [], []
        for i, device in enumerate(devices):
            with _ops.device(device):
                generator = _mdi._PerDeviceGenerator(
                    i, self._multi_device_iterator_resource, self._incarnation, source_device_tensor,
                    self._element_spec, iterator_is_anonymous=True)
                if prefetch_buffer_size > 0 and slack:
                    generator = _mdi.prefetch_op._PrefetchDataset(generator, prefetch_buffer_size, slack_period=1)
                elif prefetch_buffer_size > 0:
                    generator = generator.prefetch(prefetch_buffer_size, name="device_prefetch")
                device_dataset = generator.with_options(_device_options())
                self._device_datasets.append(device_dataset)
                self._device_iterators.append(iter(device_dataset))

    def _init_host(self):
        return _gen_dataset_ops.multi_device_iterator_init(
            self._dataset._variant_tensor, self._multi_device_iterator_resource, max_buffer_size=self._max_buffer_size)

    def rewind(self) -> None:
        """A new pass: the per-device iterators restarted from their datasets, then a new incarnation of the host
        iterator.

        In this order: the old per-device states end (their prefetch threads joined; no autotune thread to wait
        for) before the host's new pass exists, so none of them can take an element of it (they read the
        incarnation at run time). The new per-device states pull nothing before their first get_next."""
        for device, dataset, iterator in zip(self._devices, self._device_datasets, self._device_iterators):
            with _ops.device(device):
                _gen_dataset_ops.make_iterator(dataset._variant_tensor, iterator._iterator_resource)
        with _ops.device(self._source_device):
            self._incarnation.assign(self._init_host())


def _worker_datasets(distributed) -> list:
    if isinstance(distributed, _input_lib.DistributedDataset):
        return distributed._cloned_datasets
    return distributed._datasets


class _Rewinder:
    """The one iterator of a rewinding distributed dataset, and its pull flags (one per input worker)."""

    def __init__(self):
        self.iterator = None
        self.flags: list[_PullFlag] = []
        self.counts = IteratorCounts()

    def next_pass(self, distributed):
        if self.iterator is None:
            self.iterator = self._build(distributed)
            self._count("built")
        elif any(flag.is_up() for flag in self.flags):
            for flag in self.flags:
                flag.assign(False)
            for worker in self.iterator._iterators:
                worker._iterator.rewind()
            self._count("rewound")
        else:
            self._count("reused")
        _context.async_wait()  # as TF's __iter__: every resource initialised before a step takes it
        return self.iterator

    def _count(self, what: str) -> None:
        for counts in (self.counts, _TOTAL):
            setattr(counts, what, getattr(counts, what) + 1)

    def _build(self, distributed):
        options = distributed._options
        buffers = {} if options is None else {"max_buffer_size": options.experimental_per_replica_buffer_size,
                                               "prefetch_buffer_size": options.experimental_per_replica_buffer_size}
        canonicalize = getattr(distributed._strategy, "_canonicalize_devices", True)
        workers = distributed._input_workers
        iterators = []
        for i, (worker, dataset) in enumerate(zip(workers.worker_devices, _worker_datasets(distributed))):
            devices = workers.compute_devices_for_worker(i)
            with _ops.device(worker):  # where TF's _SingleWorkerOwnedDatasetIterator puts its iterator
                device_scope = _device_util.canonicalize(worker, _device_util.current())
                host = _device_util.get_host_for_device(device_scope)
                flag = _PullFlag(host)
                with _ops.device(device_scope):
                    multi_device = RewindableMultiDeviceIterator(dataset, devices, flag, source_device=host,
                                                                 **buffers)
                iterators.append(_input_lib._SingleWorkerOwnedDatasetIterator(
                    worker=worker, devices=devices, components=[multi_device], element_spec=dataset.element_spec,
                    options=options, canonicalize_devices=canonicalize))
            self.flags.append(flag)
        iterator = _input_lib.DistributedIterator(
            workers, iterators, distributed._strategy, cardinality=distributed._cardinality,
            enable_get_next_as_optional=distributed._enable_get_next_as_optional, options=options,
            replica_order=distributed._replica_order)
        iterator._element_spec = distributed._element_spec
        return iterator


def next_pass(distributed):
    """The one iterator of `distributed` (TF's DistributedDataset or DistributedDatasetsFromFunction, or a
    subclass of either), at the start of a new pass: built on the first call, rewound on later ones (not again
    if nothing was pulled since). None where TF's own `__iter__` must run instead: inside tf.function, for a
    dataset not built yet (ClusterCoordinator), or without multi-device iterators.

    For subclasses with an `__iter__` of their own (e.g. tfdist.data_parallel._uneven_input's), call this in place of
    TF's `__iter__` and wrap the result as they wrap TF's iterator."""
    if (not _context.executing_eagerly() or not distributed._built
            or not _input_lib._should_use_multi_device_iterator(distributed._options)):
        return None
    rewinder = distributed.__dict__.get("_tfdist_rewinder")
    if rewinder is None:
        rewinder = distributed.__dict__["_tfdist_rewinder"] = _Rewinder()
    return rewinder.next_pass(distributed)


def _iter_rewinding(self):
    """__iter__ of the rewinding datasets: eagerly, the dataset's one iterator at the start of a new pass."""
    iterator = next_pass(self)
    return super(type(self), self).__iter__() if iterator is None else iterator


# Direct subclasses with no state of their own: TF's object can take their class (as tfdist.data_parallel._uneven_input
# does), so everything TF set on it stays as it was.
class RewindingDataset(_input_lib.DistributedDataset):
    __iter__ = _iter_rewinding


class RewindingDatasetsFromFunction(_input_lib.DistributedDatasetsFromFunction):
    __iter__ = _iter_rewinding


_REWINDING = {_input_lib.DistributedDataset: RewindingDataset,
              _input_lib.DistributedDatasetsFromFunction: RewindingDatasetsFromFunction}


def rewinding(distributed):
    """`distributed` (as TF's experimental_distribute_dataset / distribute_datasets_from_function built it),
    made to keep one iterator and rewind it per pass (see the module doc). Anything else — another subclass, a
    dataset whose input goes to the devices without multi-device iterators (InputReplicationMode.PER_REPLICA
    without fetching to the device) — comes back unchanged."""
    kind = _REWINDING.get(type(distributed))
    if kind is None or not _input_lib._should_use_multi_device_iterator(distributed._options):
        return distributed
    distributed.__class__ = kind
    return distributed


def is_rewinding(distributed) -> bool:
    return type(distributed) in _REWINDING.values()


def iterator_counts(distributed) -> IteratorCounts:
    """What `iter()` did so far on a rewinding distributed dataset (all zero before its first `iter()`)."""
    rewinder = distributed.__dict__.get("_tfdist_rewinder")
    return dataclasses.replace(rewinder.counts) if rewinder is not None else IteratorCounts()


def pipeline_options(distributed) -> list[tf.data.Options]:
    """The tf.data options of the pipelines behind a rewinding dataset's iterator, per input worker: its host
    pipeline, then one per device (empty before the first `iter()`)."""
    rewinder = distributed.__dict__.get("_tfdist_rewinder")
    if rewinder is None or rewinder.iterator is None:
        return []
    out = []
    for worker in rewinder.iterator._iterators:
        multi_device = worker._iterator
        out += [multi_device._dataset.options(), *(d.options() for d in multi_device._device_datasets)]
    return out
