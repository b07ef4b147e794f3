"""Worker script of tests/test_keras_distribution.py: Keras-on-JAX-style `keras.distribution` code, unchanged,
across processes through `tfdist.enable_keras_distribution()`.

Usage (under `tfdist launch -n 2 --devices-per-worker 2`): python keras_distribution_job.py OUT
A ModelParallel over every process's devices (mesh 2 x 2: "batch" across the processes, "model" inside each, the
test MLP split Megatron-style) trains 2 epochs from a tf.data.Dataset; writes OUT/rank{r}.json with the job as
Keras sees it, the logical weights, evaluate (also with auto_shard_dataset=False, each process evaluating its
own half) and predict; the chief also writes OUT/mlp.keras.
"""
import json
import sys

import keras
import numpy as np
import tensorflow as tf

import tfdist

out = sys.argv[1]
tfdist.enable_keras_distribution()
keras.distribution.initialize()  # from tfdist launch's TF_CONFIG
devices = keras.distribution.list_devices()
mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices)
layout_map = keras.distribution.LayoutMap(mesh)
layout_map["mlp/up/kernel"] = (None, "model")
layout_map["mlp/up/bias"] = ("model",)
layout_map["mlp/down/kernel"] = ("model", None)
distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
keras.distribution.set_distribution(distribution)

keras.utils.set_random_seed(3)  # the test's one-device model: same seed, same layers
model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="relu", name="up"),
                          keras.layers.Dense(5, name="down")], name="mlp")
model.compile(optimizer=keras.optimizers.Adam(0.01), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
rng = np.random.RandomState(0)
x, y = rng.rand(64, 12).astype("float32"), rng.randint(0, 5, size=64)
model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=2, verbose=0)
loss = model.evaluate(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), verbose=0)
predicted = model.predict(tf.data.Dataset.from_tensor_slices(x[:16]).batch(16), verbose=0)
rank = tfdist.cluster.rank(model.distribute_strategy)
distribution.auto_shard_dataset = False  # each process evaluates its own half, batched by its share (8 of 16)
own_loss = model.evaluate(tf.data.Dataset.from_tensor_slices((x[rank::2], y[rank::2])).batch(8), verbose=0)
if rank == 0:
    model.save(f"{out}/mlp.keras")
record = {"devices": devices, "processes": distribution.num_processes, "replicas":
          model.distribute_strategy.num_replicas_in_sync, "kind": type(model.distribute_strategy).__name__,
          "weights": [w.tolist() for w in model.get_weights()], "loss": loss, "own_loss": own_loss,
          "predicted": predicted.tolist()}
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump(record, f)
