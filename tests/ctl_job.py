"""TensorFlow's custom-training-loop tutorial, unchanged, on one strategy, with a checkpoint round trip
through Keras `fit`. Used by tests/test_custom_loop_checkpoint.py.

Usage: python ctl_job.py KIND[,KIND...] OUT_DIR   (in-process kinds: stock, tfdist, zero1, zero2, zero3,
placement, tensor-parallel; under `tfdist launch -n 2 [--backend horovod]` or `mpirun -np 2`: multiworker,
multiworker-zero2 (one per process: MultiWorkerMirroredStrategy is set up once), horovod, horovod-zero2,
horovod-zero3). Several kinds run one after another in the process, each with its own strategy.

Three epochs of the same 4 global batches of 32, each epoch on a fresh model restored from the previous one's
`tf.train.Checkpoint` (the tutorial's loop, then `compile` + `fit`, then the loop again), so the result equals
three uninterrupted epochs only if model and optimizer state survive CTL -> fit -> CTL. The stock kind also
runs the three epochs uninterrupted. The chief prints one line `RESULT KIND {json}` per kind.
"""
import json
import os
import shutil
import sys
import tempfile

kinds, out_dir = sys.argv[1].split(","), sys.argv[2]
import tfdist

bases = {kind.partition("-zero")[0] for kind in kinds}
if "multiworker" in bases:  # the strategy first: collectives are configured before TensorFlow starts
    assert len(kinds) == 1, "MultiWorkerMirroredStrategy: one kind per process (its collectives are set up once)"
    multiworker = tfdist.MultiWorkerMirroredStrategy(timeout_s=60, zero_stage=int(kinds[0].partition("-zero")[2] or 0))
elif bases != {"horovod"}:
    assert "horovod" not in bases, "Horovod kinds run under a launcher, apart from the in-process ones"
    tfdist.devices.virtual_cpus(2)
import keras
import numpy as np
import tensorflow as tf

devices = ["/cpu:0", "/cpu:1"]


def _layout():
    """Column-parallel `up`, row-parallel `down` over a one-row mesh of the two devices."""
    layout_map = tfdist.LayoutMap(tfdist.DeviceMesh((1, 2), ("batch", "model"), devices))
    layout_map[".*up/kernel"] = (None, "model")
    layout_map[".*up/bias"] = ("model",)
    layout_map[".*down/kernel"] = ("model", None)
    return layout_map


def make_strategy(kind: str):
    base, _, zero = kind.partition("-zero")
    stage = int(zero or 0)
    if base == "multiworker":
        return multiworker
    if base == "horovod":
        return tfdist.HorovodStrategy(zero_stage=stage, save_timeout_s=30)
    return {"stock": lambda: tf.distribute.MirroredStrategy(devices),
            "tfdist": lambda: tfdist.MirroredStrategy(devices=devices),
            "zero1": lambda: tfdist.MirroredStrategy(devices=devices, zero_stage=1),
            "zero2": lambda: tfdist.MirroredStrategy(devices=devices, zero_stage=2),
            "zero3": lambda: tfdist.MirroredStrategy(devices=devices, zero_stage=3),
            "placement": lambda: tfdist.LayerPlacementStrategy(devices),
            "tensor-parallel": lambda: tfdist.ModelParallelStrategy(_layout())}[kind]()


GLOBAL_BATCH = 32
rng = np.random.default_rng(0)
x, y = rng.normal(size=(128, 6)).astype("float32"), rng.integers(0, 3, size=128).astype("int32")
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).with_options(options)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


def run(kind: str, out: str) -> None:
    """The tutorial's loop and the round trip through fit on `kind`'s strategy; the chief prints its RESULT line."""
    strategy = make_strategy(kind)
    multi_process = kind.partition("-zero")[0] in ("multiworker", "horovod")
    chief = tfdist.cluster.is_chief(strategy) if multi_process else True

    def new_model(seed: int):
        keras.utils.set_random_seed(seed)  # a fresh model: only a restore can give it the trained state
        with strategy.scope():
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu", name="up"),
                                      keras.layers.Dense(3, name="down")])
            optimizer = keras.optimizers.Adam(1e-2)
            if kind == "stock":  # stock MirroredStrategy cannot build it lazily (keras#19246)
                optimizer.build(model.trainable_variables)
        return model, optimizer

    def ctl_epoch(model, optimizer) -> list[float]:
        """One epoch of the tutorial's loop: strategy.run + experimental_distribute_dataset +
        compute_average_loss + strategy.reduce; the optimizer builds itself on its first apply."""
        @tf.function
        def train_step(inputs):
            def step(features, labels):
                with tf.GradientTape() as tape:
                    loss = tf.nn.compute_average_loss(loss_fn(labels, model(features, training=True)),
                                                      global_batch_size=GLOBAL_BATCH)
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
                return loss
            return strategy.reduce("SUM", strategy.run(step, args=inputs), axis=None)

        return [float(train_step(batch)) for batch in strategy.experimental_distribute_dataset(dataset)]

    def save(model, optimizer, name: str) -> str:
        """The multi-worker tutorial's saving: every worker writes, the chief where it is kept."""
        where = out if chief else tempfile.mkdtemp(prefix="ctl-ckpt-")
        # Unchanged under multi-process ZeRO too: every rank's save reads the shards of all (Horovod: each read is
        # agreed on by every rank first, tfdist.comm.read_agreement).
        tf.train.Checkpoint(model=model, optimizer=optimizer).write(os.path.join(where, name))
        if not chief:
            shutil.rmtree(where)
        return os.path.join(out, name)

    def restore(model, optimizer, path: str) -> None:
        with strategy.scope():
            optimizer.build(model.trainable_variables)  # so the slots exist to receive the saved state
        tf.train.Checkpoint(model=model, optimizer=optimizer).read(path).assert_consumed()

    result = {"losses": []}
    model, optimizer = new_model(0)
    result["losses"] += ctl_epoch(model, optimizer)  # 1. the custom loop, optimizer built lazily
    first = save(model, optimizer, "ctl-1")

    model, optimizer = new_model(1)  # 2. fit, from the custom loop's checkpoint
    with strategy.scope():
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    restore(model, optimizer, first)
    history = model.fit(dataset, epochs=1, verbose=0)
    result["fit_loss"] = history.history["loss"][-1]
    second = save(model, optimizer, "fit-2")

    model, optimizer = new_model(2)  # 3. the custom loop again, from fit's checkpoint
    restore(model, optimizer, second)
    result["losses"] += ctl_epoch(model, optimizer)
    # Logical weights, read through the layers (as get_weights gives them, also under tensor parallelism).
    result["weights"] = [np.asarray(w).tolist() for layer in model.layers for w in (layer.kernel, layer.bias)]
    result["iterations"] = int(optimizer.iterations.numpy())
    with tfdist.zero.gathered_state(optimizer):  # every process reads (multi-process ZeRO: gathers once)
        slots = [np.asarray(v).tolist() for v in optimizer.variables if np.ndim(v) > 0]
    result["slots"] = None if kind == "tensor-parallel" else slots  # per shard there: compared through the weights

    if kind == "stock":  # the reference: three uninterrupted epochs of the loop
        model, optimizer = new_model(0)
        for _ in range(3):
            ctl_epoch(model, optimizer)
        result["uninterrupted"] = [w.tolist() for w in model.get_weights()]
    if chief:
        print("RESULT", kind, json.dumps(result), flush=True)


for kind in kinds:  # one after another, each with its own strategy and checkpoint directory
    os.makedirs(os.path.join(out_dir, kind), exist_ok=True)
    run(kind, os.path.join(out_dir, kind))
