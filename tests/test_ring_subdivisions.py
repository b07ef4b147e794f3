"""tfdist's TF ring all-reduces may subdivide (chunks of at most 4 MB, pipelined), where stock
MultiWorkerMirroredStrategy sends each member's share as one RPC: the traced ops carry the setting, and the sums
stay exact. Bandwidth is measured by `tfdist bench allreduce --backend tf`, beside TF's default."""

from __future__ import annotations

import json


def test_the_strategys_all_reduces_are_created_subdivided_and_sum_exactly(python):
    proc = python("""
        import json
        import tfdist
        strategy = tfdist.MultiWorkerMirroredStrategy(local_devices=2, communication="ring")
        import numpy as np, tensorflow as tf
        from tfdist._compat.distribute import RING_MAX_SUBDIVS

        values = [np.arange(3_000_000, dtype=np.float32) * (i + 1) for i in range(2)]  # 12 MB: 2+ chunks
        data = strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(values[ctx.replica_id_in_sync_group]))

        @tf.function
        def step(x):
            return strategy.run(lambda v: tf.distribute.get_replica_context().all_reduce("sum", v), args=(x,))

        out = strategy.experimental_local_results(step(data))
        graph = step.get_concrete_function(data).graph
        subdivs = sorted({op.get_attr("max_subdivs_per_device") for op in graph.get_operations()
                          if op.type == "CollectiveReduceV2"})
        print(json.dumps({"subdivs": subdivs, "expected": RING_MAX_SUBDIVS,
                          "exact": all(bool(np.array_equal(o.numpy(), values[0] + values[1])) for o in out)}))
    """, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["subdivs"] == [out["expected"]] and out["expected"] > 1
    assert out["exact"]
