"""ZeRO-1/2 under tfdist.MultiWorkerMirroredStrategy: real 2-process runs on loopback (2x1 and 2x2 replicas).

One launch per topology runs stages 0, 1 and 2 in turn (a strategy each, over the job the first one joined) and
checks several things per stage: 20 Adam steps equal to stage 0 (ZeRO-1 bitwise, ZeRO-2 within 1e-4), identical
workers, shards only on their owners (shapes and devices read from the variables), checkpoints written with every
worker's help holding the full logical state (loaded in plain Keras), BackupAndRestore resume, and a stage-0
checkpoint continued under ZeRO.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import sys

import lookups
import numpy as np
import pytest

from tfdist.cluster.launcher import launch
from tfdist.errors import ConfigError

PARAMS = 8 * 16 + 16 + 16 + 1  # the job's model
JOB = os.path.join(os.path.dirname(__file__), "zero_multiworker_job.py")

# tag: (workers, devices per worker, stage, offload, stage-0 checkpoint to continue from)
RUNS = {
    "2x1-s0": (2, 1, 0, False, None),
    "2x1-s1": (2, 1, 1, False, "2x1-s0"),
    "2x1-s2": (2, 1, 2, False, "2x1-s0"),
    "2x2-s0": (2, 2, 0, False, None),
    "2x2-s1": (2, 2, 1, False, "2x2-s0"),
    "2x2-s2": (2, 2, 2, True, "2x2-s0"),  # with offload: shards in the worker's host memory
}

def _launch(script, n: int, devices: int, *args: str) -> str:
    """The launch's output; fails on a bad exit."""
    out = io.StringIO()
    rc = launch([sys.executable, str(script), *args], n, devices_per_worker=devices, out=out, timeout_s=720,
                env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert rc == 0, out.getvalue()[-4000:]
    return out.getvalue()


def _runs_logs(log: str, tags: list[str]) -> dict[str, str]:
    """Each run's lines of a launch's output (every rank's lines from its "RUN START tag" to its next)."""
    logs, current = {tag: [] for tag in tags}, {}
    for line in log.splitlines():
        rank, _, text = line.partition("] ")
        if text.startswith("RUN START "):
            current[rank] = text.split()[2]
        if rank in current:
            logs[current[rank]].append(line)
    return {tag: "\n".join(lines) for tag, lines in logs.items()}


@pytest.mark.parametrize("kwargs, message", [
    ({"zero_stage": 4}, "supported stages are {0, 1, 2}"),
    ({"zero_stage": "1"}, "supported stages are {0, 1, 2}"),
    ({"zero_stage": 1, "offload": "yes"}, "offload must be True or False"),
    ({"offload": True}, "needs zero_stage=1, 2 or 3"),
])
def test_bad_zero_arguments_are_config_errors(kwargs, message):
    import tfdist  # checked before anything touches TensorFlow's runtime or the cluster

    with pytest.raises(ConfigError, match=re.escape(message)):
        tfdist.MultiWorkerMirroredStrategy(**kwargs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, plain_keras):
    out = tmp_path_factory.mktemp("zero_mw")
    logs = {}
    for topology in dict.fromkeys((n, m) for n, m, *_ in RUNS.values()):  # one launch each, stage 0 first
        tags = [tag for tag, (n, m, *_) in RUNS.items() if (n, m) == topology]
        runs = ",".join(f"{tag}:{stage}:{int(offload)}:{ref or '-'}"
                        for tag, (_, _, stage, offload, ref) in RUNS.items() if tag in tags)
        logs.update(_runs_logs(_launch(JOB, *topology, str(out), runs), tags))
    data = {}
    for tag in RUNS:
        for r in (0, 1):
            with open(out / f"{tag}-rank{r}.json") as f:
                data[tag, r] = {k: [np.asarray(s) for s in v] if k.startswith("slots") else v
                                for k, v in json.load(f).items()}
    plain = {}
    for path in [str(out / f"{tag}{suffix}.keras") for tag in RUNS if RUNS[tag][2] for suffix in ("", "-saved")]:
        record = plain_keras(path)
        plain[path] = {"weights": np.concatenate([np.ravel(w) for w in record["weight_list"]]).tolist(),
                       "slots": list(record["slot_values"].values()), "optimizer": record["optimizer"]}
    return out, data, logs, plain


def rel(a, b) -> float:
    a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12))


def max_slot_diff(a: list, b: list) -> float:
    assert [np.shape(x) for x in a] == [np.shape(y) for y in b]
    return max(float(np.max(np.abs(np.asarray(x, "float64") - y))) for x, y in zip(a, b))


@pytest.mark.slow
def test_zero1_equals_stage0_exactly_and_zero2_within_1e4(runs):
    _, data, _, _ = runs
    for topo in ("2x1", "2x2"):
        s0, s1, s2 = data[f"{topo}-s0", 0], data[f"{topo}-s1", 0], data[f"{topo}-s2", 0]
        for key in ("w20", "w30"):
            np.testing.assert_array_equal(s1[key], s0[key], err_msg=f"{topo} {key}")
            print(f"\n{topo} {key}: ZeRO-2 vs stage 0 max relative difference {rel(s2[key], s0[key]):.2e}")
            assert rel(s2[key], s0[key]) <= 1e-4, (topo, key)
        assert max_slot_diff(s1["slots"], s0["slots"]) <= 1e-6
        assert rel(np.concatenate([s.ravel() for s in s2["slots"]]),
                   np.concatenate([s.ravel() for s in s0["slots"]])) <= 1e-4
        assert not np.allclose(s0["w20"], s0["w30"])  # training moved the weights


@pytest.mark.slow
def test_global_norm_clipping_uses_the_global_gradient(runs):
    _, data, _, _ = runs
    for tag in RUNS:
        d = data[tag, 0]
        diff = rel(d["w_clip"], d["w_clip_single"])
        print(f"\n{tag}: clipped run vs one device max relative difference {diff:.2e}")
        assert rel(d["w_clip"], d["w_clip_single"]) <= 1e-5, tag
        assert rel(d["w_clip"], d["w_unclipped_single"]) > 1e-2, tag  # clipping really changed the steps
        np.testing.assert_array_equal(d["w_clip"], data[tag, 1]["w_clip"])


@pytest.mark.slow
def test_adamw_schedule_and_mixed_precision_match_stage0(runs):
    _, data, _, _ = runs
    for topo in ("2x1", "2x2"):
        s0, s1, s2 = (data[f"{topo}-s{stage}", 0] for stage in (0, 1, 2))
        for stage, d in enumerate((s0, s1, s2)):
            assert d["adamw_mixed_optimizer"] == ["LossScaleOptimizer", "float16", 10, stage], topo
        np.testing.assert_array_equal(s1["w_adamw_mixed"], s0["w_adamw_mixed"], err_msg=topo)
        diff = rel(s2["w_adamw_mixed"], s0["w_adamw_mixed"])
        print(f"\n{topo} AdamW + schedule + mixed_float16: ZeRO-2 vs stage 0 max relative difference {diff:.2e}")
        assert diff <= 1e-4, topo
        assert not np.allclose(s0["w_adamw_mixed"], s0["w30"])  # a different run really trained


@pytest.mark.slow
def test_lookups_with_adam_across_workers_equal_stage0(runs):
    """Section 7 of the job: IndexedSlices of a different length on every replica, Adam; stages 0, 1 and 2 give what
    one device given every replica's slices (stock tf.distribute's all-gather) gives; a dense sum would differ."""
    _, data, _, _ = runs
    for topo, replicas in (("2x1", 2), ("2x2", 4)):
        s0 = lookups.one_device(replicas)
        assert np.abs(s0 - lookups.one_device(replicas, densified=True)).max() > 1e-2
        for stage in (0, 1, 2):
            for rank in (0, 1):
                np.testing.assert_allclose(data[f"{topo}-s{stage}", rank]["w_lookups"], s0, rtol=1e-6, atol=1e-6,
                                           err_msg=f"{topo} stage {stage} rank {rank}")


@pytest.mark.slow
def test_both_workers_end_bit_identical(runs):
    _, data, logs, _ = runs
    for tag in RUNS:
        a, b = data[tag, 0], data[tag, 1]
        assert a["replicas"] == b["replicas"] == RUNS[tag][0] * RUNS[tag][1]
        for key in ("w20", "w30", "w30_resumed", "w_adamw_mixed") + (("w30_loaded",) if RUNS[tag][4] else ()):
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"{tag} {key}")
        assert max_slot_diff(a["slots"], b["slots"]) == 0.0  # every worker reads the same full state
        assert f"[0] JOB DONE {tag} 0" in logs[tag] and f"[1] JOB DONE {tag} 1" in logs[tag]


@pytest.mark.slow
def test_each_worker_s_model_and_optimizer_are_their_plain_keras_twins(runs):
    """tests/test_keras_twins.py's check (tests/twins.py), made by each worker of each run on the model it trained
    against the same model trained in plain Keras in the same process."""
    _, data, _, _ = runs
    assert {(tag, r): data[tag, r]["twin"] for tag in RUNS for r in (0, 1)} == {(tag, r): [] for tag in RUNS
                                                                                for r in (0, 1)}


@pytest.mark.slow
def test_slot_shards_live_only_on_their_owner(runs):
    _, data, _, _ = runs
    for tag, (n, m, stage, offload, _) in RUNS.items():
        if not stage:
            continue
        shard = math.ceil(PARAMS / (n * m))
        for r in (0, 1):
            d = data[tag, r]
            assert d["shard_ids"] == list(range(r * m, (r + 1) * m)), tag
            assert d["shard_shapes"] == [[shard]] * (2 * m), tag  # Adam: m and v, one shard per local replica
            task = f"/job:worker/replica:0/task:{r}/"
            want = ([f"{task}device:CPU:0"] * m if offload else d["local_devices"]) * 2
            assert d["shard_devices"] == want, tag
            assert all(dev.startswith(task) for dev in d["local_devices"])
            # all optimizer state this process holds: its shards, plus the iteration count and learning rate
            assert d["inner_state_elements"] == 2 * m * shard + 2, tag
            mem = d["memory"]
            assert mem["replicas"] == n * m and len(mem["rows"]) == m, tag
            assert mem["formula"]["optimizer_state"] == 8 * PARAMS / (n * m)
            if not offload:
                for row in mem["rows"]:
                    assert 8 * shard <= row["optimizer_state"] <= 8 * shard + 64, (tag, row)
                    # stage 1 reduce-scatters too when that is bit-identical: with two replicas
                    kept = 4 * PARAMS if stage == 1 and n * m > 2 else 4 * shard
                    assert row["gradients"] == kept, (tag, row)


@pytest.mark.slow
def test_checkpoints_hold_the_full_logical_state_and_load_in_plain_keras(runs):
    import tensorflow as tf

    out, data, _, plain = runs
    assert not list(out.glob("*rank1*.keras"))
    for tag, (_, _, stage, _, _) in RUNS.items():
        for r in (0, 1):
            assert data[tag, r]["leftovers"] == [], tag  # non-chief scratch files are gone
        if not stage:
            continue
        reference = data[tag.replace(f"-s{stage}", "-s0"), 0]
        for suffix in ("", "-saved"):  # tfdist.training.ModelCheckpoint, tfdist.training.save_model
            loaded = plain[str(out / f"{tag}{suffix}.keras")]
            assert loaded["optimizer"] == "Adam"
            slots = [np.asarray(s) for s in loaded["slots"]]
            assert max_slot_diff(slots, data[tag, 0]["slots"]) == 0.0, tag
            np.testing.assert_array_equal(loaded["weights"], data[tag, 0]["w20"])
            if stage == 1:
                assert max_slot_diff(slots, reference["slots"]) <= 1e-6, tag
        reader = tf.train.load_checkpoint(str(out / f"{tag}-tf"))  # tf.train.Checkpoint, same logical state
        slots = data[tag, 0]["slots"]
        for k in range(2, len(slots)):  # after the iteration count and the learning rate
            np.testing.assert_array_equal(reader.get_tensor(f"optimizer/_variables/{k}/.ATTRIBUTES/VARIABLE_VALUE"),
                                          slots[k])


@pytest.mark.slow
def test_backup_resume_and_stage0_checkpoint_continue_under_zero(runs):
    _, data, logs, _ = runs
    for tag, (_, _, stage, _, ref) in RUNS.items():
        d = data[tag, 0]
        assert d["resumed_epoch"] == 2 and "resuming at epoch 3" in logs[tag]
        np.testing.assert_array_equal(d["w30_resumed"], d["w30"], err_msg=tag)  # resume == uninterrupted
        if ref is None:
            continue
        r = data[ref, 0]
        np.testing.assert_array_equal(d["w20_loaded"], r["w20"])
        assert max_slot_diff(d["slots_loaded"], r["slots"]) == 0.0  # the logical state, scattered exactly
        if stage == 1:
            np.testing.assert_array_equal(d["w30_loaded"], r["w30"], err_msg=tag)
        else:
            assert rel(d["w30_loaded"], r["w30"]) <= 1e-4, tag


CHIEF_ONLY_SAVE = """
import os, sys, time
import tfdist
strategy = tfdist.MultiWorkerMirroredStrategy(timeout_s=8, zero_stage=1)
import keras, numpy as np
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
model.fit(np.ones((32, 4), "float32"), np.ones((32, 1), "float32"), batch_size=8, verbose=0)
if tfdist.cluster.is_chief(strategy):
    try:
        model.save(os.path.join(sys.argv[1], "chief-only.keras"))  # the other worker does not take part
    except tfdist.errors.ConfigError as err:
        print("CONFIG ERROR", err, flush=True)
else:
    time.sleep(16)  # alive, but busy elsewhere
"""


@pytest.mark.slow
def test_a_save_without_the_other_workers_fails_clearly_instead_of_hanging(tmp_path):
    script = tmp_path / "chief_only.py"
    script.write_text(CHIEF_ONLY_SAVE)
    log = _launch(script, 2, 1, str(tmp_path))
    assert "[0] CONFIG ERROR ZeRO all-gather across workers timed out (timeout_s=8.0)" in log, log[-3000:]
    assert "tfdist.training.ModelCheckpoint / BackupAndRestore / save_model" in log


@pytest.mark.slow
def test_cli_train_multiworker_zero1_gives_the_weights_of_stage_0(tmp_path):
    digests = {}
    for stage in (0, 1):
        save = tmp_path / f"s{stage}.keras"
        out = io.StringIO()
        rc = launch([sys.executable, "-m", "tfdist", "train", "--strategy", "multiworker", "--zero-stage", str(stage),
                     "--dataset", "digits", "--epochs", "1", "--verbose", "0", "--save", str(save)], 2, out=out,
                    timeout_s=240, env={"TF_CPP_MIN_LOG_LEVEL": "2"})
        log = out.getvalue()
        assert rc == 0, log[-4000:]
        assert ("zero_stage=1" in log) == (stage == 1)
        found = dict(re.findall(r"\[rank (\d)\]: final weights sha256 ([0-9a-f]{16})", log))
        assert found["0"] == found["1"], log[-3000:]  # both workers bit-identical
        digests[stage] = found["0"]
        assert save.exists()  # written by the chief, with the other worker's shards gathered
    print(f"\nfinal weights sha256: stage 0 {digests[0]}, stage 1 {digests[1]}")
    assert digests[0] == digests[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s0.keras", "s1.keras"]
