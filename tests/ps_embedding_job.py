"""Sharded embedding tables under tfdist.ParameterServerStrategy, checked against plain Keras (test_ps_embedding.py).

Run with `launch([python, ps_embedding_job.py, OUT_DIR], 1, ps=2)`: one worker, so the steps run in the
order they are scheduled and training is plain sequential SGD on the same batches as the reference.
The chief writes OUT_DIR/result.json with:

- "init": tables created sharded over both servers vs the same initializer computed locally;
- "train": per optimizer, the largest difference between the sharded model and a plain Keras copy
  (same initial weights, same batches) after `fit`, for weights and optimizer slots, and predictions;
- "layer": a sharded Embedding called directly (negative ids, float ids, mixed precision) vs plain;
- "graph": what the traced training step does (op devices and output sizes), and the same lookup
  traced with Keras' own `call` for contrast;
- "fallback": a Lamb run (not elementwise: updated whole, with a warning).
"""

import json
import logging
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import tfdist
from tfdist.parameter_server import _shard_init as shard_init
from tfdist.parameter_server import sharded_embedding

out_dir = sys.argv[1]
strategy = tfdist.ParameterServerStrategy(min_shard_bytes=4096)  # ps and workers never return from here
ROWS, DIM, SEQ = 4000, 16, 12
PS = ["/job:ps/replica:0/task:0/device:CPU:0", "/job:ps/replica:0/task:1/device:CPU:0"]
tokens = tf.random.stateless_uniform((640, SEQ), seed=(1, 2), maxval=ROWS, dtype=tf.int32)
tokens = tf.where(tokens % 5 == 0, 0, tokens)  # some padding (id 0) for mask_zero
labels = tf.reduce_max(tokens, axis=1) % 10
result: dict = {}


def token_fn(input_context=None):
    return tf.data.Dataset.from_tensor_slices((tokens, labels)).repeat().batch(32)


def diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# --- Initialisation: each shard made on its server, block by block ------------------------------------------
class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


warnings = Warnings()
logging.getLogger("tfdist").addHandler(warnings)
shard_init.BLOCK_BYTES = 64 * DIM * 4  # blocks of 64 rows: 2000 (the shard boundary) falls inside block 31
init = {}
with strategy.scope():
    for name, initializer in {"zeros": "zeros", "constant": keras.initializers.Constant(0.5),
                              "uniform": keras.initializers.RandomUniform(-0.05, 0.05, seed=7),
                              "glorot": keras.initializers.GlorotUniform(seed=3),
                              "orthogonal": keras.initializers.Orthogonal(seed=4)}.items():
        layer = keras.layers.Embedding(ROWS, DIM, embeddings_initializer=initializer, name=name)
        layer.build()
        table = sharded_embedding.sharded_table(layer)
        init[name] = {"shards": [[s.shape.as_list(), s.device] for s in table.variables],
                      "value": layer.embeddings.numpy(), "initializer": keras.initializers.get(initializer)}
    slots_layer = keras.layers.Embedding(ROWS, DIM, name="with_slots")
    slots_layer.build()
    adam = keras.optimizers.Adam()
    adam.build([slots_layer.embeddings])
shape = (ROWS, DIM)
blocks = [shard_init.for_shard(init["uniform"]["initializer"], shape, k)((min(64, ROWS - k), DIM), dtype="float32")
          for k in range(0, ROWS, 64)]
glorot_limit = float(np.sqrt(6.0 / (ROWS + DIM)))
result["init"] = {
    "shards": {name: entry["shards"] for name, entry in init.items()},
    "zeros_equal": bool(np.array_equal(init["zeros"]["value"], keras.initializers.Zeros()(shape))),
    "constant_equal": bool(np.array_equal(init["constant"]["value"], keras.initializers.Constant(0.5)(shape))),
    "uniform_vs_blocks": diff(init["uniform"]["value"], np.concatenate(blocks)),
    "uniform_vs_unsharded": diff(init["uniform"]["value"], init["uniform"]["initializer"](shape, dtype="float32")),
    "uniform_range": [float(init["uniform"]["value"].min()), float(init["uniform"]["value"].max())],
    "uniform_distinct_rows": len(np.unique(init["uniform"]["value"], axis=0)),
    "glorot_max": float(np.abs(init["glorot"]["value"]).max()), "glorot_limit": glorot_limit,
    "orthogonal_equal": bool(np.array_equal(init["orthogonal"]["value"],
                                            init["orthogonal"]["initializer"](shape, dtype="float32"))),
    "warnings": list(warnings.messages),
    "slots": [[[s.shape.as_list(), s.device] for s in v.value.variables] for v in adam.variables if v.shape == shape],
    "slots_zero": bool(all(not np.asarray(v).any() for v in adam.variables if v.shape == shape)),
}
shard_init.BLOCK_BYTES = 16 << 20


# --- Training: sharded vs plain Keras, same weights and batches ---------------------------------------------
def build(**embedding):
    return keras.Sequential([keras.Input((SEQ,), dtype="int32"),
                             keras.layers.Embedding(ROWS, DIM, name="table", mask_zero=True, **embedding),
                             keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(10, name="head")])


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class Grab(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.steps = None

    def on_train_end(self, logs=None):
        self.steps = self.model.train_function


result["train"] = {}
graphs, trained = {}, {}
for name, config in {"SGD": {"learning_rate": 0.5}, "AdamW": {"learning_rate": 1e-2, "weight_decay": 0.004},
                     "Adagrad": {"learning_rate": 0.1}}.items():
    with strategy.scope():
        model = build()
        model.compile(optimizer=keras.optimizers.get({"class_name": name, "config": config}), loss=loss())
    plain = build()
    plain.set_weights(model.get_weights())
    plain.compile(optimizer=keras.optimizers.get({"class_name": name, "config": config}), loss=loss())
    before = model.get_layer("table").embeddings.numpy()
    grab = Grab()
    model.fit(token_fn, epochs=1, steps_per_epoch=10, verbose=0, callbacks=[grab])
    plain.fit(token_fn().take(10), epochs=1, verbose=0, shuffle=False)
    graphs[name], trained[name] = grab.steps.graphs, model
    table = model.get_layer("table").embeddings.numpy()
    slot_pairs = [(a, b) for a, b in zip(model.optimizer.variables, plain.optimizer.variables) if a.shape == (ROWS, DIM)]
    result["train"][name] = {
        "weights": max(diff(a, b) for a, b in zip(model.get_weights(), plain.get_weights())),
        "slots": max([diff(a, b) for a, b in slot_pairs], default=0.0), "num_slots": len(slot_pairs),
        "predict": diff(model.predict(tokens[:64], verbose=0), plain.predict(tokens[:64], verbose=0)),
        "evaluate_workers": model.evaluate(token_fn, steps=2, verbose=0),
        "changed_rows": int((np.abs(table - before).sum(axis=1) > 0).sum()),
        "used_rows": len(set(tokens[:320].numpy().ravel().tolist())),
        "table_norm": float(np.linalg.norm(table)),
    }

# --- tf.train.Checkpoint: each server writes and reads its own shards ---------------------------------------
model = trained["AdamW"]
state = [*model.weights, *model.optimizer.variables]
saved = [np.asarray(v) for v in state]
path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(os.path.join(out_dir, "checkpoint", "ckpt"))
for v in state:  # overwritten, shard by shard on its server, then restored
    for part in getattr(v.value, "variables", [v.value]):
        part.assign(tf.ones_like(part))
tf.train.Checkpoint(model=model, optimizer=model.optimizer).read(path).assert_consumed()
result["checkpoint"] = {
    "exact": all(np.array_equal(a, np.asarray(v)) for a, v in zip(saved, state)),
    "sharded_entries": sorted([name.split("/.ATTRIBUTES/")[1], shape] for name, shape in tf.train.list_variables(path)
                              if "VARIABLE_VALUE_rows_" in name),
    "whole_entries": sorted(shape for name, shape in tf.train.list_variables(path) if name.endswith("VARIABLE_VALUE")),
    "files": sorted(os.listdir(os.path.dirname(path))),
}

# --- The layer called directly ------------------------------------------------------------------------------
with strategy.scope():
    mixed = keras.layers.Embedding(ROWS, DIM, dtype="mixed_float16", name="mixed")
    mixed.build()
    sharded_embedding.attach(mixed)
plain_mixed = keras.layers.Embedding(ROWS, DIM, dtype="mixed_float16")
plain_mixed.build()
plain_mixed.set_weights(mixed.get_weights())
ids = tf.constant([[-1, 0, 5, ROWS - 1], [1999, 2000, -ROWS, 3]])
out = mixed(ids)
sparse = tf.sparse.from_dense(tf.constant([[3, 0, -2], [0, 0, 2001]]))
ragged = tf.ragged.constant([[3, -2], [2001]])
result["layer"] = {"dtype": out.dtype.name, "negative_and_boundary": diff(out, plain_mixed(ids)),
                   "float_ids": diff(mixed(tf.cast(ids[:, 1:], tf.float32)), plain_mixed(tf.cast(ids[:, 1:], tf.float32))),
                   "sparse_ids": diff(mixed(sparse), plain_mixed(sparse)),
                   "ragged_ids": diff(mixed(ragged).flat_values, plain_mixed(ragged).flat_values)}




class Subclassed(keras.Model):  # its layers are created after the strategy meets the model
    def __init__(self):
        super().__init__()
        self.emb = keras.layers.Embedding(ROWS, DIM)
        self.head = keras.layers.Dense(3)

    def call(self, ids):
        return self.head(keras.ops.mean(self.emb(ids), axis=1))


with strategy.scope():
    subclassed = Subclassed()
    subclassed(tokens[:2])
plain_subclassed = Subclassed()
plain_subclassed(tokens[:2])
plain_subclassed.set_weights(subclassed.get_weights())
result["layer"]["subclassed_sharded"] = sharded_embedding.sharded_table(subclassed.emb) is not None
result["layer"]["subclassed_wrapped"] = hasattr(subclassed.emb.call, "__wrapped__")
result["layer"]["subclassed_predict"] = diff(subclassed.predict(tokens[:64], verbose=0),
                                             plain_subclassed.predict(tokens[:64], verbose=0))


# --- What a step runs where ---------------------------------------------------------------------------------
def walk(graph, outer=lambda tensor: None):
    """(op, its device, the captured variable handles it reads) for every op of `graph` and of the functions
    its ops call (cond branches, loop bodies), any depth. An op's device is the one it names, else that of
    the variable whose handle it reads (TF places resource ops with their resource), else "" (the worker
    the function runs on)."""
    captured = {internal.name: external for external, internal in graph.captures}

    def handle(tensor):  # the eager handle a placeholder stands for, following captures outwards
        external = captured.get(tensor.name)
        if external is None:
            return None
        return outer(external) if tf.is_symbolic_tensor(external) else external

    for op in graph.get_operations():
        handles = [h for h in map(handle, op.inputs) if h is not None and h.dtype == tf.resource]
        yield op, op.device or (handles[0].device if handles else ""), handles
        for attr in ("then_branch", "else_branch", "body", "cond", "f"):
            try:
                name = op.get_attr(attr).name
            except ValueError:
                continue
            yield from walk(graph._get_function(name).graph, handle)


def analyse(graph, table) -> dict:
    """Where every op of a traced function runs, which ops touch the table's shards, and output sizes."""
    shard_of = {id(s.handle): i for i, s in enumerate(table.variables)}
    ops, touches = [], set()
    for op, device, handles in walk(graph):
        size = max([t.shape.num_elements() if t.shape.is_fully_defined() else -1 for t in op.outputs], default=0)
        ops.append((op, device, size))
        touches |= {f"{op.type} shard {shard_of[id(h)]} on {device or 'the worker'}" for h in handles
                    if id(h) in shard_of}
    off_ps = [(op, size) for op, device, size in ops if "/job:ps" not in device]
    return {
        "ops": len(ops), "nested_ops": len(ops) - len(graph.get_operations()),
        "table_ops": sorted(touches),
        "full_table_ops": [f"{op.type} {op.name} {device or 'the worker'}" for op, device, size in ops
                           if size >= ROWS * DIM],
        "largest_off_ps": max([size for _, size in off_ps], default=0),
        "shard_sized_off_ps": [f"{op.type} {op.name}" for op, size in off_ps if size >= ROWS // 2 * DIM],
    }


tables = {name: sharded_embedding.sharded_table(m.get_layer("table")) for name, m in trained.items()}
result["graph"] = {name: [analyse(g, tables[name]) for g in found] for name, found in graphs.items()}
layer = trained["SGD"].get_layer("table")
spec = tf.TensorSpec((None, SEQ), tf.int32)
result["graph"]["lookup_tfdist"] = analyse(tf.function(layer.call).get_concrete_function(spec).graph, tables["SGD"])
stock = type(layer).call.__get__(layer)  # Keras' own Embedding.call, for contrast
result["graph"]["lookup_keras"] = analyse(tf.function(stock).get_concrete_function(spec).graph, tables["SGD"])


# --- An optimizer that is not elementwise: updated whole, with a warning ------------------------------------
with strategy.scope():
    lamb = build()
    lamb.compile(optimizer=keras.optimizers.Lamb(1e-2), loss=loss())
history = lamb.fit(token_fn, epochs=1, steps_per_epoch=3, verbose=0).history
result["fallback"] = {"loss": history["loss"], "warnings": warnings.messages}

with open(os.path.join(out_dir, "result.json"), "w") as f:
    json.dump(result, f, default=float)
print("ps_embedding_job: done", flush=True)
