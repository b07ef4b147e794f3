"""Worker script of tests/test_tensor_parallel_zero.py: ZeRO over ModelParallelStrategy's batch axis across processes.

Usage (under `tfdist launch -n 2 --devices-per-worker 2`): python tensor_parallel_zero_procs_job.py OUT
Global mesh 2 x 2 ("batch" across the two processes, one row each; "model" inside each). Trains the MLP with Adam
at zero_stage 0, 1 and 2 on the same global batches and writes OUT/rank{r}.json with each stage's logical weights,
this process's slot pieces (shape, device) and memory report; every process calls save_model, the chief writes
OUT/stage{s}.keras. Then every process loads stage1.keras at stage 2 and saves it again (OUT/reloaded.keras).
"""
import json
import os
import sys

out = sys.argv[1]
import tfdist
import tp_models  # keras is imported inside its builders

# First thing: the mesh over every process's devices, then the strategies (collectives configured before TF starts).
devices = tfdist.cluster.list_devices()
mesh = tfdist.DeviceMesh((2, len(devices) // 2), ("batch", "model"), devices)
layout_map = tp_models.mlp_layout(mesh)
strategies = {stage: tfdist.ModelParallelStrategy(layout_map, batch_dim_name="batch", timeout_s=60, zero_stage=stage)
              for stage in (0, 1, 2)}
import keras
import numpy as np


rng = np.random.RandomState(0)
x, y = rng.rand(64, 12).astype("float32"), rng.randint(0, 5, size=64)
rank = tfdist.cluster.rank(strategies[0])
record = {"rank": rank}
for stage, strategy in strategies.items():
    with strategy.scope():
        model = tp_models.mlp(seed=7)
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    weights = {}
    for layer in model.layers[1:]:
        weights[layer.kernel.path] = np.asarray(layer.kernel.numpy()).tolist()
        weights[layer.bias.path] = np.asarray(layer.bias.numpy()).tolist()
    entry = {"weights": weights,
             "optimizer_state": [r.optimizer_state for r in strategy.memory_report(model).rows],
             "wrote": tfdist.training.save_model(model, os.path.join(out, f"stage{stage}.keras"))}
    engine = tfdist.zero.engine_of(model)
    if engine is not None:
        entry["pieces"] = [[list(v.shape), v.value.device] for v in engine.state_variables if len(v.shape)]
        entry["groups"] = engine.group_devices
    record[stage] = entry
# Every process loads the stage-1 file at stage 2 (each keeps its own pieces of the file's logical state) and saves
# it again: OUT/reloaded.keras must hold the same state.
with strategies[2].scope():
    reloaded = keras.saving.load_model(os.path.join(out, "stage1.keras"))
record["reloaded_wrote"] = tfdist.training.save_model(reloaded, os.path.join(out, "reloaded.keras"))
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(record, f)
print(f"rank {rank} done", flush=True)
