"""Worker script of tests/test_tensor_parallel_zero_horovod.py: ZeRO over ModelParallelStrategy's batch axis across
Horovod ranks (each rank whole rows).

Usage (under `tfdist launch --backend horovod -n P --devices-per-worker M`):
    python tensor_parallel_zero_horovod_job.py OUT ROWS STAGES [VARIANTS_JSON]
Global mesh ROWS x (P*M/ROWS) over `tfdist.cluster.list_devices()`; with several rows per rank each rank's rows are
listed in reverse device order (row 0 of rank 0 on its last devices): the pieces must follow the mesh rows, not the
device indices. Trains the MLP with Adam (12 steps) at each of STAGES (comma-separated) and, on the chief, once on
one device; writes OUT/rank{r}.json with each stage's logical weights, the logical Adam state (gathered), this
rank's slot pieces (shape, device, element count) and the groups' devices; every rank calls save_model (the chief writes
OUT/stage{s}.keras). VARIANTS_JSON names more Adam arguments, e.g. {"clipnorm": {"clipnorm": 0.05}}: each named
variant also runs at every stage above 0 (recorded as "NAME:STAGE", its reference as "reference:NAME", not saved).
"""
import contextlib
import json
import os
import sys

out, rows, stages = sys.argv[1], int(sys.argv[2]), [int(s) for s in sys.argv[3].split(",")]
VARIANTS = {"": {}, **(json.loads(sys.argv[4]) if len(sys.argv) > 4 else {})}  # name: more Adam arguments
import tfdist
import tp_models  # keras is imported inside its builders

devices = tfdist.cluster.list_devices()  # first thing: the mesh, then the strategies (before TensorFlow starts)
cols = len(devices) // rows
size = tfdist.cluster.world_size()  # from the launcher's variables (Horovod or MPI)
if rows > size:  # several rows per rank: each rank's rows against device order
    grid = [devices[i:i + cols] for i in range(0, len(devices), cols)]
    k = rows // size
    grid = [row for start in range(0, rows, k) for row in reversed(grid[start:start + k])]
    devices = [d for row in grid for d in row]
mesh = tfdist.DeviceMesh((rows, cols), ("batch", "model"), devices)
layout_map = tp_models.mlp_layout(mesh)
strategies = {stage: tfdist.ModelParallelStrategy(layout_map, batch_dim_name="batch", timeout_s=120,
                                                  zero_stage=stage) for stage in stages}
import keras
import numpy as np
import tensorflow as tf

rng = np.random.RandomState(0)
x, y = rng.rand(64, 12).astype("float32"), rng.randint(0, 5, size=64)
first = strategies[stages[0]]
rank = tfdist.cluster.rank(first)
record = {"rank": rank, "backend": first.backend, "mesh_rows": first.mesh_rows}


def fit(strategy, variant=""):
    scope = strategy.scope() if strategy is not None else tf.distribute.get_strategy().scope()
    with scope:
        model = tp_models.mlp(seed=7)
        model.compile(optimizer=keras.optimizers.Adam(0.01, **VARIANTS[variant]),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)  # 12 steps
    return model


def logical(model) -> dict:
    return {f"{layer.name}/{w}": np.asarray(getattr(layer, w).numpy()).tolist()
            for layer in model.layers[1:] for w in ("kernel", "bias")}


def adam_state(model) -> dict:
    """The logical Adam state (m, v per logical variable, by path), as Keras reads it (gathered on every rank)."""
    engine = tfdist.zero.engine_of(model.optimizer)
    state = engine.state.gathered() if engine is not None and not engine.all_local else contextlib.nullcontext()
    with state:
        # by path without the optimizer's own name (adam, adam_1, ...)
        return {v.path.split("/", 1)[1]: np.asarray(v.numpy()).tolist() for v in model.optimizer.variables
                if len(v.shape)}


for variant in VARIANTS:
    for stage in stages if not variant else [s for s in stages if s]:
        strategy = strategies[stage]
        model = fit(strategy, variant)
        entry = {"weights": logical(model)}
        if not variant:
            entry["wrote"] = tfdist.training.save_model(model, os.path.join(out, f"stage{stage}.keras"))
        engine = tfdist.zero.engine_of(model.optimizer)
        if engine is not None:  # ZeRO: this rank's slot pieces and each group's local copies
            entry["pieces"] = [[list(v.shape), v.value.device] for v in engine.state_variables if len(v.shape)]
            entry["groups"] = engine.group_devices
            entry["shard_ids"] = [list(e.comm.shard_ids) for e in engine.engines]
        # elements of optimizer state: ZeRO's pieces on this rank; stage 0 one copy per local row of each slot
        entry["state_elements"] = (sum(int(np.prod(v.shape)) for v in engine.state_variables if len(v.shape))
                                   if engine is not None else
                                   sum(int(np.prod(v.shape)) for v in model.optimizer.variables if len(v.shape))
                                   * len(strategy.mesh_rows))
        entry["adam"] = adam_state(model)
        record[f"{variant}:{stage}" if variant else stage] = entry
# The one-device references, on the chief only and last (a model built on one rank alone shifts the Keras auto-names
# of later models, and Horovod names its collectives after graph tensors); every rank is compared with them.
for variant in VARIANTS if rank == 0 else []:
    reference = fit(None, variant)
    record[f"reference:{variant}" if variant else "reference"] = logical(reference)
    if not variant:
        record["reference_adam"] = adam_state(reference)
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(record, f)
print(f"rank {rank} done", flush=True)
