"""ZeRO-1/2 on tfdist.HorovodStrategy with 2 real processes: equivalence, shard placement, checkpoints."""

from __future__ import annotations

import json
import os
import sys

import lookups
import numpy as np
import pytest

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}  # PYTHONPATH: conftest's (this clone, tests/site)
for _var in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
    ENV.pop(_var, None)
BIN = os.path.dirname(sys.executable)


def launch(cmd: list[str], timeout: float = 300, devices_per_worker: int = 1) -> tuple[int, str]:
    """Runs `cmd` as 2 Horovod ranks through tfdist's launcher (Gloo); kills everything on timeout."""
    import io

    from tfdist.cluster.launcher import launch as tfdist_launch

    out = io.StringIO()
    code = tfdist_launch(cmd, 2, backend="horovod", devices_per_worker=devices_per_worker, env=ENV, out=out,
                         timeout_s=timeout)
    return code, out.getvalue()


def arrays(path) -> list[np.ndarray]:
    z = np.load(path)
    return [z[f"arr_{i}"] for i in range(len(z.files))]


def max_rel(a: list, b: list) -> float:
    return max(float(np.max(np.abs(x - y)) / max(float(np.max(np.abs(x))), 1e-12)) for x, y in zip(a, b))


def _worker_run(out, devices_per_worker: int = 1):
    code, log = launch([sys.executable, os.path.join(HERE, "zero_horovod_worker.py"), str(out)],
                       devices_per_worker=devices_per_worker)
    assert code == 0, log[-4000:]
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return out, records


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One 2-process job does it all (tests/zero_horovod_worker.py): stages 0/1/2, saves, reloads."""
    return _worker_run(tmp_path_factory.mktemp("zero_hvd"))


def test_zero1_equals_stage0_exactly_and_zero2_within_1e4(run):
    out, records = run
    w0 = arrays(out / "s0_rank0.npz")
    for r in range(2):
        assert records[r]["stages"]["1"]["iterations"] == 20
        for a, b in zip(w0, arrays(out / f"s1_rank{r}.npz")):
            np.testing.assert_array_equal(a, b)  # 20 Adam steps, bit-identical to stage 0
        assert max_rel(w0, arrays(out / f"s2_rank{r}.npz")) < 1e-4
    # and the logical optimizer state of stage 1 equals stage 0's, slot by slot
    for a, b in zip(arrays(out / "s0_state_rank0.npz"), arrays(out / "s1_state_rank0.npz")):
        np.testing.assert_array_equal(a, b)


def test_each_rank_s_model_and_optimizer_are_their_plain_keras_twins(run):
    """tests/test_keras_twins.py's check (tests/twins.py), made by each rank at each stage on the model it trained
    against the same model trained in plain Keras in the same process."""
    _, records = run
    assert [{stage: info["twin"] for stage, info in record["stages"].items()} for record in records] == \
        [{stage: [] for stage in ("0", "1", "2")}] * 2


def test_lookups_with_adam_across_ranks_equal_stage0(run):
    """IndexedSlices of a different length on every rank under Adam (tests/lookups.py): stages 0, 1 and 2 give what
    one device given every rank's slices gives (stock tf.distribute's form; a dense sum would differ), on both
    ranks."""
    _, records = run
    s0 = lookups.one_device(replicas=2)
    assert np.abs(s0 - lookups.one_device(replicas=2, densified=True)).max() > 1e-2
    for r in range(2):
        for stage in ("0", "1", "2"):
            np.testing.assert_allclose(records[r]["stages"][stage]["w_lookups"], s0, rtol=1e-6, atol=1e-6,
                                       err_msg=f"rank {r} stage {stage}")


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_both_ranks_end_bit_identical(run, stage):
    out, _ = run
    for a, b in zip(arrays(out / f"s{stage}_rank0.npz"), arrays(out / f"s{stage}_rank1.npz")):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("stage", ["1", "2"])
def test_slot_shards_live_only_on_their_owner(run, stage):
    _, records = run
    for rank, record in enumerate(records):
        info = record["stages"][stage]
        assert info["replicas"] == 2 and info["num_shards"] == 2
        assert info["shard_ids"] == [rank]  # this process owns exactly its own shard
        shard = -(-info["num_params"] // 2)
        for name in ("momentum", "velocity"):
            (slot,) = info["slots"][name]  # one shard variable per slot in this process, not two
            assert slot["shape"] == [shard]  # ceil(Ψ/N) elements, read from the variable
            assert not slot["distributed"]
        memory = info["memory"]
        assert memory["replicas"] == 2 and memory["formula"]["optimizer_state"] == 8 * info["num_params"] / 2
        (row,) = memory["rows"]
        assert row["optimizer_state"] <= 2 * 4 * shard + 64  # two slots of ceil(Ψ/2) floats + scalars
        assert row["gradients"] == 4 * shard  # two replicas: stage 1 reduce-scatters too (bit-identical)


def test_saved_keras_file_holds_full_state_and_loads_in_plain_keras(run, python):
    out, _ = run
    # stage-0 2-process slots vs what the ZeRO files hold, read by plain Keras on one device
    script = f"""
        import sys, numpy as np, keras
        z = np.load({str(out / 's0_state_rank0.npz')!r})
        ref = [z[f"arr_{{i}}"] for i in range(len(z.files))]
        for name, tol in (("stage1.keras", 1e-6), ("stage2.keras", 1e-4), ("s2_ep5.keras", 1e-4)):
            model = keras.models.load_model({str(out)!r} + "/" + name)
            got = [np.asarray(v.numpy()) for v in model.optimizer.variables]
            assert [g.shape for g in got] == [r.shape for r in ref], name
            diff = max(float(np.abs(g - r).max()) for g, r in zip(got, ref))
            assert diff <= tol, (name, diff)
        backup = keras.models.load_model({str(out / 'stage1.keras')!r})
        backup.load_weights({str(out / 'backup_s1' / 'epoch-5' / 'state.weights.h5')!r})
        diff = max(float(np.abs(np.asarray(v.numpy()) - r).max()) for v, r in zip(backup.optimizer.variables, ref))
        assert diff <= 1e-6, diff
        assert not any(m.startswith(("tfdist", "horovod")) for m in sys.modules)
        print("plain-keras-ok")
    """
    assert "plain-keras-ok" in python(script).stdout
    # ModelCheckpoint: one file per epoch from the chief, nothing left behind by rank 1
    assert sorted(p.name for p in out.glob("s2_ep*.keras")) == [f"s2_ep{e}.keras" for e in range(1, 6)]


def test_rank0_only_save_is_refused_clearly(run):
    _, records = run
    for stage in ("1", "2"):
        message = records[0]["stages"][stage]["rank0_only_save"]
        assert "every rank must take part" in message and "tfdist.training.save_model" in message
        # agreed through the rendezvous store: rank 1 never made the read, named after save_timeout_s
        assert "rank(s) [1] did not make this read within 5 s" in message, message


def test_full_checkpoint_into_zero_continues_like_stage0(run):
    out, records = run
    for record in records:
        for stage in ("0", "1", "2"):
            assert record["continue"][stage]["state_max_diff"] == 0.0  # loaded slots = saved, exactly
            assert record["continue"][stage]["state_count"] == [18, 18]
    ref = arrays(out / "cont0_rank0.npz")
    for r in range(2):
        for a, b in zip(ref, arrays(out / f"cont1_rank{r}.npz")):
            np.testing.assert_array_equal(a, b)
        assert max_rel(ref, arrays(out / f"cont2_rank{r}.npz")) < 1e-4


def test_two_local_devices_per_rank_zero1_exact_zero2_within_1e4(tmp_path):
    """2 ranks x 2 logical CPUs = 4 replicas, 4 shards: each rank owns two, stage 1 all-reduces like stage 0."""
    out, records = _worker_run(tmp_path, devices_per_worker=2)
    w0 = arrays(out / "s0_rank0.npz")
    for r, record in enumerate(records):
        for a, b in zip(w0, arrays(out / f"s1_rank{r}.npz")):
            np.testing.assert_array_equal(a, b)
        diff = max_rel(w0, arrays(out / f"s2_rank{r}.npz"))
        print(f"\nrank {r}: 2x2 ZeRO-2 vs stage 0 max relative difference {diff:.2e}")
        assert diff < 1e-4
        for stage in ("1", "2"):
            info = record["stages"][stage]
            assert info["replicas"] == 4 and info["num_shards"] == 4 and info["shard_ids"] == [2 * r, 2 * r + 1]
            shard = -(-info["num_params"] // 4)
            for name in ("momentum", "velocity"):
                assert [s["shape"] for s in info["slots"][name]] == [[shard], [shard]]
                assert len({s["device"] for s in info["slots"][name]}) == 2  # one shard on each local device
            kept = 4 * info["num_params"] if stage == "1" else 4 * shard  # 4 replicas: stage 1 all-reduces
            assert [row["gradients"] for row in info["memory"]["rows"]] == [kept, kept]
    for stage in (0, 1, 2):
        for a, b in zip(arrays(out / f"s{stage}_rank0.npz"), arrays(out / f"s{stage}_rank1.npz")):
            np.testing.assert_array_equal(a, b)
    lookups_reference = lookups.one_device(replicas=4)  # two local replicas' slices concatenated, then the ranks'
    for r, record in enumerate(records):
        for stage in ("0", "1", "2"):
            np.testing.assert_allclose(record["stages"][stage]["w_lookups"], lookups_reference, rtol=1e-6, atol=1e-6,
                                       err_msg=f"rank {r} stage {stage}")
    for a, b in zip(arrays(out / "s0_state_rank0.npz"), arrays(out / "s1_state_rank0.npz")):
        np.testing.assert_array_equal(a, b)


def test_tfdist_train_strategy_horovod_zero_stage_2_two_local_devices(tmp_path):
    # 2 processes x 2 logical CPUs = 4 replicas: local sums, then hvd.alltoall; --save gathers.
    record, saved = tmp_path / "run.json", tmp_path / "model.keras"
    cmd = [os.path.join(BIN, "tfdist"), "train", "--strategy", "horovod", "--zero-stage", "2", "--dataset",
           "digits", "--epochs", "2", "--batch-size", "64", "--json", str(record), "--save", str(saved),
           "--verbose", "0"]
    code, log = launch(cmd, devices_per_worker=2)
    assert code == 0, log[-4000:]
    run_record = json.loads(record.read_text())
    assert run_record["replicas"] == 4 and run_record["test_accuracy"] >= 0.75, run_record
    digests = {line.split("sha256 ")[1] for line in log.splitlines() if "final weights sha256" in line}
    assert len(digests) == 1, log[-3000:]  # both ranks end bit-identical
    assert saved.exists()


def test_bad_input_gives_config_errors(python):
    out = python("""
        import numpy as np, keras, tfdist
        from tfdist.errors import ConfigError
        for kwargs, words in (({"zero_stage": 4}, "supported stages are {0, 1, 2}"),
                              ({"zero_stage": "1"}, "not supported"),
                              ({"offload": True}, "needs zero_stage=1, 2 or 3"),
                              ({"save_timeout_s": 0}, "save_timeout_s must be a number of seconds > 0")):
            try:
                tfdist.HorovodStrategy(**kwargs)
                raise SystemExit(f"no error for {kwargs}")
            except ConfigError as err:
                assert words in str(err), (kwargs, str(err))
        strategy = tfdist.HorovodStrategy(zero_stage=1)   # a one-process job (no launcher)
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.Nadam(), loss="mse")
        try:
            model.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0)
            raise SystemExit("Nadam accepted")
        except ConfigError as err:
            assert "cannot shard optimizer Nadam" in str(err), str(err)
        print("bad-input-ok")
    """)
    assert "bad-input-ok" in out.stdout


def test_stage0_clips_the_summed_gradient_and_runs_keras_ema_as_one_device(tmp_path):
    # Stock Keras clips each rank's own gradient before the all-reduce and cannot run its EMA overwrite over
    # merge_call replicas; stage 0 takes ZeRO's order (tfdist.zero.stage0_update).
    code, log = launch([sys.executable, os.path.join(HERE, "stage0_clip_worker.py"), str(tmp_path)])
    assert code == 0, log[-3000:]
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in (0, 1)]
    weights = lambda z, k: [z[f"{k}_{i}"] for i in range(4)]  # noqa: E731
    strategy, single = weights(ranks[0], "strategy"), weights(ranks[0], "single")
    assert max_rel(strategy, single) < 1e-5
    assert max_rel(single, weights(ranks[0], "unclipped")) > 1e-2  # clipping (and the EMA) really acted
    for a, b in zip(strategy, weights(ranks[1], "strategy")):
        np.testing.assert_array_equal(a, b)
