"""A parameter-server job for the tests: run with `launch([python, ps_job.py, OUT_DIR, EPOCHS], 2, ps=2)`;
a third argument BACKUP_DIR adds tfdist.training.BackupAndRestore there (resume after a lost server).

The chief trains the example CNN on MNIST from a dataset function, checks the bad-input errors of
`fit`, and writes OUT_DIR/result.json (accuracy, where every variable's shards live, the errors) and
OUT_DIR/model.keras. Workers and parameter servers serve inside the strategy's constructor.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402
import twins  # noqa: E402

tf.get_logger().setLevel("INFO")  # the coordinator logs "Worker ... has been recovered." at INFO
out_dir, epochs = sys.argv[1], int(sys.argv[2])
backup_dir = sys.argv[3] if len(sys.argv) > 3 else None
strategy = tfdist.ParameterServerStrategy(min_shard_bytes=4096)  # ps and workers never return from here
keras.utils.set_random_seed(0)
arrays = tfdist.data.load_arrays("mnist")


def dataset_fn(input_context):
    ds = tf.data.Dataset.from_tensor_slices((arrays.x_train, arrays.y_train))
    return ds.shuffle(len(arrays.x_train)).repeat().batch(64)


with strategy.scope():
    model = tfdist.models.cnn(arrays.input_shape, arrays.num_classes, seed=0)
    model.compile(optimizer=keras.optimizers.Adam(1e-3, name="adam"), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
twin = twins.serialization_differences(model.optimizer)  # Keras' own check, on the optimizer as the scope made it

errors = {}
for name, call in {
    "dataset": lambda: model.fit(dataset_fn(None), epochs=1, steps_per_epoch=2),
    "no_steps": lambda: model.fit(dataset_fn, epochs=1),
}.items():
    try:
        call()
        errors[name] = None
    except tfdist.ConfigError as err:
        errors[name] = str(err)


class Progress(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        print(f"ps_job: epoch {epoch} done", flush=True)


callbacks = [Progress()]
if backup_dir:
    callbacks.insert(0, tfdist.training.BackupAndRestore(backup_dir, delete_on_success=False, strategy=strategy))
history = model.fit(dataset_fn, epochs=epochs, steps_per_epoch=60, verbose=2, callbacks=callbacks,
                    validation_data=(arrays.x_test, arrays.y_test))
loss, accuracy = model.evaluate(arrays.x_test, arrays.y_test, verbose=0)


class TestGraphs(keras.callbacks.Callback):  # the scheduled test step's traced graphs, read after evaluate
    graphs = []

    def on_test_begin(self, logs=None):
        TestGraphs.graphs = self.model.test_function.graphs


dist_loss, dist_accuracy = model.evaluate(dataset_fn, steps=5, verbose=0, callbacks=[TestGraphs()])
test_step_writes = sorted({op.type for g in TestGraphs.graphs for op in g.get_operations()
                           if op.type.startswith("Assign") and op.type.endswith("VariableOp")})
model.save(os.path.join(out_dir, "model.keras"))
# tfdist.data's two lines, unchanged from the synchronous strategies: the helper hands this strategy a dataset
# function that knows its steps per epoch.
data = tfdist.data.digits(global_batch_size=32, strategy=strategy)
with strategy.scope():
    small = keras.Sequential([keras.Input(data.arrays.input_shape), keras.layers.Flatten(), keras.layers.Dense(10)])
    small.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
helper = {"callable": callable(data.train), "steps_per_epoch": data.train.steps_per_epoch,
          "history": small.fit(data.train, validation_data=data.test, epochs=1, verbose=0).history}
# An embedding table split over both servers: its gradient is IndexedSlices per shard, joined.
tokens = tf.random.stateless_uniform((512, 12), seed=(1, 2), maxval=4000, dtype=tf.int32)
labels = tf.reduce_max(tokens, axis=1) % 10


def token_fn(input_context):
    return tf.data.Dataset.from_tensor_slices((tokens, labels)).repeat().batch(32)


with strategy.scope():
    embedder = keras.Sequential([keras.Input((12,), dtype="int32"), keras.layers.Embedding(4000, 32, name="table"),
                                 keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(10)])
    embedder.compile(optimizer=keras.optimizers.Adam(1e-2),
                     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
table = embedder.get_layer("table").embeddings
before = table.numpy()
embedding_history = embedder.fit(token_fn, epochs=1, steps_per_epoch=10, verbose=0).history
changed_rows = int((abs(table.numpy() - before).sum(axis=1) > 0).sum())
embedding = {"shards": [[list(s.shape), s.device] for s in table.value.variables],
             "slot_shards": [[list(s.shape), s.device] for v in embedder.optimizer.variables if "table" in v.path
                             for s in v.value.variables],
             "loss": embedding_history["loss"], "changed_rows": changed_rows,
             "used_rows": int(len(set(tokens.numpy().ravel().tolist())))}

# The same CNN in plain Keras on the chief's device, used as the job used it: tests/test_keras_twins.py's check.
plain = tfdist.models.cnn(arrays.input_shape, arrays.num_classes, seed=0)
plain.compile(optimizer=keras.optimizers.Adam(1e-3, name="adam"), loss="sparse_categorical_crossentropy",
              metrics=["accuracy"])
plain.fit(arrays.x_train[:64], arrays.y_train[:64], batch_size=64, verbose=0,
          validation_data=(arrays.x_test[:64], arrays.y_test[:64]))
plain.evaluate(arrays.x_test[:64], arrays.y_test[:64], verbose=0)
twin += twins.differences(model, plain)

shards = {v.path: [s.device for s in getattr(v.value, "variables", [v.value])]
          for v in model.variables + model.optimizer.variables}
with open(os.path.join(out_dir, "result.json"), "w") as f:
    json.dump({"test_accuracy": accuracy, "test_loss": loss, "worker_eval_accuracy": dist_accuracy,
               "test_step_writes": test_step_writes, "helper": helper, "twin": twin,
               "history": history.history, "shards": shards, "errors": errors, "embedding": embedding,
               "predict": model.predict(arrays.x_test[:8], verbose=0).argmax(1).tolist()}, f)
print("ps_job: done", flush=True)
