"""Input for parameter-server training: a dataset function that every worker runs for itself."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import tensorflow as tf

from tfdist.errors import ConfigError
from tfdist.parameter_server._tf_sharded import DataAdapter

__all__ = ["PerWorkerDataset", "as_dataset_fn"]

DATASET_FN_HINT = (
    "pass a dataset function instead, e.g. `def dataset_fn(input_context): return make_dataset().repeat()`, "
    "and `model.fit(dataset_fn, steps_per_epoch=..., epochs=...)`: every worker builds its own pipeline "
    "from it (a dataset made on the chief cannot be shipped to the workers)")


def as_dataset_fn(x, parameter: str = "x") -> Callable[[tf.distribute.InputContext], tf.data.Dataset]:
    """`x` as a function of the input context: `fn(input_context)` or `fn()` both work.

    Raises ConfigError, naming `parameter`, for anything that is not a function (a tf.data.Dataset,
    arrays, a generator): parameter-server workers need a function to build their own input."""
    if isinstance(x, PerWorkerDataset):
        return x.dataset_fn
    if isinstance(x, tf.data.Dataset) or not callable(x):
        raise ConfigError(f"ParameterServerStrategy: {parameter} must be a dataset function, got "
                          f"{type(x).__name__}; {DATASET_FN_HINT}.")
    try:
        takes_context = bool(inspect.signature(x).parameters)
    except (TypeError, ValueError):
        takes_context = True
    return x if takes_context else (lambda _context: x())


class _PerWorkerInput(tf.distribute.DistributedDataset):
    """What Keras' epoch iterator holds: iterating it gives the coordinator's per-worker iterator, created
    once (across epochs) so every worker keeps its place in its own pipeline."""

    def __init__(self, owner: PerWorkerDataset):
        self._owner = owner

    def __iter__(self):
        return self._owner.batches()


class _Batches:
    """The per-worker iterator, plus one batch made on the chief (Keras builds the model and its metrics
    symbolically from one batch before training; it only reads shapes and dtypes)."""

    def __init__(self, owner: PerWorkerDataset, per_worker_iterator):
        self.owner, self.per_worker_iterator = owner, per_worker_iterator

    def __iter__(self):
        return self

    def __next__(self):
        return self.owner.sample_batch()


class PerWorkerDataset(DataAdapter):
    """A dataset function as Keras input for parameter-server training (what `fit(dataset_fn)` becomes).

    Each worker calls `dataset_fn(input_context)` once and keeps iterating its own pipeline across
    epochs: the dataset should `.repeat()`, and `steps_per_epoch` says where an epoch ends. Under
    TensorFlow's parameter-server strategy the context is the same on every worker (one input pipeline
    per worker): to give workers different examples, shuffle without a fixed seed (or shard by a
    worker id of your own).

    Args:
        dataset_fn: `fn(input_context) -> tf.data.Dataset` of batches (or `fn()`).
        coordinator: the strategy's `tf.distribute.experimental.coordinator.ClusterCoordinator`.
        strategy: the parameter-server strategy.
    """

    def __init__(self, dataset_fn, coordinator, strategy):
        self.dataset_fn = as_dataset_fn(dataset_fn)
        self._coordinator, self._strategy = coordinator, strategy
        self._iterator = None
        self._sample = None

    def batches(self) -> _Batches:
        if self._iterator is None:
            strategy, dataset_fn = self._strategy, self.dataset_fn

            @tf.function
            def per_worker_dataset_fn():
                return strategy.distribute_datasets_from_function(dataset_fn)

            self._iterator = iter(self._coordinator.create_per_worker_dataset(per_worker_dataset_fn))
        return _Batches(self, self._iterator)

    def sample_batch(self):
        if self._sample is None:
            dataset = self.dataset_fn(tf.distribute.InputContext())
            if not isinstance(dataset, tf.data.Dataset):
                raise ConfigError(f"ParameterServerStrategy: the dataset function must return a tf.data.Dataset, "
                                  f"got {type(dataset).__name__}.")
            self._sample = next(iter(dataset))
        return self._sample

    def get_tf_dataset(self):
        return _PerWorkerInput(self)

    def get_numpy_iterator(self):
        raise ConfigError("ParameterServerStrategy input runs on the workers only (TensorFlow backend).")

    @property
    def num_batches(self):
        return None

    @property
    def batch_size(self):
        return None

    @property
    def has_partial_batch(self):
        return False

    @property
    def partial_batch_size(self):
        return None
