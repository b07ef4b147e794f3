"""A parameter-server job with one big embedding table, for the memory-capped test (test_ps_embedding.py).

Run with `launch([python, ps_big_table_job.py, OUT_DIR, ROWS, DIM, OPTIMIZER], N, ps=K)`. With
TFDIST_TEST_CGROUP set, every process first moves itself into the memory cgroup
`$TFDIST_TEST_CGROUP-rank$TFDIST_RANK` (made and capped by the test), before TensorFlow loads, so all
its memory counts against that cap.

The chief builds Embedding(ROWS, DIM) -> mean -> Dense(1) in the strategy's scope (the table is split over
the K servers and initialised there, shard by shard), trains 2 epochs of 3 steps with `fit` on ids drawn
from the first 1000 rows, and writes OUT_DIR/result.json: the shards' shapes and devices, the losses,
and a few rows read through sharded lookups (used rows before/after, one row no batch touches).
It never reads the whole table.
"""

import os
import sys

if os.environ.get("TFDIST_TEST_CGROUP"):
    with open(f"/sys/fs/cgroup/memory/{os.environ['TFDIST_TEST_CGROUP']}-rank{os.environ['TFDIST_RANK']}/cgroup.procs",
              "w") as f:
        f.write(str(os.getpid()))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import json

import keras
import numpy as np
import tensorflow as tf

import tfdist
from tfdist.parameter_server.sharded_embedding import lookup, sharded_table

out_dir, rows, dim, optimizer = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
strategy = tfdist.ParameterServerStrategy(min_shard_bytes=1 << 20)  # ps and workers never return from here
print("big_table_job: connected", flush=True)
USED = 1000  # batches use rows < USED only


def dataset_fn(input_context):
    ids = tf.random.stateless_uniform((512, 8), seed=(3, 4), maxval=USED, dtype=tf.int32)
    target = tf.cast(tf.reduce_sum(ids, axis=1) % 7, tf.float32)
    return tf.data.Dataset.from_tensor_slices((ids, target)).repeat().batch(64)


with strategy.scope():
    model = keras.Sequential([keras.Input((8,), dtype="int32"), keras.layers.Embedding(rows, dim, name="table"),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1, name="head")])
    model.compile(optimizer=keras.optimizers.get({"class_name": optimizer, "config": {"learning_rate": 0.5}}),
                  loss="mse")
print("big_table_job: table created", flush=True)
table = sharded_table(model.get_layer("table"))
probe = tf.constant([0, 1, USED - 1, rows - 1])  # three used rows and the last one, never used
before = lookup(table, probe).numpy()
history = model.fit(dataset_fn, epochs=2, steps_per_epoch=3, verbose=2).history
after = lookup(table, probe).numpy()
with open(os.path.join(out_dir, "result.json"), "w") as f:
    json.dump({"shards": [[s.shape.as_list(), s.device] for s in table.variables], "loss": history["loss"],
               "used_rows_changed": bool(np.abs(after[:3] - before[:3]).max() > 0),
               "unused_row_changed": bool(np.abs(after[3] - before[3]).max() > 0),
               "row_spread": float(np.abs(before).max())}, f)
print("big_table_job: done", flush=True)
