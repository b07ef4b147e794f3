"""Preemption callback and epoch-keyed data order, in process (the SLURM requeue is in test_slurm_jobs.py)."""

from __future__ import annotations

import signal

import keras
import numpy as np
import pytest

import tfdist
from tfdist.data import EpochOrder
from tfdist.errors import ConfigError
from tfdist.training import Preemption

EPOCHS = 4
N, BATCH = 96, 16  # 6 steps per epoch


def make_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def data():
    rng = np.random.default_rng(1)
    return rng.normal(size=(N, 8)).astype("float32"), rng.integers(0, 3, N).astype("int32")


class SignalAt(keras.callbacks.Callback):
    """Raises a real signal in this process at (epoch, batch), like SLURM would."""

    def __init__(self, epoch, batch, signum=signal.SIGUSR1):
        super().__init__()
        self.at, self.signum, self.epoch = (epoch, batch), signum, -1

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            signal.raise_signal(self.signum)


def fit(backup_dir, *extra, at="epoch", requeues=None, is_chief=True):
    x, y = data()
    order = EpochOrder(seed=3)
    model = make_model()
    stop = Preemption(str(backup_dir), at=at, is_chief=is_chief,
                      requeue=(lambda: requeues.append(1)) if requeues is not None else True, environ={})
    model.fit(order.dataset(x, y, BATCH), epochs=EPOCHS, verbose=0, callbacks=[order, stop, *extra])
    return model, stop, order


def max_diff(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a.get_weights(), b.get_weights()))


def test_epoch_order_depends_only_on_seed_and_epoch():
    order = EpochOrder(seed=7)
    assert np.array_equal(order.permutation(3, 50), EpochOrder(seed=7).permutation(3, 50))
    assert not np.array_equal(order.permutation(3, 50), order.permutation(4, 50))
    assert not np.array_equal(order.permutation(3, 50), EpochOrder(seed=8).permutation(3, 50))
    assert sorted(order.permutation(2, 50)) == list(range(50))
    x, y = np.arange(50, dtype="float32")[:, None], np.arange(50)
    ds = order.dataset(x, y, 8)
    order.epoch = 5
    seen = np.concatenate([b[1].numpy() for b in ds])
    assert np.array_equal(seen, order.permutation(5, 50)) and len(ds) == 7
    assert np.array_equal(np.concatenate([b[0].numpy()[:, 0] for b in ds]), order.permutation(6, 50))
    # no callback: each iteration advances the epoch itself, so epochs still differ (like reshuffling)
    assert order.epoch == 7
    # TF's global seed does not enter: a process with another global seed draws the same order
    import tensorflow as tf

    tf.random.set_seed(1234)
    fresh = EpochOrder(seed=7)
    fresh.epoch = 5
    assert np.array_equal(np.concatenate([b[1].numpy() for b in fresh.dataset(x, y, 8)]), seen)


def test_load_trains_in_epoch_order_by_default():
    data = tfdist.data.load("digits", global_batch_size=64)
    assert isinstance(data.order, EpochOrder) and data.order.seed == 0
    data.order.epoch = 2
    labels = np.concatenate([b[1].numpy() for b in data.train])
    assert np.array_equal(labels, data.arrays.y_train[data.order.permutation(2, len(labels))])
    assert tfdist.data.load("digits", global_batch_size=64, shuffle=False).order is None


# (mode, signal at (epoch, batch), last complete epoch): "epoch" finishes the epoch it was in; "step"
# drops it (it is redone after the restart), unless the signal came in its last step (6 per epoch).
@pytest.mark.parametrize("at,signal_at,done", [("epoch", (1, 2), 1), ("step", (1, 2), 0), ("step", (2, 5), 2)])
def test_interrupted_run_resumes_to_identical_weights(tmp_path, at, signal_at, done):
    reference, _, _ = fit(tmp_path / "ref")
    assert not (tmp_path / "ref").exists()  # finished: the backup deletes its checkpoint

    requeues: list = []
    _, first, order1 = fit(tmp_path / "bk", SignalAt(*signal_at), at=at, requeues=requeues)
    assert first.preempted and first.requeued and requeues == [1]
    assert first.completed_epochs == list(range(done + 1))
    assert sorted(p.name for p in (tmp_path / "bk").iterdir()) == [f"epoch-{done + 1}"]  # kept for the restart

    resumed, second, order2 = fit(tmp_path / "bk")
    assert second.completed_epochs == list(range(done + 1, EPOCHS)) and not second.preempted
    assert order2.epochs_begun == list(range(done + 1, EPOCHS))  # the data order of the epochs it runs
    assert max_diff(reference, resumed) <= 1e-6
    assert not (tmp_path / "bk").exists()


def test_sigterm_checkpoints_without_requeue_and_non_chief_never_requeues(tmp_path):
    requeues: list = []
    _, stop, _ = fit(tmp_path / "a", SignalAt(0, 1, signal.SIGTERM), requeues=requeues)
    assert stop.preempted and not stop.requeued and requeues == []  # scancel sends SIGTERM too
    _, stop, _ = fit(tmp_path / "b", SignalAt(0, 1), requeues=requeues, is_chief=False)
    assert stop.preempted and not stop.requeued and requeues == []
    # handlers are restored after fit
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGUSR1))
    assert signal.getsignal(signal.SIGUSR1) != stop._on_signal


def test_bad_arguments():
    with pytest.raises(ConfigError, match="at must be"):
        Preemption("d", at="batch")
    with pytest.raises(ConfigError, match="needs backup_dir"):
        Preemption()
    with pytest.raises(ConfigError, match="SLURM_JOB_ID"):
        tfdist.cluster.requeue_job({})


def test_plain_tf_data_reshuffle_is_not_resumable(tmp_path):
    """Why EpochOrder exists: tf.data's shuffle(seed, reshuffle_each_iteration=True) restarts its epoch
    sequence in a new process (here: a new dataset object), so a resumed run trains on other batches."""
    import tensorflow as tf

    x, y = data()

    def pipeline():
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(N, seed=3, reshuffle_each_iteration=True).batch(BATCH)

    def run(backup_dir, *extra):
        model = make_model()
        model.fit(pipeline(), epochs=EPOCHS, verbose=0,
                  callbacks=[Preemption(str(backup_dir), requeue=False, environ={}), *extra])
        return model

    reference = run(tmp_path / "ref")
    run(tmp_path / "bk", SignalAt(1, 2))
    resumed = run(tmp_path / "bk")  # "restarted process": a fresh pipeline starts at epoch 0's order
    diff = max_diff(reference, resumed)
    print(f"plain tf.data shuffle, interrupted and resumed: max |dw| = {diff:.3g}")
    assert diff > 1e-3
