"""Worker script of tests/test_tensor_parallel_procs.py: ModelParallelStrategy with the batch axis across processes.

Usage (under `tfdist launch -n 2 --devices-per-worker M`): python tensor_parallel_procs_job.py OUT [ROWS [MODELS]]
Global mesh ROWS x (2M / ROWS) (default 2 x M: "batch" across the two processes, "model" inside each; ROWS = 4
with M = 4 gives each process two rows). MODELS: comma-separated run tags (default: every zero_stage=0 run). Writes
OUT/rank{r}.json with, per run, the split model's logical weights, the one-device reference's, evaluate and predict
results; the chief also writes OUT/mlp.keras (and OUT/{model}-zero3.keras for the ZeRO-3 runs, "*-adam20-zero3").
"""
import json
import os
import sys

out = sys.argv[1]
import tfdist
from tp_models import cnn_layout, mlp, mlp_layout, transformer_block, transformer_layout  # keras inside them

# First thing: the mesh over every process's devices, then the strategy (collectives configured before TF starts).
devices = tfdist.cluster.list_devices()
rows = int(sys.argv[2]) if len(sys.argv) > 2 else 2
mesh = tfdist.DeviceMesh((rows, len(devices) // rows), ("batch", "model"), devices)


def rows_reversed(devices: list, cols: int) -> list:
    """The same devices with each process's rows in reverse device order (row 0 of process 0 on CPU:2, CPU:3 of a
    4 x 2 mesh): TF ranks a collective group's members by device index, not by mesh row."""
    per = len(devices) // 2
    out = []
    for start in range(0, len(devices), per):
        block = [devices[start + i:start + i + cols] for i in range(0, per, cols)]
        out += [d for row in reversed(block) for d in row]
    return out


layouts = {"mlp": mlp_layout(mesh), "transformer": transformer_layout(mesh), "cnn": cnn_layout(mesh)}
strategy = tfdist.ModelParallelStrategy(layouts["mlp"], batch_dim_name="batch", timeout_s=60)
import keras
import numpy as np
import tensorflow as tf

rank = tfdist.cluster.rank(strategy)
rng = np.random.RandomState(0)
DATA = {
    "mlp": (rng.rand(64, 12).astype("float32"), rng.randint(0, 5, size=64), 16),
    "transformer": (rng.rand(32, 6, 16).astype("float32"), rng.randint(0, 3, size=32), 8),
    "cnn": (rng.rand(32, 8, 8, 1).astype("float32"), rng.randint(0, 10, size=32), 8),
}
BUILD = {"mlp": mlp, "transformer": transformer_block,
         "cnn": lambda: tfdist.models.cnn(input_shape=(8, 8, 1), filters=(8, 8), dense_units=16)}
LOSS = {"mlp": lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "transformer": lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "cnn": lambda: "sparse_categorical_crossentropy"}
# (model, optimizer tag, optimizer, zero_stage). Stage 0 also runs Keras' EMA (its overwrite every 3 steps) and
# global_clipnorm (0.05: below the gradient's norm, every step clips), which need the summed gradient across rows.
RUNS = [("mlp", "sgd", lambda: keras.optimizers.SGD(0.1), 0), ("mlp", "adam", lambda: keras.optimizers.Adam(0.01), 0),
        ("transformer", "adam", lambda: keras.optimizers.Adam(0.01), 0),
        ("cnn", "sgd", lambda: keras.optimizers.SGD(0.1), 0),
        ("mlp", "adam-ema", lambda: keras.optimizers.Adam(0.01, use_ema=True, ema_overwrite_frequency=3), 0),
        ("mlp", "sgd-clip", lambda: keras.optimizers.SGD(0.1, momentum=0.5, global_clipnorm=0.05), 0),
        ("mlp", "adam-zero1", lambda: keras.optimizers.Adam(0.01), 1),
        ("mlp", "adam-zero2", lambda: keras.optimizers.Adam(0.01), 2),
        # ZeRO-3 with one row per process, 20 steps (5 epochs), next to stage 0 over the same 20 steps.
        ("mlp", "adam20", lambda: keras.optimizers.Adam(0.01), 0),
        ("mlp", "adam20-zero3", lambda: keras.optimizers.Adam(0.01), 3),
        ("transformer", "adam20", lambda: keras.optimizers.Adam(0.01), 0),
        ("transformer", "adam20-zero3", lambda: keras.optimizers.Adam(0.01), 3),
        # clipnorm on split variables (each logical variable's norm) and global_clipnorm at stage 3, 20 steps.
        *[("mlp", f"sgd20-clipnorm{z}", lambda: keras.optimizers.SGD(0.1, momentum=0.5, clipnorm=0.02), stage)
          for z, stage in (("", 0), ("-zero2", 2), ("-zero3", 3))],
        ("mlp", "sgd20-clip-zero3", lambda: keras.optimizers.SGD(0.1, momentum=0.5, global_clipnorm=0.05), 3)]


def logical(model, strategy_=None) -> dict:
    """Every logical variable by path (a split layer's variables read as their shards' concatenation)."""
    values = {v.path: v.numpy() for v in model.weights if "_shard_" not in v.path}
    for split in strategy_.shard_plan(model).layers if strategy_ is not None else []:
        values.update({kv.path: kv.numpy() for kv in split.logical.values()})
    return {path: np.asarray(value).tolist() for path, value in values.items()}


def fit(name, optimizer, strategy_, epochs=2):
    x, y, batch = DATA[name]
    scope = strategy_.scope() if strategy_ is not None else tf.distribute.get_strategy().scope()
    with scope:
        keras.utils.set_random_seed(11)
        model = BUILD[name]()
        model.compile(optimizer=optimizer(), loss=LOSS[name](), metrics=["accuracy"])
    history = model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    return model, history.history["loss"]


record = {"rank": rank, "local_devices": list(strategy.extended.worker_devices),
          "num_replicas": strategy.num_replicas_in_sync, "mesh_rows": strategy.mesh_rows}
wanted = sys.argv[3].split(",") if len(sys.argv) > 3 else None
strategies = {("mlp", 0): strategy}
for name, opt_name, optimizer, stage in RUNS:
    tag = f"{name}-{opt_name}"
    if (wanted is None and (stage or "20" in opt_name)) or (wanted is not None and tag not in wanted):
        continue  # default: the 2-epoch stage-0 runs
    epochs = 5 if "20" in opt_name else 2
    if (name, stage) not in strategies:  # one strategy per layout map and stage (each one's collective keys its own)
        layout = layouts[name]
        if stage in (2, 3) and rows > 2:  # several rows per process: ZeRO-2/3 on a mesh whose rows run against
            cols = len(devices) // rows     # device order
            reversed_mesh = tfdist.DeviceMesh((rows, cols), ("batch", "model"), rows_reversed(devices, cols))
            layout = {"mlp": mlp_layout, "transformer": transformer_layout, "cnn": cnn_layout}[name](reversed_mesh)
        strategies[name, stage] = tfdist.ModelParallelStrategy(layout, batch_dim_name="batch", timeout_s=60,
                                                               zero_stage=stage)
    strategy = strategies[name, stage]
    split, loss = fit(name, optimizer, strategy, epochs)
    x, y, batch = DATA[name]
    entry = {"weights": logical(split, strategy), "loss": loss,
             "evaluate": split.evaluate(x, y, batch_size=batch, verbose=0),
             "predict": split.predict(x, batch_size=batch, verbose=0).tolist()}
    if rank == 0:  # the one-device reference, the same in every process: the chief's is compared with all
        reference, entry["ref_loss"] = fit(name, optimizer, None, epochs)
        entry["reference"] = logical(reference)
        entry["ref_evaluate"] = reference.evaluate(x, y, batch_size=batch, verbose=0)
        entry["ref_predict"] = reference.predict(x, batch_size=batch, verbose=0).tolist()
    engine = tfdist.zero.engine_of(split)
    if engine is not None:  # ZeRO: this process's slot pieces (shape, device) and each group's local copies
        entry["pieces"] = [[list(v.shape), v.value.device] for v in engine.state_variables if len(v.shape)]
        entry["groups"] = engine.group_devices
        entry["mesh_rows"] = strategy.mesh_rows
    if tag == "mlp-adam":
        plan = strategy.shard_plan(split)
        entry["shards"] = {f"{s.name}/{role}": [[list(v.shape), [c.device for c in v.value.values]] for v in vs]
                           for s in plan.layers for role, vs in s.shards.items()}
        entry["slots"] = [np.asarray(v.numpy()).ravel().tolist() for v in split.optimizer.variables]
        # Every worker calls it, the chief writes (tfdist's saving convention); True where the file was written.
        entry["wrote_keras"] = tfdist.training.save_model(split, os.path.join(out, "mlp.keras"))
    if stage == 3:  # this process's parameter pieces (shape, device) per logical variable, read from the variables
        entry["params"] = {p.name: {"shape": list(p.shape), "pieces": [[list(c.shape), c.device] for c in p.components]}
                           for p in engine.params}
        with tfdist.zero.gathered_state(split):  # every process: the Adam state (per shard), gathered once
            # by path without the optimizer's own name (adam, adam_1, ...: the chief also built its references)
            entry["slots"] = {v.path.split("/", 1)[-1]: np.asarray(v.numpy()).ravel().tolist()
                              for v in split.optimizer.variables}
        if rank == 0:
            entry["ref_slots"] = {v.path.split("/")[-1]: np.asarray(v.numpy()).tolist()  # one device's, by slot name
                                  for v in reference.optimizer.variables}
        file = f"{name}-zero3.keras" if opt_name == "adam20-zero3" else f"{tag}.keras"  # the tests read the first
        entry["wrote_keras"] = tfdist.training.save_model(split, os.path.join(out, file))
    record[tag] = entry
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(record, f)
print(f"rank {rank} done", flush=True)
