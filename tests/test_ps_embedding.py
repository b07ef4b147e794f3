"""Embedding tables sharded over parameter servers: sparse lookups, per-shard updates and initialisation.

Real jobs (slow), through the launcher on loopback:
- a small table (4000 x 16) on 2 servers, trained with fit next to a plain Keras copy: identical numbers,
  and the traced step never holds the whole table (ps_embedding_job.py);
- a 977 MiB table on 4 servers with every process in a memory cgroup capped below the table: training
  finishes; the same table on 1 server under the same cap is OOM-killed (ps_big_table_job.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import zero_cgroups
from tfdist.cluster.launcher import launch

HERE = Path(__file__).parent
# Each process joins its memory-capped cgroup itself, and must be charged for all it holds, TensorFlow's
# import included: fresh processes, not forks of the suite's zygote (whose pages are charged where it lives).
pytestmark = pytest.mark.usefixtures("fresh_processes")
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}
PS = [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in range(4)]


class _Lines:
    def __init__(self):
        self.lines: list[str] = []

    def write(self, text: str) -> int:
        self.lines.extend(text.splitlines())
        return len(text)

    def flush(self) -> None:
        pass


@pytest.mark.slow
def test_a_sharded_table_trains_like_plain_keras_and_no_step_holds_the_whole_table(tmp_path):
    out = _Lines()
    code = launch([sys.executable, str(HERE / "ps_embedding_job.py"), str(tmp_path)], 1, ps=2, out=out, env=ENV,
                  timeout_s=400)
    log = "\n".join(out.lines)
    assert code == 0, log[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    both = [[[2000, 16], PS[0]], [[2000, 16], PS[1]]]

    # Creation: every table and Adam slot split over both servers; each shard initialised there.
    init = result["init"]
    assert all(shards == both for shards in init["shards"].values()), init["shards"]
    assert init["slots"] == [both, both] and init["slots_zero"]
    assert init["zeros_equal"] and init["constant_equal"]  # deterministic initializers: the unsharded values
    # Random ones: drawn per block of rows aligned to the whole table (the shard boundary, row 2000, falls
    # inside a 64-row block): equal to the blocks drawn locally, so independent of the number of servers;
    # not the unsharded draw, but the same distribution, and no two rows alike.
    assert init["uniform_vs_blocks"] == 0.0
    assert init["uniform_vs_unsharded"] > 0.01
    assert -0.05 <= init["uniform_range"][0] < -0.049 and 0.049 < init["uniform_range"][1] <= 0.05
    assert init["uniform_distinct_rows"] == 4000
    # GlorotUniform's limit comes from the whole shape (4000 + 16 fans), not from a shard's (2000 + 16).
    assert 0.99 * init["glorot_limit"] < init["glorot_max"] <= init["glorot_limit"]
    # An initializer with no per-shard form (Orthogonal) is computed whole by TensorFlow, as before, and said.
    assert init["orthogonal_equal"]
    assert [w for w in init["warnings"] if "Orthogonal initializer" in w and "no per-shard form" in w], init["warnings"]

    # Training with fit (1 worker: steps in order) equals plain Keras on the same batches, to the bit.
    train = result["train"]
    for name, slots in (("SGD", 0), ("AdamW", 2), ("Adagrad", 1)):
        assert train[name]["num_slots"] == slots
        assert train[name]["weights"] == 0.0 and train[name]["slots"] == 0.0 and train[name]["predict"] == 0.0, train
        assert np.isfinite(train[name]["evaluate_workers"])
    # SGD and Adagrad update only the rows the batches used, except the padding id 0 (mask_zero: zero
    # gradient); AdamW's decoupled weight decay shrinks every row.
    assert train["SGD"]["changed_rows"] == train["Adagrad"]["changed_rows"] == train["SGD"]["used_rows"] - 1
    assert train["AdamW"]["changed_rows"] == 4000

    # tf.train.Checkpoint of the AdamW model (table, head, both Adam slots): one entry per shard of the table
    # and of each slot, named by its rows, written by the server that holds it (one data file per server);
    # restored exactly into the shards.
    checkpoint = result["checkpoint"]
    assert checkpoint["exact"], checkpoint
    per_shard = [["VARIABLE_VALUE_rows_0_2000", [2000, 16]], ["VARIABLE_VALUE_rows_2000_4000", [2000, 16]]]
    assert checkpoint["sharded_entries"] == sorted(per_shard * 3), checkpoint  # the table and its two Adam slots
    assert [4000, 16] not in checkpoint["whole_entries"], checkpoint  # the head and counters stay whole entries
    assert [f for f in checkpoint["files"] if ".data-" in f] == [f"ckpt.data-0000{i}-of-00003" for i in range(3)]

    # Called directly: negative ids, ids on the shard boundary, float, sparse and ragged ids, and a float16
    # output, as Keras.
    # A subclassed model (layers made after the strategy met it) gets the sharded lookup too.
    assert result["layer"] == {"dtype": "float16", "negative_and_boundary": 0.0, "float_ids": 0.0, "sparse_ids": 0.0,
                               "ragged_ids": 0.0, "subclassed_sharded": True, "subclassed_wrapped": True,
                               "subclassed_predict": 0.0}

    # The traced training step: the table's shards are read and written only by ops on their own server
    # (gathers of the used rows; SGD and Adagrad scatter rows back, AdamW rewrites its shard there), no op
    # has an output as large as the table, and nothing off the servers is even shard-sized (largest: 160
    # elements, the head's kernel; the gathered rows' size follows the batch).
    for name in ("SGD", "AdamW", "Adagrad"):
        (graph,) = result["graph"][name]
        owners = {f"shard {i} on {PS[i]}" for i in (0, 1)}
        assert {op.split(" ", 1)[1] for op in graph["table_ops"]} == owners, graph["table_ops"]
        assert graph["full_table_ops"] == [] and graph["shard_sized_off_ps"] == [], graph
        assert graph["largest_off_ps"] <= 160
    for name in ("SGD", "Adagrad"):
        kinds = {op.split(" ", 1)[0] for op in result["graph"][name][0]["table_ops"]}
        assert kinds == {"ResourceGather", "ResourceScatterSub"}, result["graph"][name]
    assert result["graph"]["lookup_tfdist"]["table_ops"] == [f"ResourceGather shard {i} on {PS[i]}" for i in (0, 1)]
    assert result["graph"]["lookup_tfdist"]["full_table_ops"] == []
    # Keras' own Embedding.call on the same table concatenates both shards on the worker, every step.
    assert "ConcatV2 GatherV2/concat the worker" in result["graph"]["lookup_keras"]["full_table_ops"]

    # An optimizer whose update is not elementwise (Lamb's trust ratio) updates the table whole, and says so.
    assert np.isfinite(result["fallback"]["loss"]).all()
    assert any("Lamb is not known to update elementwise" in w and "/table/embeddings (sharded over 2 servers)" in w
               for w in result["fallback"]["warnings"]), result["fallback"]


@pytest.mark.slow
def test_the_checkpoint_benchmark_measures_every_process_and_restores_exactly(tmp_path):
    """`tfdist bench ps-checkpoint` on a small table (the figures come from the full-size run in
    docs/benchmarks.md): its record names every process of the job and each round restores the table exactly."""
    out, png = tmp_path / "ps_checkpoint.json", tmp_path / "ps_checkpoint.png"
    proc = subprocess.run([sys.executable, "-m", "tfdist", "bench", "ps-checkpoint", "--rows", "40000", "--dim", "16",
                           "--servers", "2", "--rounds", "1", "--dir", str(tmp_path / "job"), "--json", str(out),
                           "--png", str(png)], capture_output=True, text=True, timeout=400, check=False,
                          env={**os.environ, **ENV})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert [shape for shape, _ in record["shards"]] == [[20000, 16], [20000, 16]] and png.stat().st_size > 0
    assert len(record["data_files"]) == 3 and all(r["restored_exactly"] for r in record["rounds"])  # servers + chief
    assert set(record["summary"]["save"]) == {"chief0", "worker1", "ps2", "ps3"}
    for phase in ("save", "restore"):
        assert all(s["n"] == 1 and s["min"] <= s["median"] <= s["max"] for s in record["summary"][phase].values())


# --- Pieces, in process (fast) -------------------------------------------------------------------------------
def test_fill_gives_every_row_the_same_value_however_the_table_is_split(monkeypatch):
    import keras
    import tensorflow as tf

    from tfdist.parameter_server import _shard_init as shard_init

    monkeypatch.setattr(shard_init, "BLOCK_BYTES", 64 * 8 * 4)  # blocks of 64 rows of 8 float32
    shape = (1000, 8)

    def filled(initializer, sizes: list[int]) -> np.ndarray:
        shards = [tf.Variable(tf.zeros((n, 8))) for n in sizes]
        shard_init.fill(shards, initializer, shape, "float32")
        return np.concatenate([s.numpy() for s in shards])

    glorot = keras.initializers.GlorotUniform(seed=5)
    whole = filled(glorot, [1000])
    assert np.array_equal(whole, filled(glorot, [334, 333, 333])) and np.array_equal(whole, filled(glorot, [500, 500]))
    limit = np.sqrt(6 / (1000 + 8))  # the whole shape's fans, not a shard's
    assert 0.99 * limit < np.abs(whole).max() <= limit
    assert len(np.unique(whole, axis=0)) == 1000  # no two blocks drawn alike
    assert np.array_equal(filled(keras.initializers.Constant(0.5), [600, 400]), np.full(shape, 0.5, np.float32))
    assert shard_init.for_shard(keras.initializers.Orthogonal(), shape, 0) is None  # no per-shard form


def test_a_checkpoint_holds_one_entry_per_shard_and_restores_into_the_same_split(tmp_path):
    """tf.train.Checkpoint of a sharded variable: one entry per shard named by its rows (each read and written where
    the shard lives), restored exactly; a model split otherwise finds no entry for its rows, and TensorFlow names it
    (docs/troubleshooting.md, "A parameter-server checkpoint does not restore")."""
    import tensorflow as tf

    from tfdist.parameter_server._tf_sharded import ShardedVariable

    def holder(rows: list[int]) -> tf.Module:
        parts, start = [], 0
        for i, n in enumerate(rows):
            with tf.device(f"/cpu:{i}"):
                parts.append(tf.Variable(tf.reshape(tf.range(start * 2, (start + n) * 2, dtype=tf.float32), (n, 2))))
            start += n
        module = tf.Module()
        module.table = ShardedVariable(parts, name="table")
        return module

    saved = holder([3, 2])
    path = tf.train.Checkpoint(m=saved).write(str(tmp_path / "ckpt"))
    entries = [entry for entry in tf.train.list_variables(path) if "table" in entry[0]]
    assert entries == [("m/table/.ATTRIBUTES/VARIABLE_VALUE_rows_0_3", [3, 2]),
                       ("m/table/.ATTRIBUTES/VARIABLE_VALUE_rows_3_5", [2, 2])]
    restored = holder([3, 2])
    for shard in restored.table.variables:
        shard.assign(tf.zeros_like(shard))
    tf.train.Checkpoint(m=restored).read(path).assert_consumed()
    for mine, theirs in zip(restored.table.variables, saved.table.variables):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())
    with pytest.raises(tf.errors.NotFoundError, match="VARIABLE_VALUE_rows_0_2 not found in checkpoint"):
        tf.train.Checkpoint(m=holder([2, 3])).read(path)


def test_update_arguments_are_split_by_the_rows_each_shard_owns():
    import tensorflow as tf

    from tfdist.parameter_server._tf_sharded import ShardedVariable
    from tfdist.parameter_server._shard_updates import ByShard

    var = ShardedVariable([tf.Variable(tf.zeros((3, 2))), tf.Variable(tf.zeros((2, 2)))])
    grad = tf.IndexedSlices(tf.constant([[1.0, 1], [2, 2], [3, 3], [4, 4]]), tf.constant([4, 0, 3, 0]),
                            tf.constant([5, 2]))
    dense = tf.reshape(tf.range(10.0), (5, 2))
    parts = ByShard(var)
    (g0, d0, lr0), (g1, d1, lr1) = parts.select((grad, dense, 0.5), 0), parts.select((grad, dense, 0.5), 1)
    assert g0.indices.numpy().tolist() == [0, 0] and g0.values.numpy().tolist() == [[2, 2], [4, 4]]
    assert g1.indices.numpy().tolist() == [1, 0] and g1.values.numpy().tolist() == [[1, 1], [3, 3]]
    assert g0.dense_shape.numpy().tolist() == [3, 2] and g1.dense_shape.numpy().tolist() == [2, 2]
    assert d0.numpy().tolist() == [[0, 1], [2, 3], [4, 5]] and d1.numpy().tolist() == [[6, 7], [8, 9]]
    assert lr0 == lr1 == 0.5
    slot = ShardedVariable([tf.Variable(tf.ones((3, 2))), tf.Variable(tf.ones((2, 2)))], reference=var)
    assert parts.select(slot, 1) is slot.variables[1] and slot.reference is var


# --- A table larger than a server's memory -------------------------------------------------------------------
ROWS, DIM = 4_000_000, 64
TABLE_MIB = ROWS * DIM * 4 / 2**20  # 976.6 MiB of float32
CAP_MIB = 800  # per process; each of 4 servers needs ~650 (TF ~340 + its 244 MiB shard + init blocks)


def _memory_cgroups_or_skip() -> None:
    reason = zero_cgroups.unavailable(free_gib=5)  # 6 processes and the table
    if reason:
        pytest.skip(reason)


@contextlib.contextmanager
def _capped_cgroups(tag: str, count: int, cap_mib: int):
    """`count` memory cgroups PREFIX-rank0.., each capped at cap_mib (benchmarks.zero_cgroups.capped)."""
    with contextlib.ExitStack() as stack:
        groups = [stack.enter_context(zero_cgroups.capped(f"{tag}-rank{rank}", cap_mib << 20))
                  for rank in range(count)]
        yield str(groups[0].name)[:-len("-rank0")], groups


def _usage(group: Path) -> dict:
    used = zero_cgroups.usage(group)
    return {"peak_mib": used["peak"] / 2**20, "oom_kills": used["oom_kills"]}


def _warm_page_cache() -> None:
    # Page cache is charged to the cgroup that first reads a file: read TensorFlow's libraries here, outside
    # the capped groups, so their peaks measure the processes' own memory.
    subprocess.run([sys.executable, "-c", "import tensorflow, keras"], env={**os.environ, **ENV}, check=True,
                   capture_output=True)


def _big_table_job(tmp_path: Path, servers: int) -> tuple[int, dict, str, list[dict]]:
    out = _Lines()
    with _capped_cgroups(f"ps{servers}", 2 + servers, CAP_MIB) as (prefix, groups):
        code = launch([sys.executable, str(HERE / "ps_big_table_job.py"), str(tmp_path), str(ROWS), str(DIM), "SGD"],
                      1, ps=servers, out=out, env={**ENV, "TFDIST_TEST_CGROUP": prefix}, timeout_s=150)
        usage = [_usage(group) for group in groups]  # ranks: chief, worker, ps 0..
    result_file = tmp_path / "result.json"
    return code, json.loads(result_file.read_text()) if result_file.exists() else {}, "\n".join(out.lines), usage


@pytest.mark.slow
def test_a_table_larger_than_each_process_memory_cap_trains_on_four_servers_and_is_killed_on_one(tmp_path):
    _memory_cgroups_or_skip()
    assert TABLE_MIB > CAP_MIB
    _warm_page_cache()
    (tmp_path / "four").mkdir()
    (tmp_path / "one").mkdir()

    # 4 servers: every process (chief, worker, each server) stays under 800 MiB; the table is 977 MiB.
    code, result, log, usage = _big_table_job(tmp_path / "four", servers=4)
    print(f"4 servers, cap {CAP_MIB} MiB, table {TABLE_MIB:.1f} MiB: peaks (chief, worker, ps 0-3) "
          f"{[round(u['peak_mib']) for u in usage]} MiB, OOM kills {[u['oom_kills'] for u in usage]}")
    assert code == 0, log[-3000:]
    assert result["shards"] == [[[ROWS // 4, DIM], PS[i]] for i in range(4)]
    assert np.isfinite(result["loss"]).all() and result["loss"][1] < result["loss"][0], result["loss"]
    assert result["used_rows_changed"] and not result["unused_row_changed"]  # SGD: row-wise updates
    assert 0.04 < result["row_spread"] <= 0.05  # Keras' default uniform(-0.05, 0.05), drawn on the servers
    assert all(u["oom_kills"] == 0 and u["peak_mib"] < CAP_MIB for u in usage), usage
    chief, worker, *servers = usage
    shard_mib = TABLE_MIB / 4
    # Each server holds its 244 MiB shard (its peak is the worker's plus at least that); chief and worker
    # never hold a shard's worth more than a server's TensorFlow runtime.
    assert all(s["peak_mib"] - worker["peak_mib"] > shard_mib for s in servers), usage
    assert max(chief["peak_mib"], worker["peak_mib"]) < min(s["peak_mib"] for s in servers) - shard_mib, usage

    # 1 server, same cap: it cannot hold the table and is OOM-killed while creating it.
    code, result, log, usage = _big_table_job(tmp_path / "one", servers=1)
    print(f"1 server, cap {CAP_MIB} MiB: peaks (chief, worker, ps 0) {[round(u['peak_mib']) for u in usage]} MiB, "
          f"OOM kills {[u['oom_kills'] for u in usage]}, exit code {code}")
    assert code != 0 and not result, log[-3000:]
    assert "ps 0 was killed by SIGKILL" in log, log[-3000:]
    assert usage[2]["oom_kills"] >= 1, usage
    assert usage[0]["oom_kills"] == usage[1]["oom_kills"] == 0, usage
