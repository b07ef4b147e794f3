"""What the tensor-parallel worker scripts across processes train (TF collectives: tensor_parallel_model_procs_job.py;
Horovod: tensor_parallel_horovod_job.py): the data, the models, the optimizers, and how a run is read back.

Import it after the scripts have created their strategies (it imports Keras and TensorFlow)."""
import keras
import numpy as np
import tensorflow as tf

from tp_models import mlp, transformer_block

rng = np.random.RandomState(0)
DATA = {
    "mlp": (rng.rand(64, 12).astype("float32"), rng.randint(0, 5, size=64), 16),
    "transformer": (rng.rand(32, 6, 16).astype("float32"), rng.randint(0, 3, size=32), 8),
}
BUILD = {"mlp": mlp, "transformer": transformer_block}
RUNS = [("mlp", "sgd", lambda: keras.optimizers.SGD(0.1)), ("mlp", "adam", lambda: keras.optimizers.Adam(0.01)),
        ("transformer", "adam", lambda: keras.optimizers.Adam(0.01)),
        # Clipping by the logical variables' norms (0.02 / 0.05 clip every step: below the gradients' norms; with
        # rows across processes the shards' squares are summed by the row's all-reduce) and Keras' EMA, on the
        # summed gradient (SummedGradientUpdate).
        ("mlp", "sgd-clipnorm", lambda: keras.optimizers.SGD(0.1, momentum=0.9, clipnorm=0.02)),
        ("mlp", "sgd-globalclipnorm", lambda: keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=0.05)),
        ("mlp", "sgd-ema", lambda: keras.optimizers.SGD(0.1, use_ema=True, ema_overwrite_frequency=5))]
UNCLIPPED = lambda: keras.optimizers.SGD(0.1, momentum=0.9)  # noqa: E731


def logical(model, strategy_=None) -> dict:
    """Every logical variable by path (a split layer's variables read whole: a collective across processes)."""
    values = {v.path: v.numpy() for v in model.weights if "_shard_" not in v.path}
    for split in strategy_.shard_plan(model).layers if strategy_ is not None else []:
        values.update({kv.path: kv.numpy() for kv in split.logical.values()})
    return {path: np.asarray(value).tolist() for path, value in values.items()}


def fit(name, optimizer, strategy_, metrics=()):
    """12 steps of `name` with `optimizer()` under `strategy_` (None: one device), seeded alike everywhere."""
    x, y, batch = DATA[name]
    scope = strategy_.scope() if strategy_ is not None else tf.distribute.get_strategy().scope()
    with scope:
        keras.utils.set_random_seed(11)
        model = BUILD[name]()
        model.compile(optimizer=optimizer(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=list(metrics))
    history = model.fit(x, y, batch_size=batch, epochs=3, shuffle=False, verbose=0)  # 12 steps
    return model, history.history["loss"]


def traced_step_graph(strategy_, model, name) -> tf.Graph:
    """The graph of one SGD step of `model` in the custom-loop pattern (strategy.run inside a tf.function), traced
    on `name`'s first batch and never run: what it exchanges is read from it."""
    x, y, batch = DATA[name]
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with strategy_.scope():
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def step(xb, yb):
        return strategy_.run(replica_step, args=(xb, yb))

    return step.get_concrete_function(tf.constant(x[:batch]), tf.constant(y[:batch])).graph
