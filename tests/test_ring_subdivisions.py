"""tfdist's TF ring all-reduces subdivide (chunks of at most 4 MB, pipelined), where stock
MultiWorkerMirroredStrategy sends each member's share as one RPC, and inside a tf.function a large one runs as
concurrent pieces: the traced ops carry the settings, and the sums stay exact. Bandwidth is measured by
`tfdist bench allreduce --backend tf`, beside TF's default."""

from __future__ import annotations

import json

import pytest


def test_the_strategys_all_reduces_are_created_subdivided_in_pieces_and_sum_exactly(python):
    proc = python("""
        import json
        import tfdist
        strategy = tfdist.MultiWorkerMirroredStrategy(local_devices=2, communication="ring", ring_piece_mb=4)
        import numpy as np, tensorflow as tf
        from tfdist._compat.ring import RING_MAX_SUBDIVS, piece_sizes
        from tfdist.strategies.multi_worker import _check_ring_piece

        # 12 MB + 4 bytes: 3 pieces, the last one element longer; and a small tensor that stays whole
        values = [np.arange(3_000_001, dtype=np.float32) * (i + 1) for i in range(2)]
        data = strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(values[ctx.replica_id_in_sync_group]))

        @tf.function
        def step(x):
            def replica(v):
                ctx = tf.distribute.get_replica_context()
                return ctx.all_reduce("sum", tf.reshape(v, [1, -1]))
            return strategy.run(replica, args=(x,))

        @tf.function
        def small_step(x):
            return strategy.run(lambda v: tf.distribute.get_replica_context().all_reduce("sum", v[:1000]), args=(x,))

        big, small = step(data), small_step(data)
        reduces = [op for op in step.get_concrete_function(data).graph.get_operations()
                   if op.type == "CollectiveReduceV2"]
        small_reduces = [op for op in small_step.get_concrete_function(data).graph.get_operations()
                         if op.type == "CollectiveReduceV2"]
        subdivs = sorted({op.get_attr("max_subdivs_per_device") for op in reduces})
        total = values[0] + values[1]
        print(json.dumps({
            "subdivs": subdivs, "expected": RING_MAX_SUBDIVS, "ops": len(reduces), "small_ops": len(small_reduces),
            "expected_ops": 2 * len(piece_sizes(3_000_001, 4, _check_ring_piece(4))),
            "exact": all(np.array_equal(o.numpy(), total[None]) for o in strategy.experimental_local_results(big))
                     and all(np.array_equal(o.numpy(), total[:1000])
                             for o in strategy.experimental_local_results(small)),
            "eager_exact": bool(np.array_equal(strategy.experimental_local_results(
                strategy.run(lambda v: tf.distribute.get_replica_context().all_reduce("sum", v), args=(data,))
            )[0].numpy(), total)),
        }))
    """, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["subdivs"] == [out["expected"]] and out["expected"] > 1
    assert out["ops"] == out["expected_ops"] == 2 * 2 and out["small_ops"] == 2  # per device: 2 pieces; 1
    assert out["exact"] and out["eager_exact"]


@pytest.mark.parametrize("count,itemsize,piece_bytes,expected", [
    (1000, 4, 4 << 20, [1000]),                              # small: one all-reduce
    ((8 << 20) // 4 - 1, 4, 4 << 20, [(8 << 20) // 4 - 1]),  # just under two pieces' worth
    (3_000_001, 4, 4 << 20, [1_500_000, 1_500_001]),
    (3_000_001, 4, 1 << 20, [272_720] * 10 + [272_801]),     # 11 pieces, starts on 64 bytes
    ((1 << 30) // 4, 4, 1 << 20, [(1 << 30) // 4 // 64] * 64),  # 1 GB: at most 64 pieces
    (5_000_003, 2, 4 << 20, [2_500_000, 2_500_003]),         # 10 MB of float16: 2 pieces
    (5_000_003, 2, 2 << 20, [1_249_984] * 3 + [1_250_051]),  # starts on multiples of 32 elements
    (3_000_001, 4, None, [3_000_001]),                       # off: whole
])
def test_piece_sizes_cover_the_tensor_with_aligned_starts(count, itemsize, piece_bytes, expected):
    from tfdist._compat.ring import piece_sizes

    sizes = piece_sizes(count, itemsize, piece_bytes)
    assert sizes == expected and sum(sizes) == count
    assert all(size * itemsize % 64 == 0 for size in sizes[:-1])


@pytest.mark.parametrize("bad", [0, 0.1, -2, "2", True, float("nan")])
def test_a_bad_ring_piece_size_is_refused_before_anything_starts(bad):
    import tfdist
    from tfdist.errors import ConfigError

    with pytest.raises(ConfigError, match=r"ring_piece_mb must be None \(whole all-reduces\) or a size in MB >= 0.25"):
        tfdist.MultiWorkerMirroredStrategy(ring_piece_mb=bad)


def test_fit_with_ring_pieces_gives_the_same_weights_as_whole_all_reduces(python):
    # Each element is summed by the same ring either way, so the weights must be bit-identical.
    code = """
        import json, sys
        import tfdist
        piece_mb = float(sys.argv[1]) or None
        strategy = tfdist.MultiWorkerMirroredStrategy(local_devices=2, communication="ring", ring_piece_mb=piece_mb)
        import keras, numpy as np
        from tfdist._compat import ring

        created = []  # the ring all-reduces traced (sizes), counted where the launcher creates them
        original = ring._RingLauncher._ring
        ring._RingLauncher._ring = lambda self, t, o: created.append(t.shape.num_elements()) or original(self, t, o)
        keras.utils.set_random_seed(0)
        x = np.random.default_rng(0).normal(size=(64, 256)).astype("float32")
        y = np.random.default_rng(1).integers(0, 10, size=64)
        with strategy.scope():
            model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, activation="relu"),
                                      keras.layers.Dense(10)])  # 0.55 MB of gradients: 2 pieces of 0.25 MB
            model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        print(json.dumps({"weights": [w.tolist() for w in model.get_weights()], "largest": max(created)}))
    """
    pieces, whole = (json.loads(python(code, size, check=True).stdout.strip().splitlines()[-1])
                     for size in ("0.25", "0"))
    assert pieces["weights"] == whole["weights"]
    assert whole["largest"] > 136_000 > pieces["largest"] > 0  # the 136,714 gradients went in pieces


def test_recut_cuts_a_pack_at_piece_boundaries_without_concatenating_it_and_back():
    # A pack of tensors (0, 1 and 70 elements, and one of 1000) cut into pieces that start inside tensors and span
    # several, then cut back: every element in its place; a piece inside one tensor is a slice of it, not a concat.
    import numpy as np
    import tensorflow as tf

    from tfdist._compat.ring import recut

    counts = [70, 0, 1, 1000]
    parts = [tf.constant(np.arange(c, dtype=np.float32) + 10_000 * i) for i, c in enumerate(counts)]
    sizes = [64, 7, 500, 500]
    pieces = recut(parts, counts, sizes)
    assert [int(p.shape[0]) for p in pieces] == sizes
    assert np.array_equal(np.concatenate([p.numpy() for p in pieces]), np.concatenate([p.numpy() for p in parts]))
    back = recut(pieces, sizes, counts)
    assert all(np.array_equal(b.numpy(), p.numpy()) for b, p in zip(back, parts))

    @tf.function
    def cut(x):
        return recut([x], [1000], [500, 500])

    ops = {op.type for op in cut.get_concrete_function(tf.TensorSpec([1000], tf.float32)).graph.get_operations()}
    assert "ConcatV2" not in ops and "StridedSlice" in ops
    with pytest.raises(ValueError, match="parts of 1071 elements cannot be cut into 1070"):
        recut(parts, counts, [1070])
