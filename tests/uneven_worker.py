"""One rank of tests/test_uneven_data.py: `python uneven_worker.py BACKEND OUT` under `tfdist launch -n 2`.

`python uneven_worker.py BACKEND OUT overhead [STEPS]` instead measures what the agreement costs on even data
(the small CNN, global batch 128): see `overhead()`.

Rank 0 reads 18 rows (batches of 4, 4, 4, 4, 2), rank 1 reads 15 (4, 4, 4, 3): per-rank datasets of different
lengths, through distribute_datasets_from_function (a user's own sharding). For each mode ('stop', 'join') and
each kind of cardinality (known; unknown, through a filter) a fresh linear model trains 2 epochs with
steps_per_epoch=None; the rank writes its weights, history, batches per epoch and evaluate results (and the
step count of an even dataset through experimental_distribute_dataset) to OUT/rank{r}.json, which the test
compares across ranks and with a NumPy reference.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROWS = {0: 18, 1: 15}
BATCH = 4
LR = 0.1


def rank_data(rank: int):
    import numpy as np

    rng = np.random.default_rng(rank)
    x = rng.normal(size=(ROWS[rank], 3)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5]], "float32") + 0.3 + 0.1 * rng.normal(size=(ROWS[rank], 1))).astype("float32")
    return x, y


def main() -> int:
    backend, out = sys.argv[1], sys.argv[2]
    import tfdist

    # The strategy comes first: MultiWorkerMirroredStrategy configures collectives before TF starts.
    strategy = tfdist.MultiWorkerMirroredStrategy(timeout_s=60) if backend == "tf" else tfdist.HorovodStrategy()
    if sys.argv[3:4] == ["overhead"]:
        return overhead(strategy, out, *(int(a) for a in sys.argv[4:5]))
    import keras
    import tensorflow as tf

    rank = tfdist.cluster.rank(strategy)

    def dataset_fn(known: bool):
        def make(context: tf.distribute.InputContext) -> tf.data.Dataset:
            ds = tf.data.Dataset.from_tensor_slices(rank_data(context.input_pipeline_id)).batch(BATCH)
            return ds if known else ds.filter(lambda x, y: True)  # a filter: the cardinality is unknown
        return make

    class Batches(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.per_epoch, self.steps_param = [], self.params.get("steps")

        def on_epoch_begin(self, epoch, logs=None):
            self.per_epoch.append(0)

        def on_train_batch_end(self, batch, logs=None):
            self.per_epoch[-1] += 1

    record: dict = {"rank": rank, "replicas": strategy.num_replicas_in_sync}
    for mode in ("stop", "join"):
        for known in (True, False):
            data = strategy.distribute_datasets_from_function(dataset_fn(known), uneven_data=mode)
            with strategy.scope():
                model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(
                    1, kernel_initializer=keras.initializers.Constant([[0.1], [0.2], [-0.1]]))])
                model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
            batches = Batches()
            history = model.fit(data, epochs=2, verbose=0, callbacks=[batches])
            tag = f"{mode}-{'known' if known else 'unknown'}"
            record[tag] = {"weights": [w.tolist() for w in model.get_weights()], "loss": history.history["loss"],
                           "batches": batches.per_epoch, "steps_param": batches.steps_param,
                           "cardinality": int(data.cardinality)}
            if known:
                record[tag]["evaluate"] = float(model.evaluate(data, verbose=0))
            print(f"rank {rank}: {tag} done {record[tag]['batches']}", flush=True)
    record["agreements"] = strategy.uneven_data_agreements()
    # A dataset through experimental_distribute_dataset (even: every rank gets its slice of each global batch).
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    global_batches = strategy.experimental_distribute_dataset(tf.data.Dataset.range(102).batch(16).with_options(options))
    record["global_batches"] = {"cardinality": int(global_batches.cardinality), "steps": sum(1 for _ in global_batches)}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    print(f"rank {rank}: done {record['agreements']}", flush=True)
    return 0


def overhead(strategy, out: str, steps: int = 300) -> int:
    """Step time of the small CNN on even data, three ways, interleaved step by step (so the machine's load
    falls on all three alike):

    - "agreed": the strategy's datasets (tfdist's agreement, riding along with the gradient all-reduce);
    - "tf": TF's own distributed dataset (what tfdist did before: TF's iterator all-reduces its own
      "replicas with data" count before every step), no flags in the gradient all-reduce;
    - "none": TF's dataset with that count switched off: no agreement at all (the bare step; it would hang
      on uneven data).

    Each way has its own model (same initial weights) and train function, called one step at a time on its
    own iterator (Keras' train function, as `fit` calls it). The cost of a way is the median over the rounds
    of (its step / the bare step in the same round); the first 10 rounds are warm-up.
    """
    import time

    import keras
    import numpy as np
    import tensorflow as tf

    import tfdist
    from tfdist.strategies.data_parallel import DataParallel

    rank = tfdist.cluster.rank(strategy)
    rng = np.random.default_rng(0)
    x = rng.random((1024, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, 1024)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(128).prefetch(2)  # global batch 128
    stock = super(DataParallel, strategy)  # the tf.distribute class's own methods
    carrier = strategy.extended.step_carrier

    def variant(name: str):
        if name == "agreed":
            data = strategy.experimental_distribute_dataset(dataset)
        else:
            strategy.extended.experimental_enable_get_next_as_optional = name == "tf"
            data = stock.experimental_distribute_dataset(dataset)
            strategy.extended.experimental_enable_get_next_as_optional = True
        with strategy.scope():
            model = tfdist.models.cnn((28, 28, 1), 10, seed=0)
            model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
        strategy.extended.step_carrier = carrier if name == "agreed" else None  # traced now, without flags
        model.fit(data, epochs=1, steps_per_epoch=3, verbose=0)
        strategy.extended.step_carrier = carrier
        return model, iter(data)

    names = ("agreed", "tf", "none")
    runs = {name: variant(name) for name in names}
    times: dict = {name: [] for name in names}
    cpu: dict = {name: [] for name in names}
    for r in range(steps + 10):
        for name in names[r % 3:] + names[:r % 3]:  # rotate the order: no way always runs first
            model, iterator = runs[name]
            start, start_cpu = time.perf_counter(), time.process_time()
            float(model.train_function(iterator)["loss"])  # one step; reading the loss waits for it
            if r >= 10:
                times[name].append((time.perf_counter() - start) * 1e3)
                cpu[name].append((time.process_time() - start_cpu) * 1e3)  # this process's threads
    t = {name: np.array(ms) for name, ms in times.items()}
    ratios = {name: t[name] / t["none"] for name in ("agreed", "tf")}
    result = {"rank": rank, "steps": steps, "median_step_ms": {n: float(np.median(v)) for n, v in t.items()},
              "p10_step_ms": {n: float(np.percentile(v, 10)) for n, v in t.items()},
              "median_cpu_ms": {n: float(np.median(v)) for n, v in cpu.items()},
              **{f"{n}_vs_none": float(np.median(v)) - 1 for n, v in ratios.items()},
              **{f"{n}_vs_none_iqr": [float(q) - 1 for q in np.percentile(v, [25, 75])] for n, v in ratios.items()},
              "agreements": strategy.uneven_data_agreements()}
    with open(os.path.join(out, f"overhead-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    print(f"rank {rank}: {json.dumps(result)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
