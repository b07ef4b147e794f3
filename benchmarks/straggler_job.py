"""One job of `tfdist bench straggler`: the example CNN on MNIST, asynchronous or synchronous.

    tfdist launch -n 2 --ps 1 -- python -m benchmarks.straggler_job --mode async --out r.json ...
    tfdist launch -n 2        -- python -m benchmarks.straggler_job --mode sync  --out r.json ...

Both modes take the same per-worker batch B per step and train on the same number of images:

- async (`tfdist.ParameterServerStrategy`): a step is ONE worker's batch of B images, scheduled on
  whichever worker is free; an epoch is 2 x S steps;
- sync (`tfdist.MultiWorkerMirroredStrategy`): a step is the global batch of 2 x B images (B per worker);
  an epoch is S steps.

One `fit` of 2 epochs: the first is the warm-up (tracing, first steps), the second is timed. (Keras has
one steps_per_epoch per fit, and a second fit would retrace the async job's step function inside the timed
part, so the warm-up is as long as the timed epoch.) Images/s = images of the timed epoch / its wall time,
from the end of the warm-up epoch to the end of the timed one; in the async job both ends wait for every
scheduled step. The coordinating process (the chief; worker 0 in the sync job) prints marker lines that
the benchmark's driver acts on: MARK_THROTTLE (after the first THROTTLE_AFTER warm-up steps, which trace
the step function at full speed: the driver switches the quotas of the workers' cgroups on), MARK_START
and MARK_END (the timed epoch: it reads the cgroups' CPU use). This script knows nothing of cgroups. At
the end the coordinating process computes the accuracy on the MNIST test split (a forward pass in its own
process) and writes the JSON record (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

MARK_THROTTLE = "tfdist-straggler: throttle"
MARK_START = "tfdist-straggler: window start"
MARK_END = "tfdist-straggler: window end"
THROTTLE_AFTER = 5  # warm-up steps at full speed before the quotas are switched on


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.straggler_job")
    p.add_argument("--mode", required=True, choices=("async", "sync"))
    p.add_argument("--batch-size", type=int, required=True, help="images per worker per step (B)")
    p.add_argument("--steps", type=int, required=True,
                   help="S: synchronous steps per epoch (the async job runs 2 x S one-worker steps per epoch)")
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--max-in-flight", type=int, default=None, help="async: ParameterServerStrategy(max_in_flight)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="JSON record (written by the coordinating process)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import tfdist

    # First, before TensorFlow initialises; in the async job's worker and ps processes this serves forever.
    if args.mode == "async":
        strategy = tfdist.ParameterServerStrategy(max_in_flight=args.max_in_flight)
        coordinator = True
    else:
        strategy = tfdist.MultiWorkerMirroredStrategy()
        coordinator = tfdist.cluster.is_chief(strategy)
    import keras
    import numpy as np
    import tensorflow as tf

    keras.utils.set_random_seed(args.seed)
    arrays = tfdist.data.load_arrays("mnist")
    b = args.batch_size
    if args.mode == "async":
        workers = strategy.num_workers
        steps, images_per_step = workers * args.steps, b

        def dataset_fn(input_context):  # every worker its own endless pipeline, its own (unseeded) order
            ds = tf.data.Dataset.from_tensor_slices((arrays.x_train, arrays.y_train))
            return ds.shuffle(len(arrays.x_train)).repeat().batch(b).prefetch(tf.data.AUTOTUNE)

        train = dataset_fn
    else:
        workers = tfdist.cluster.world_size(strategy)
        steps, images_per_step = args.steps, workers * b
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
        train = (tf.data.Dataset.from_tensor_slices((arrays.x_train, arrays.y_train))
                 .shuffle(len(arrays.x_train), seed=args.seed).repeat().batch(workers * b)
                 .prefetch(tf.data.AUTOTUNE).with_options(options))
    with strategy.scope():
        model = tfdist.models.cnn(arrays.input_shape, arrays.num_classes, seed=args.seed)
        model.compile(optimizer=keras.optimizers.Adam(args.learning_rate), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])

    window: dict[str, float] = {}

    def mark(text: str) -> None:
        if coordinator:
            print(text, flush=True)

    class Window(keras.callbacks.Callback):
        """Epoch 0 is the warm-up: its first steps (tracing, the workers' first runs of the step function)
        go at full speed, then the quotas are switched on; epoch 1 is timed."""

        def on_train_batch_end(self, batch, logs=None):
            if "throttle" not in window and batch + 1 >= min(THROTTLE_AFTER, steps):
                window["throttle"] = time.perf_counter()
                mark(MARK_THROTTLE)

        def on_epoch_end(self, epoch, logs=None):
            now = time.perf_counter()
            window["start" if epoch == 0 else "end"] = now
            mark(MARK_START if epoch == 0 else MARK_END)

    begin = time.perf_counter()
    history = model.fit(train, epochs=2, steps_per_epoch=steps, verbose=0, callbacks=[Window()])
    seconds = window["end"] - window["start"]
    if not coordinator:
        return 0
    # Test accuracy from a plain forward pass in this process (no collective, nothing to trace): the
    # chief reads the variables from the parameter server; a synchronous worker holds them itself.
    predictions = np.concatenate([np.asarray(model(arrays.x_test[i:i + 500], training=False))
                                  for i in range(0, len(arrays.x_test), 500)])
    test_accuracy = float(np.mean(predictions.argmax(axis=1) == arrays.y_test))
    timed_images = steps * images_per_step
    record = {
        "mode": args.mode, "workers": workers, "batch_per_worker": b, "images_per_step": images_per_step,
        "steps_per_epoch": steps, "timed_images": timed_images, "train_images": 2 * timed_images,
        "timed_seconds": seconds, "warmup_seconds": window["start"] - begin,
        "images_per_sec": timed_images / seconds,
        "throttle_seconds": window["throttle"] - begin, "test_accuracy": test_accuracy,
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
    }
    with open(args.out, "w") as f:
        json.dump(record, f)
    print(f"straggler job ({args.mode}): {timed_images} images in {seconds:.2f} s = "
          f"{record['images_per_sec']:.0f} images/s; test accuracy {test_accuracy:.4f} after "
          f"{record['train_images']} training images", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
