"""Issue 18: tfdist.MirroredStrategy keeps one input iterator per distributed dataset and rewinds it per pass,
instead of building a multi-device iterator per epoch and per validation (and waiting for the old one's tf.data
autotune threads when it is torn down). Checked by counts and equal results, no timing; the timed figure comes
from `tfdist bench epoch-boundary` (docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import REPLICAS

import tfdist
from tfdist.data_parallel import _rewinding_input as rewinding_input
from tfdist.data_parallel.input_reuse import iterator_counts, total_iterator_counts

BATCH = 32


def _arrays(n=BATCH * 5 + 8):  # 5 full batches and a partial one
    arrays = tfdist.data.load_arrays("digits")
    return arrays.x_train[:n], arrays.y_train[:n], arrays.x_test[:3 * BATCH], arrays.y_test[:3 * BATCH]


def _dataset(x, y, batch=BATCH):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def _labels(distributed_batch, strategy) -> list[int]:
    """The labels of one global batch, replica by replica."""
    _, y = distributed_batch
    return [int(v) for part in strategy.experimental_local_results(y) for v in part.numpy()]


def _compiled(strategy):
    with strategy.scope():
        model = tfdist.models.cnn((8, 8, 1), 10, filters=(8, 16), dense_units=32, seed=1)
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    return model


@pytest.fixture(scope="module")
def strategies():
    """A reusing and a non-reusing tfdist.MirroredStrategy over the same 4 logical CPUs (own collective keys)."""
    return tfdist.MirroredStrategy(), tfdist.MirroredStrategy(reuse_input_iterators=False)


def test_every_iter_is_a_new_pass_of_the_one_iterator(strategies):
    reusing, plain = strategies
    x, y, _, _ = _arrays()
    dataset = _dataset(x, y)
    reused, reference = reusing.experimental_distribute_dataset(dataset), plain.experimental_distribute_dataset(dataset)
    assert rewinding_input.is_rewinding(reused) and not rewinding_input.is_rewinding(reference)
    expected = [_labels(b, plain) for b in reference]
    assert len(expected) == 6

    first = iter(reused)
    assert [_labels(next(first), reusing) for _ in range(2)] == expected[:2]
    second = iter(reused)  # mid-pass: a new pass from the start, on the same object
    assert second is first
    assert [_labels(b, reusing) for b in second] == expected
    for _ in range(3):  # full passes, as Keras and `for` loops make them
        assert [_labels(b, reusing) for b in reused] == expected
    assert iter(reused) is iter(reused) is first
    # One build; every later pass is a rewind (pulled before) or a reuse (untouched since the last rewind).
    assert iterator_counts(reused) == {"built": 1, "rewound": 5, "reused": 1}


def test_a_pass_cut_short_never_leaks_into_the_next(strategies):
    """iter() right after a few get_next: the per-device prefetch threads may be fetching at that moment. They
    end before the host's new pass exists (a rewind restarts the devices first), so none of them takes an
    element of it. (Rewinding the host first lost one element in about 800 such passes.)"""
    reusing, plain = strategies
    x, y, _, _ = _arrays()
    expected = [_labels(b, plain) for b in plain.experimental_distribute_dataset(_dataset(x, y))]
    reused = reusing.experimental_distribute_dataset(_dataset(x, y))
    for taken in [1, 2, 3] * 20:
        iterator = iter(reused)
        assert [_labels(next(iterator), reusing) for _ in range(taken)] == expected[:taken]
    assert [_labels(b, reusing) for b in reused] == expected


def test_a_traced_step_takes_the_rewound_iterator_without_retracing(strategies):
    reusing, _ = strategies
    x, y, _, _ = _arrays()
    reused = reusing.experimental_distribute_dataset(_dataset(x, y))

    @tf.function
    def step(iterator):
        _, labels = next(iterator)
        return reusing.reduce("SUM", reusing.run(lambda v: tf.reduce_sum(tf.cast(v, tf.int64)), (labels,)), axis=None)

    sums = []
    for _ in range(4):
        iterator = iter(reused)
        sums.append(sum(int(step(iterator)) for _ in range(6)))
        with pytest.raises(tf.errors.OutOfRangeError):  # the pass ends where the dataset does
            step(iterator)
    assert sums == [int(y.sum())] * 4
    assert step.experimental_get_tracing_count() == 1
    assert iterator_counts(reused)["built"] == 1


def test_its_pipelines_run_without_the_autotune_thread_unless_the_dataset_asks(strategies):
    reusing, _ = strategies
    x, y, _, _ = _arrays()
    plain = reusing.experimental_distribute_dataset(_dataset(x, y).prefetch(tf.data.AUTOTUNE))
    iter(plain)
    options = rewinding_input.pipeline_options(plain)
    assert len(options) == 1 + REPLICAS  # the host pipeline, then one per device
    assert [o.autotune.enabled for o in options] == [False] * (1 + REPLICAS)

    asked = tf.data.Options()
    asked.autotune.enabled = True
    tuned = reusing.experimental_distribute_dataset(_dataset(x, y).with_options(asked))
    iter(tuned)
    host, *devices = rewinding_input.pipeline_options(tuned)
    assert host.autotune.enabled is True and [o.autotune.enabled for o in devices] == [False] * REPLICAS


def _fit(strategy, epochs=3, **validation):
    x, y, x_test, y_test = _arrays()
    order = tfdist.data.EpochOrder(seed=3)  # reshuffled every epoch
    model = _compiled(strategy)
    history = model.fit(order.dataset(x, y, BATCH), validation_data=_dataset(x_test, y_test, validation.pop("batch",
                        BATCH)), epochs=epochs, shuffle=False, callbacks=[order], verbose=0, **validation)
    assert order.epochs_begun == list(range(epochs))
    return model, history.history


def test_fit_with_validation_builds_each_input_iterator_once(strategies):
    reusing, _ = strategies
    before = total_iterator_counts()
    _fit(reusing, epochs=4)
    built, rewound, reused = (total_iterator_counts()[k] - before[k] for k in ("built", "rewound", "reused"))
    # Two datasets (training, validation), one multi-device iterator each for the whole fit. Every other pass
    # rewinds or reuses it: Keras asks the training dataset once for a batch to build the model on, then per
    # epoch twice (the epoch's pass and a spare right after it), and the validation dataset three times per
    # epoch (a batch for its symbolic build, the pass, a spare).
    assert built == 2
    assert rewound + reused == 1 + (2 + 3) * 4 - built
    assert reused >= 4 - 1  # the epoch's own pass takes the spare, rewound before validation: no work at its start


@pytest.mark.slow  # the reference run is TF's iterators: the stalls themselves (about a minute)
def test_fit_trains_exactly_as_with_tfs_iterators(strategies):
    reusing, plain = strategies
    before = total_iterator_counts()
    model_a, history_a = _fit(reusing, epochs=2)  # two epochs: the second starts after a validation and reshuffles
    after = total_iterator_counts()
    model_b, history_b = _fit(plain, epochs=2)
    assert total_iterator_counts() == after and after["built"] - before["built"] == 2  # plain: TF's iterators
    np.testing.assert_array_equal(np.concatenate([w.ravel() for w in model_a.get_weights()]),
                                  np.concatenate([w.ravel() for w in model_b.get_weights()]))
    assert history_a == history_b
    # Validation on 2 batches of 8 (of 12): every validation starts again at the first.
    assert (_fit(reusing, epochs=2, validation_steps=2, batch=8)[1]
            == _fit(plain, epochs=2, validation_steps=2, batch=8)[1])


def test_datasets_from_a_function_and_iteration_inside_tf_function(strategies):
    reusing, _ = strategies
    x, y, _, _ = _arrays(BATCH * 4)

    def dataset_fn(context):
        return _dataset(x, y, context.get_per_replica_batch_size(BATCH))

    distributed = reusing.distribute_datasets_from_function(dataset_fn)
    assert rewinding_input.is_rewinding(distributed)
    passes = [[_labels(b, reusing) for b in distributed] for _ in range(3)]
    assert passes[0] == passes[1] == passes[2] and len(passes[0]) == 4
    assert iterator_counts(distributed)["built"] == 1

    plain_dataset = reusing.experimental_distribute_dataset(_dataset(x, y))

    @tf.function
    def total():  # iter() inside tf.function is TF's own (a new iterator per trace)
        s = tf.constant(0, tf.int64)
        for _, labels in plain_dataset:
            s += reusing.reduce("SUM", reusing.run(lambda v: tf.reduce_sum(tf.cast(v, tf.int64)), (labels,)),
                                axis=None)
        return s

    assert int(total()) == int(y.sum())
    assert iterator_counts(plain_dataset)["built"] == 0


@pytest.mark.slow
def test_the_benchmark_runs_and_writes_its_record(tmp_path):
    out, png = tmp_path / "eb.json", tmp_path / "eb.png"
    proc = subprocess.run([sys.executable, "-m", "tfdist", "bench", "epoch-boundary", "--rounds", "1", "--epochs", "2",
                           "--train-images", "256", "--test-images", "128", "--json", str(out), "--png", str(png)],
                          capture_output=True, text=True, timeout=900, check=False,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "first step after validation / steady step" in proc.stdout and png.stat().st_size > 0
    record = json.loads(out.read_text())
    assert record["benchmark"] == "epoch-boundary" and record["target_ratio"] == 3.0
    assert sorted(record["order"]) == ["stock", "tfdist"]
    for kind in ("stock", "tfdist"):
        (run,) = record["runs"][kind]
        assert [e["epoch"] for e in run["epochs"]] == [1, 2] and run["train_images"] == 256
        assert run["test_images"] == 128
        assert all(e["ratio"] > 0 and e["steady_step_s"] > 0 for e in run["epochs"])
        summary = record["summary"][kind]
        assert summary["ratio"]["n"] == 2 and summary["ratio"]["min"] <= summary["ratio"]["median"]
    assert record["runs"]["tfdist"][0]["input_iterators"]["built"] == 2  # training and validation, once each
