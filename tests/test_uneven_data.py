"""Uneven per-rank data: ranks agree at every step whether it happens ('stop' at the shortest rank, or 'join').

The multi-process tests run one job per backend (MultiWorkerMirroredStrategy over TF_CONFIG with 2 local
replicas per worker, HorovodStrategy over Gloo with one), each with both modes and both kinds of cardinality
(tests/uneven_worker.py): rank 0 reads batches of 4, 4, 4, 4, 2 rows, rank 1 reads 4, 4, 4, 3. Every job runs under a timeout, so a hang fails the test. The
weights are compared with a NumPy reference of the same steps.
"""

from __future__ import annotations

import io
import json
import math
import os
import sys

import numpy as np
import pytest

from tfdist.cluster.launcher import launch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import uneven_worker  # (the worker's data: the reference trains on the same rows)

EPOCHS = 2
KERNEL0 = np.array([[0.1], [0.2], [-0.1]])


# --- the NumPy reference ------------------------------------------------------------------------------------
def _batches(rank: int) -> list[tuple[np.ndarray, np.ndarray]]:
    x, y = (a.astype("float64") for a in uneven_worker.rank_data(rank))
    return [(x[i:i + uneven_worker.BATCH], y[i:i + uneven_worker.BATCH]) for i in range(0, len(x), uneven_worker.BATCH)]


def _mse_grad(w, b, x, y):
    err = x @ w + b - y
    return 2 * x.T @ err / len(x), 2 * err.sum(0) / len(x), float((err ** 2).mean())


def _steps(mode: str, m: int = 1) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Each step's batches (one per replica that has data), as the agreement schedules them, with `m` replicas
    per rank: a rank's batches go round-robin to its replicas, m per step."""
    ranks = [_batches(0), _batches(1)]
    if mode == "stop":  # only steps where every replica of every rank has a batch
        count = min(len(batches) // m for batches in ranks)
    else:
        count = max(math.ceil(len(batches) / m) for batches in ranks)
    return [[batches[k * m + i] for batches in ranks for i in range(m) if k * m + i < len(batches)]
            for k in range(count)]


def reference(mode: str, m: int = 1) -> dict:
    """SGD on the agreed steps. 'stop': every replica has data, Keras' gradient (the mean of the replicas'
    mean gradients); 'join': the mean over the step's real rows. The epoch loss is Keras': the replicas'
    losses weighted by their rows."""
    w, b, losses = KERNEL0.copy(), np.zeros(1), []
    for _ in range(EPOCHS):
        total, rows = 0.0, 0
        for parts in _steps(mode, m):
            grads = [_mse_grad(w, b, x, y) for x, y in parts]
            total += sum(g[2] * len(x) for g, (x, _) in zip(grads, parts))
            rows += sum(len(x) for x, _ in parts)
            if mode == "stop":
                gw, gb = (sum(g[i] for g in grads) / len(parts) for i in (0, 1))
            else:
                gw, gb, _ = _mse_grad(w, b, np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts]))
            w, b = w - uneven_worker.LR * gw, b - uneven_worker.LR * gb
        losses.append(total / rows)
    # evaluate on the same agreed steps: the mean squared error over their rows
    x = np.concatenate([x for parts in _steps(mode, m) for x, _ in parts])
    y = np.concatenate([y for parts in _steps(mode, m) for _, y in parts])
    return {"weights": np.concatenate([w.ravel(), b]), "loss": losses,
            "evaluate": float(((x @ w + b - y) ** 2).mean()), "steps": len(_steps(mode, m))}


# --- fast checks: the look-ahead transform, the agreed step count, the option ------------------------------
def test_lookahead_tells_each_element_what_follows():
    import tensorflow as tf

    from tfdist.data_parallel.uneven_lookahead import with_lookahead

    batches = tf.data.Dataset.range(7).batch(3)  # 3, 3, 1 rows
    one = list(with_lookahead(batches, 1).as_numpy_iterator())
    assert [e.tolist() for e, _ in one] == [[0, 1, 2], [3, 4, 5], [6]]  # the elements, in order, once
    assert [m.tolist() for _, m in one] == [[1, 3], [1, 1], [0, 0]]
    # two local replicas: each element sees the next two (the last replica's element: the next step)
    assert [m.tolist() for _, m in with_lookahead(batches, 2).as_numpy_iterator()] == [[2, 4], [1, 1], [0, 0]]
    static = tf.data.Dataset.from_tensor_slices((np.ones((10, 3), "float32"), np.ones(10))).batch(4, drop_remainder=True)
    paired = with_lookahead(static, 1)
    assert int(paired.cardinality()) == 2 and paired.element_spec[0] == static.element_spec
    unknown = with_lookahead(static.filter(lambda x, y: True), 1)
    assert int(unknown.cardinality()) == int(tf.data.UNKNOWN_CARDINALITY)
    assert list(with_lookahead(tf.data.Dataset.range(0).batch(2), 1)) == []
    ragged = tf.data.Dataset.from_tensor_slices(tf.ragged.constant([[1], [2, 3]])).batch(2)
    assert with_lookahead(ragged, 1) is None  # no empty stand-in: such pipelines agree at every step


def test_agreed_steps_and_the_option():
    from tfdist.errors import ConfigError
    from tfdist.data_parallel.uneven import INFINITE, UNKNOWN, agreed_steps, check_mode

    assert agreed_steps([5, 4], "stop") == 4 and agreed_steps([5, 4], "join") == 5
    assert agreed_steps([INFINITE, 4], "stop") == 4 and agreed_steps([INFINITE, 4], "join") == INFINITE
    assert agreed_steps([UNKNOWN, 4], "stop") == UNKNOWN == agreed_steps([4, UNKNOWN], "join")
    with pytest.raises(ConfigError, match=r"uneven_data must be one of \['stop', 'join'\].*got 'drop'"):
        check_mode("drop")


def test_strategies_check_the_option_before_starting():
    import tfdist
    from tfdist.errors import ConfigError

    for make in (tfdist.MultiWorkerMirroredStrategy, tfdist.HorovodStrategy):
        with pytest.raises(ConfigError, match="uneven_data must be one of"):
            make(uneven_data="skip")


# --- both backends, real processes -------------------------------------------------------------------------
def _run(backend: str, out, devices: int) -> tuple[list[dict], str]:
    log = io.StringIO()
    code = launch([sys.executable, os.path.join(HERE, "uneven_worker.py"), backend, str(out)], 2, backend=backend,
                  devices_per_worker=devices, out=log, timeout_s=240,
                  env={"TF_CPP_MIN_LOG_LEVEL": "2",
                       "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ["PYTHONPATH"]])})
    assert code != 124, "the job hung (stopped after 240 s):\n" + log.getvalue()[-4000:]
    assert code == 0, log.getvalue()[-4000:]
    return [json.load(open(out / f"rank{r}.json")) for r in (0, 1)], log.getvalue()


def _check(records: list[dict], m: int) -> None:
    for mode in ("stop", "join"):
        want = reference(mode, m)
        for kind in ("known", "unknown"):
            tag = f"{mode}-{kind}"
            got = [r[tag] for r in records]
            weights = [np.concatenate([np.ravel(a) for a in g["weights"]]) for g in got]
            np.testing.assert_array_equal(weights[0], weights[1], err_msg=f"{tag}: ranks differ")
            delta = np.abs(weights[0] - want["weights"]).max()
            print(f"\n{tag}: {want['steps']} steps per epoch, max |w - reference| = {delta:.1e}")
            assert delta < 1e-5, tag
            for g in got:  # fit ended every epoch cleanly, after the agreed steps, on every rank
                assert g["batches"] == [want["steps"]] * EPOCHS, tag
                np.testing.assert_allclose(g["loss"], want["loss"], rtol=1e-5, err_msg=tag)
                assert g["cardinality"] == (want["steps"] if kind == "known" else -2), tag
                assert g["steps_param"] == (want["steps"] if kind == "known" else None), tag
                if kind == "known":
                    assert g["evaluate"] == pytest.approx(want["evaluate"], rel=1e-5), tag
    # Every step but an epoch's first is agreed inside the previous step's gradient all-reduce (with an unknown
    # cardinality, so is the end of the epoch); evaluate's steps have no gradient all-reduce: they agree apart.
    fused = sum(EPOCHS * (reference(mode, m)["steps"] - 1 + (kind == "unknown"))
                for mode in ("stop", "join") for kind in ("known", "unknown"))
    for r in records:
        assert r["agreements"]["fused"] == fused, r["agreements"]
        # experimental_distribute_dataset: TF counts its cardinality in steps already (7 global batches of 16)
        assert r["global_batches"] == {"cardinality": 7, "steps": 7}, r["global_batches"]


@pytest.mark.slow
def test_multiworker_ranks_with_different_lengths_agree_on_every_step(tmp_path):
    """2 workers x 2 local replicas (the merge_call path: 4 replicas, 2 batches per rank and step)."""
    records, _ = _run("tf", tmp_path, devices=2)
    assert records[0]["replicas"] == 4
    _check(records, m=2)


@pytest.mark.slow
def test_horovod_ranks_with_different_lengths_agree_on_every_step(tmp_path):
    """2 ranks x 1 replica (the path without merge_call: the flags join the replica's own all-reduce)."""
    pytest.importorskip("horovod.tensorflow")
    records, _ = _run("horovod", tmp_path, devices=1)
    assert records[0]["replicas"] == 2
    _check(records, m=1)


def test_reference_is_what_the_modes_promise():
    """The reference itself: 'stop' runs 4 steps of every rank's first batches, 'join' 5 with rank 0 alone
    at the fifth, whose gradient is that batch's own mean gradient."""
    assert [len(p) for p in _steps("stop")] == [2, 2, 2, 2]
    assert [len(p) for p in _steps("join")] == [2, 2, 2, 2, 1]
    assert [len(x) for x, _ in _steps("join")[3]] == [4, 3] and [len(x) for x, _ in _steps("join")[4]] == [2]
