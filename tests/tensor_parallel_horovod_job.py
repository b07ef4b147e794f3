"""Worker script of tests/test_tensor_parallel_horovod.py: ModelParallelStrategy across Horovod ranks.

Usage (under `tfdist launch --backend horovod -n P --devices-per-worker M`):
    python tensor_parallel_horovod_job.py OUT ROWS [TAGS]
Global mesh ROWS x (P*M/ROWS) over `tfdist.cluster.list_devices()` (process r = Horovod rank r): ROWS = P gives each
rank whole rows (the batch axis across the ranks), ROWS = 1 one row over every rank (the model axis across them).
The strategy picks Horovod itself (backend="auto" under the Horovod launcher). TAGS: comma-separated run tags
(default: all). Writes OUT/rank{r}.json with, per run, the logical weights (a collective read when rows span
ranks), the one-device reference's (the chief's record only), the replicated variables and optimizer slots,
evaluate, predict, the exchanges and collective ops of a traced step; the chief also writes OUT/mlp.keras
(`tfdist.training.save_model` on every rank).
"""
import json
import os
import sys

out, rows = sys.argv[1], int(sys.argv[2])
import tfdist
from tp_models import mlp_layout, transformer_layout  # keras is imported inside them

devices = tfdist.cluster.list_devices()  # first thing: the mesh, then the strategy (before TensorFlow starts)
mesh = tfdist.DeviceMesh((rows, len(devices) // rows), ("batch", "model"), devices)
strategies = {"mlp": tfdist.ModelParallelStrategy(mlp_layout(mesh), batch_dim_name="batch", timeout_s=120)}
strategies["transformer"] = tfdist.ModelParallelStrategy(transformer_layout(mesh), batch_dim_name="batch",
                                                         timeout_s=120)
import numpy as np
import tensorflow as tf

from tfdist.tensor_parallel import collective_counts
from tp_job_runs import DATA, RUNS, fit, logical, traced_step_graph

rank = tfdist.cluster.rank(strategies["mlp"])


def traced_ops(strategy_, model, name) -> dict:
    """The exchanges of a traced SGD step (custom loop, never run): tensor-parallel sums/gathers by name scope
    (`collective_counts`) and the collective ops by type, Horovod's and TF's, in the graph and its functions."""
    graph = traced_step_graph(strategy_, model, name)
    nodes = list(graph.as_graph_def().node) + [n for fn in graph.as_graph_def().library.function for n in fn.node_def]
    kinds = ("HorovodAllreduce", "HorovodGroupedAllreduce", "HorovodAllgather", "CollectiveReduceV2",
             "CollectiveGatherV2")
    return {"counts": collective_counts(graph), "ops": {k: sum(n.op == k for n in nodes) for k in kinds}}


record = {"rank": rank, "backend": strategies["mlp"].backend, "mesh_rows": strategies["mlp"].mesh_rows,
          "num_replicas": strategies["mlp"].num_replicas_in_sync}
wanted = sys.argv[3].split(",") if len(sys.argv) > 3 else None
for name, opt_name, optimizer in RUNS:
    tag = f"{name}-{opt_name}"
    if wanted is not None and tag not in wanted:
        continue
    strategy = strategies[name]
    split, loss = fit(name, optimizer, strategy)
    x, y, batch = DATA[name]
    plan = strategy.shard_plan(split)
    entry = {"weights": logical(split, strategy), "loss": loss,
             "evaluate": split.evaluate(x, y, batch_size=batch, verbose=0),
             "predict": split.predict(x, batch_size=batch, verbose=0).tolist(),
             "shards": {f"{s.name}/{role}": [[v.path, list(v.shape), [c.device for c in v.value.values]] for v in vs]
                        for s in plan.layers for role, vs in s.shards.items()},
             "replicated": {v.path: np.asarray(v.numpy()).tolist() for v in split.weights if "_shard_" not in v.path},
             "replicated_slots": [np.asarray(v.numpy()).ravel().tolist() for v in split.optimizer.variables
                                  if "_shard_" not in v.path]}
    if opt_name == "sgd" or name == "transformer":
        entry.update(traced_ops(strategy, split, name))
    if tag == "mlp-adam":
        entry["wrote_keras"] = tfdist.training.save_model(split, os.path.join(out, "mlp.keras"))
    record[tag] = entry
# tfdist.comm next to the strategies: its groups are Horovod process sets too, some the same as the mesh's (on
# 4 ranks, the row {0, 1} is also a send/recv pair): they are shared, not added twice.
tfdist.comm.init(backend="horovod")
pair = tfdist.comm.new_group([0, 1])
if pair.rank is not None:
    record["comm_pair_sum"] = float(tfdist.comm.all_reduce(tf.constant(rank + 1.0), group=pair).numpy())
record["comm_world_sum"] = float(tfdist.comm.all_reduce(tf.constant(1.0)).numpy())
# The one-device references, on the chief only and last: a model built on one rank alone shifts Keras' auto-names
# of the models built after it, and Horovod names its collectives after graph tensors, so ranks building
# different models before a collective could disagree. Every rank is compared with the chief's reference.
for name, opt_name, optimizer in RUNS if rank == 0 else []:
    tag = f"{name}-{opt_name}"
    if tag in record:
        reference, record[tag]["ref_loss"] = fit(name, optimizer, None)
        x, y, batch = DATA[name]
        record[tag].update({"reference": logical(reference),
                            "ref_evaluate": reference.evaluate(x, y, batch_size=batch, verbose=0),
                            "ref_predict": reference.predict(x, batch_size=batch, verbose=0).tolist()})
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(record, f)
print(f"rank {rank} done", flush=True)
