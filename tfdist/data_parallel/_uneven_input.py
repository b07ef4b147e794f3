"""tf.distribute input internals for uneven per-rank data: distributed datasets whose iterators ask a policy,
at every step, whether the replicas go on (tfdist.data_parallel.uneven decides; this module only reaches in).

TF's distributed iterators learn that a rank has run out of data only when that rank's own pipeline ends, and
Keras takes each rank's step count from that rank's own cardinality: with per-rank datasets of different
lengths the ranks leave the epoch at different steps and the next collective never matches (a hang under
Horovod, a type mismatch reported as a lost worker under MultiWorkerMirroredStrategy).

`joining(distributed, policy, mode, lookahead, steps)` turns a distributed dataset that TF built into one whose
iterators:
- read one element per local replica as an Optional (never ending on their own);
- pass the policy which replicas have data, their rows, and the look-ahead (`[count, rows]` of this rank's
  next step, carried by the last local replica's element, see tfdist.data_parallel.uneven_lookahead);
- hand out the batches (with empty stand-ins for replicas without data) when the policy says go, and raise
  OutOfRangeError (end of sequence, what Keras' fit ends an epoch on) on every rank when it says stop;
- report the cardinality the ranks agreed on, so Keras' step count is the same on every rank.

The dataset and iterator are TF's own classes' subclasses (Keras recognises TF datasets by their class names);
iterators keep their subclass inside tf.function through their own TypeSpec.
"""

from __future__ import annotations

import tfdist._compat  # noqa: F401  (the TF/Keras version check, before any reach-in below)

import functools
import weakref
from collections.abc import Callable
from typing import Protocol

import tensorflow as tf
from tensorflow.python.distribute import input_lib as _input_lib

from tfdist.data_parallel import _rewinding_input as rewinding_input

__all__ = ["StepPolicy", "joining", "local_steps", "replicas_per_worker"]

UNKNOWN = int(tf.data.UNKNOWN_CARDINALITY)
_NO_LOOKAHEAD = (-1, -1)  # the look-ahead of a pipeline that could not be given one: "unknown"


class StepPolicy(Protocol):
    """What the iterators ask at each step (implemented by tfdist.data_parallel.uneven.UnevenData)."""

    def new_iterator(self) -> None:
        """A new iterator starts (a new epoch): nothing agreed so far holds for it."""

    def decide(self, mode: str, has: tf.Tensor, rows: tf.Tensor, lookahead: tf.Tensor) -> tf.Tensor:
        """Whether every rank takes this step (bool scalar) in `mode`, from this rank's replicas: `has` [M] bool,
        `rows` [M] int64, and `lookahead` int64 [count, rows] of this rank's next step ([-1, -1]: unknown)."""


_policies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # strategy -> its StepPolicy


def replicas_per_worker(distributed) -> int:
    """Local replicas fed by each input pipeline of a distributed dataset (devices of its first input worker)."""
    return len(distributed._input_workers.compute_devices_for_worker(0))


def local_steps(distributed) -> tuple[int, int]:
    """(count, elements per step) of this process's pipeline, from the cardinality TF reports: a distributed
    dataset (experimental_distribute_dataset) counts steps; datasets from a function count their elements,
    each one replica's batch, M local replicas' worth per step."""
    count = int(distributed.cardinality)  # a property on TF's distributed datasets
    if isinstance(distributed, _input_lib.DistributedDatasetsFromFunction):
        return count, replicas_per_worker(distributed)
    return count, 1


def joining(distributed, policy: StepPolicy, mode: str,
            lookahead: Callable[[tf.data.Dataset, int], tf.data.Dataset | None], steps: int) -> object:
    """Makes TF's distributed dataset `distributed` (as built by experimental_distribute_dataset or
    distribute_datasets_from_function) iterate under `policy` in `mode`, with `steps` as its cardinality.
    The policy is the strategy's (one per strategy); the mode is the dataset's.

    Each per-worker pipeline gets `lookahead(dataset, replicas)`; where that returns None (sparse or ragged
    elements) the look-ahead is "unknown" and the policy agrees at that step instead."""
    kind = _JOINING.get(type(distributed))
    if kind is None:
        names = ", ".join(c.__name__ for c in _JOINING)
        raise TypeError(f"uneven data: expected a distributed dataset built by TF ({names}), "
                        f"got {type(distributed).__name__}.")
    attr = "_cloned_datasets" if isinstance(distributed, _input_lib.DistributedDataset) else "_datasets"
    workers = distributed._input_workers
    paired = []
    for i, dataset in enumerate(getattr(distributed, attr)):
        with tf.device(workers.worker_devices[i]):
            with_next = lookahead(dataset, len(workers.compute_devices_for_worker(i)))
            if with_next is None:
                with_next = dataset.map(lambda *e, _s=dataset.element_spec: (
                    e if isinstance(_s, tuple) else e[0], tf.constant(_NO_LOOKAHEAD, tf.int64)))
        paired.append(with_next)
    setattr(distributed, attr, paired)
    strategy = distributed._strategy
    distributed._element_spec = _input_lib._create_distributed_tensor_spec(strategy, paired[0].element_spec)
    distributed._tfdist_steps = int(steps)
    distributed._tfdist_mode = mode
    _policies[strategy] = policy
    distributed.__class__ = kind  # TF's object, with the two methods below: same state, no rebuild
    return distributed


def _policy_of(strategy) -> StepPolicy:
    return _policies[strategy]


def _iter_agreeing(self):
    """__iter__ of the joining datasets: TF's iterator, as an AgreeingIterator of the dataset's mode. Where the
    strategy reuses input iterators (`reuse_input_iterators`), the one iterator of the dataset, rewound for the
    new pass (tfdist.data_parallel._rewinding_input), instead of a new one per pass."""
    iterator = rewinding_input.next_pass(self) if getattr(self._strategy, "reuse_input_iterators", False) else None
    if iterator is None:
        iterator = super(type(self), self).__iter__()
    _policy_of(self._strategy).new_iterator()
    joined = _iterator_class(self._tfdist_mode)(
        input_workers=iterator._input_workers, iterators=iterator._iterators, strategy=iterator._strategy,
        cardinality=iterator._cardinality, enable_get_next_as_optional=iterator._enable_get_next_as_optional,
        options=iterator._options, replica_order=iterator._replica_order)
    joined._element_spec = iterator._element_spec
    return joined


def _agreed_cardinality(self) -> int:
    return self._tfdist_steps


# Direct subclasses with no state of their own (a mixin base would change the layout): TF's object can take
# their class.
class JoiningDataset(_input_lib.DistributedDataset):
    __iter__ = _iter_agreeing
    cardinality = property(_agreed_cardinality)


class JoiningDatasetsFromFunction(_input_lib.DistributedDatasetsFromFunction):
    __iter__ = _iter_agreeing
    cardinality = property(_agreed_cardinality)


_JOINING = {_input_lib.DistributedDataset: JoiningDataset,
            _input_lib.DistributedDatasetsFromFunction: JoiningDatasetsFromFunction}


class AgreeingIterator(_input_lib.DistributedIterator):
    """A distributed iterator whose every step is decided by the strategy's StepPolicy (see the module doc);
    its subclasses fix the mode."""

    mode: str = ""
    spec_class: type = type(None)

    @property
    def element_spec(self):
        # Without the look-ahead, and with a dynamic batch dimension: replicas without data get empty batches.
        return tf.nest.map_structure(_input_lib._rebatch_as_dynamic, self._element_spec[0])

    @property
    def _type_spec(self):
        return self.spec_class(self._input_workers, self._element_spec, self._strategy, self._options,
                               self._cardinality, self._enable_get_next_as_optional, self._replica_order)

    def get_next(self, name=None):
        del name
        go, values = self._next()
        if tf.executing_eagerly():
            if not bool(go):
                raise tf.errors.OutOfRangeError(None, None, "End of sequence (uneven data: the ranks stopped)")
            return values
        return tf.cond(go, lambda: values, lambda: _after_end_of_sequence(values))

    def get_next_as_optional(self):
        go, values = self._next()
        spec = tf.nest.map_structure(tf.type_spec_from_value, values)
        return tf.cond(go, lambda: tf.experimental.Optional.from_value(values),
                       lambda: tf.experimental.Optional.empty(spec))

    def _next(self):
        has, rows, elements, nexts = [], [], [], []
        workers = self._input_workers
        for i, worker in enumerate(workers.worker_devices):
            with tf.device(worker):
                optionals = self._iterators[i].get_next_as_optional_list()
            for device, optional in zip(workers.compute_devices_for_worker(i), optionals):
                with tf.device(device):
                    data_spec = optional.element_spec[0]
                    present = optional.has_value()
                    element, ahead = tf.cond(
                        present, optional.get_value,
                        lambda s=data_spec: (_input_lib._dummy_tensor_fn(s), tf.zeros([2], tf.int64)))
                has.append(present)
                rows.append(tf.where(present, _rows(element), tf.constant(0, tf.int64)))
                elements.append(element)
                nexts.append(ahead)
        if self._replica_order is not None:
            elements = self._reorder_replicas(elements)
        # The last local replica's element knows this rank's next step (elements go round-robin to replicas).
        go = _policy_of(self._strategy).decide(self.mode, tf.stack(has), tf.stack(rows), nexts[-1])
        return go, _input_lib._create_per_replica(elements, self._strategy)


class _AgreeingIteratorSpec(_input_lib.DistributedIteratorSpec):
    """Keeps an AgreeingIterator's class (its mode) when it is passed into a tf.function (Keras' train function)."""

    iterator_class: type = AgreeingIterator

    @property
    def value_type(self):
        return self.iterator_class

    def _from_components(self, components):
        return self.iterator_class(
            input_workers=self._input_workers, iterators=None, components=components, element_spec=self._element_spec,
            strategy=self._strategy, cardinality=self._cardinality, options=self._options,
            enable_get_next_as_optional=self._enable_get_next_as_optional, replica_order=self._replica_order)


@functools.cache
def _iterator_class(mode: str) -> type:
    """The AgreeingIterator subclass of `mode`, with its own TypeSpec class (a spec rebuilds its value_type)."""
    name = mode.capitalize()
    iterator = type(f"{name}AgreeingIterator", (AgreeingIterator,), {"mode": mode})
    iterator.spec_class = type(f"_{name}AgreeingIteratorSpec", (_AgreeingIteratorSpec,), {"iterator_class": iterator})
    return iterator


def _rows(element) -> tf.Tensor:
    # The rule of tfdist.data_parallel.uneven_lookahead.rows_of (which _compat cannot import): rows of the first component.
    first = tf.nest.flatten(element)[0]
    return tf.constant(1, tf.int64) if first.shape.rank == 0 else tf.shape(first, out_type=tf.int64)[0]


def _after_end_of_sequence(values):
    """`values`, available only after an op that raises OutOfRangeError: a graph's way of ending the epoch on
    a rank whose own pipeline still has data (the next element of an empty dataset)."""
    end = next(iter(tf.data.Dataset.range(0)))
    with tf.control_dependencies([end]):
        return tf.nest.map_structure(tf.identity, values, expand_composites=True)
