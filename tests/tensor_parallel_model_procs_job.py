"""Worker script of tests/test_tensor_parallel_model_procs.py: the mesh's model axis across processes (SPMD).

Usage (under `tfdist launch -n P --devices-per-worker M`): python tensor_parallel_model_procs_job.py OUT [ROWS [TAGS]]
Global mesh ROWS x (P*M/ROWS) (default 1 row): each row spans P/ROWS processes, process q of a row holding its
model positions q*M .. q*M+M-1. The processes of a row read the same part of every global batch (the row's data).
TAGS: comma-separated run tags (default: all). Writes OUT/rank{r}.json with, per run, the logical weights
(reading them is a collective), the one-device reference's (the chief's record only), this process's shard variables (shape, devices),
its replicated variables, evaluate/predict, the exchanges in a traced step; the chief also writes OUT/mlp.keras.
"""
import json
import os
import sys

out = sys.argv[1]
import tfdist
from tp_models import mlp, mlp_layout, transformer_layout  # keras is imported inside them

# First thing: the mesh over every process's devices, then the strategy (collectives configured before TF starts).
devices = tfdist.cluster.list_devices()
rows = int(sys.argv[2]) if len(sys.argv) > 2 else 1
mesh = tfdist.DeviceMesh((rows, len(devices) // rows), ("batch", "model"), devices)
layouts = {"mlp": mlp_layout(mesh), "transformer": transformer_layout(mesh)}
strategies = {"mlp": tfdist.ModelParallelStrategy(layouts["mlp"], batch_dim_name="batch", timeout_s=60)}
import keras
import numpy as np
import tensorflow as tf

from tfdist.tensor_parallel import collective_counts
from tp_job_runs import DATA, RUNS, UNCLIPPED, fit, logical, traced_step_graph

strategies["transformer"] = tfdist.ModelParallelStrategy(layouts["transformer"], batch_dim_name="batch", timeout_s=60)
rank = tfdist.cluster.rank(strategies["mlp"])


def traced_counts(strategy_, model, name) -> dict:
    """The exchanges of a traced SGD step (custom loop: strategy.run inside a tf.function), never run."""
    return collective_counts(traced_step_graph(strategy_, model, name))


record = {"rank": rank, "mesh_rows": strategies["mlp"].mesh_rows,
          "num_replicas": strategies["mlp"].num_replicas_in_sync}
wanted = sys.argv[3].split(",") if len(sys.argv) > 3 else None
for name, opt_name, optimizer in RUNS:
    tag = f"{name}-{opt_name}"
    if wanted is not None and tag not in wanted:
        continue
    strategy = strategies[name]
    split, loss = fit(name, optimizer, strategy, ["accuracy"])
    x, y, batch = DATA[name]
    plan = strategy.shard_plan(split)
    entry = {"weights": logical(split, strategy), "loss": loss,
             "evaluate": split.evaluate(x, y, batch_size=batch, verbose=0),
             "predict": split.predict(x, batch_size=batch, verbose=0).tolist(),
             "shards": {f"{s.name}/{role}": [[v.path, list(v.shape), [c.device for c in v.value.values]] for v in vs]
                        for s in plan.layers for role, vs in s.shards.items()},
             "logical_shapes": {f"{s.name}/{role}": list(kv.shape) for s in plan.layers
                                for role, kv in s.logical.items()},
             "replicated": {v.path: np.asarray(v.numpy()).tolist() for v in split.weights if "_shard_" not in v.path},
             "replicated_slots": [np.asarray(v.numpy()).ravel().tolist() for v in split.optimizer.variables
                                  if "_shard_" not in v.path]}
    if name == "mlp":  # logical, as plain Keras gives them (a collective too: every process calls it)
        entry["get_weights"] = [w.tolist() for w in split.get_weights()]
    if tag == "mlp-adam":
        # Every process calls it (a collective gather of the shards); the chief writes.
        entry["wrote_keras"] = tfdist.training.save_model(split, os.path.join(out, "mlp.keras"))
    if rank == 0:  # the one-device reference (the same in every process: the chief's is compared with all)
        reference, entry["ref_loss"] = fit(name, optimizer, None, ["accuracy"])
        entry["reference"] = logical(reference)
        entry["ref_paths"] = [v.path for v in reference.weights]  # Keras' order of get_weights
        entry["ref_evaluate"] = reference.evaluate(x, y, batch_size=batch, verbose=0)
        entry["ref_predict"] = reference.predict(x, batch_size=batch, verbose=0).tolist()
        if "clip" in opt_name:  # one device without clipping: the clipping changed the result
            entry["unclipped"] = logical(fit(name, UNCLIPPED, None)[0])
    if opt_name == "sgd" or name == "transformer":
        entry["counts"] = traced_counts(strategy, split, name)
    record[tag] = entry
if wanted is None:  # clipnorm with gradient accumulation (Keras' own path, per-process norms): refused
    try:
        with strategies["mlp"].scope():
            accumulating = keras.optimizers.SGD(0.1, clipnorm=0.02, gradient_accumulation_steps=2)
            accumulating.build(mlp(seed=3).trainable_variables)
        record["accumulation_refused"] = None
    except tfdist.errors.ConfigError as e:
        record["accumulation_refused"] = str(e)
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(record, f)
print(f"rank {rank} done", flush=True)
