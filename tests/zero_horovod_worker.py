"""One rank of the Horovod ZeRO tests: `python zero_horovod_worker.py OUT_DIR` under a 2-process launcher.

In one process, in order: stages 0, 1, 2 each train the same small CNN for 20 Adam steps and save
(`tfdist.training.save_model` on every rank; ModelCheckpoint / BackupAndRestore during the fit of
stages 2 / 1); a rank-0-only `model.save` under ZeRO must fail clearly; then the stage-0 file is
loaded into stages 0, 1, 2 and training continues for 4 steps. Everything the test compares goes
to OUT_DIR (rank{r}.json, *.npz, *.keras).
"""

from __future__ import annotations

import functools
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import lookups  # noqa: E402
import twins  # noqa: E402

RNG = np.random.default_rng(0)
X = RNG.normal(size=(256, 8, 8, 1)).astype("float32")
Y = RNG.integers(0, 10, 256)


def main() -> int:
    out = sys.argv[1]
    import keras
    import tensorflow as tf

    import tfdist
    from tfdist.zero.horovod_collectives import HorovodShardCollectives
    from tfdist.errors import ConfigError

    # Small chunks, so this 2,570-parameter CNN's ZeRO-2 reduce-scatter runs as 3 Horovod calls per step,
    # as a 25M-parameter model's does with the default 16 MiB.
    HorovodShardCollectives.CHUNK_BYTES = 4096

    os.makedirs(out, exist_ok=True)
    record: dict = {"stages": {}, "continue": {}}
    rank = None

    @functools.cache
    def plain_twin() -> keras.Model:
        """The same model built and trained in plain Keras, on this process's device."""
        model = tfdist.models.cnn((8, 8, 1), 10, filters=(4, 8), dense_units=16, seed=0)
        model.compile(optimizer=keras.optimizers.Adam(1e-2, name="adam"), loss="sparse_categorical_crossentropy")
        model.fit(X[:64], Y[:64], batch_size=64, verbose=0)
        return model

    def state(model) -> list[np.ndarray]:
        with tfdist.zero.gathered_state(model):  # every rank: reading sharded state is collective
            return [np.asarray(v.numpy()) for v in model.optimizer.variables]

    for stage in (0, 1, 2):
        strategy = tfdist.HorovodStrategy(zero_stage=stage, save_timeout_s=5)  # first: it may set up local logical CPUs
        rank = strategy.rank
        ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(64)  # 4 global steps per epoch
        with strategy.scope():
            model = tfdist.models.cnn((8, 8, 1), 10, filters=(4, 8), dense_units=16, seed=0)
            model.compile(optimizer=keras.optimizers.Adam(1e-2, name="adam"), loss="sparse_categorical_crossentropy")
        twin = twins.serialization_differences(model.optimizer)
        callbacks = []
        if stage == 2:
            callbacks.append(tfdist.training.ModelCheckpoint(os.path.join(out, "s2_ep{epoch}.keras")))
        if stage == 1:
            callbacks.append(tfdist.training.BackupAndRestore(os.path.join(out, "backup_s1"), delete_on_success=False))
        print(f"stage {stage}: fit", flush=True)
        model.fit(ds, epochs=5, shuffle=False, verbose=0, callbacks=callbacks)
        print(f"stage {stage}: fitted", flush=True)
        info: dict = {"replicas": strategy.num_replicas_in_sync, "iterations": int(model.optimizer.iterations.numpy()),
                      "memory": strategy.memory_report(model).to_dict(),
                      "twin": twin + twins.differences(model, plain_twin())}
        info["w_lookups"] = lookups.train_lookups(strategy).tolist()  # slices of unequal length per rank
        engine = tfdist.zero.engine_of(model.optimizer)
        if engine is not None:
            info["shard_ids"] = list(engine.comm.shard_ids)
            info["num_shards"] = engine.comm.num_shards
            info["num_params"] = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
            info["slots"] = {name: [{"shape": list(v.shape), "device": v.value.device,
                                     "distributed": isinstance(v.value, tf.distribute.DistributedValues)}
                                    for v in vs] for name, vs in engine.state.slots.items()}
            if rank == 0:  # the usual "save on rank 0" pattern must fail clearly, not hang
                try:
                    model.save(os.path.join(out, "rank0_only.keras"))
                    info["rank0_only_save"] = "saved"
                except ConfigError as err:
                    info["rank0_only_save"] = str(err)
        np.savez(os.path.join(out, f"s{stage}_rank{rank}.npz"), *model.get_weights())
        np.savez(os.path.join(out, f"s{stage}_state_rank{rank}.npz"), *state(model))
        tfdist.training.save_model(model, os.path.join(out, f"stage{stage}.keras"))
        record["stages"][stage] = info
        del model, strategy

    saved = os.path.join(out, "stage0.keras")
    for stage in (0, 1, 2):
        strategy = tfdist.HorovodStrategy(zero_stage=stage, save_timeout_s=5)
        with strategy.scope():
            model = keras.models.load_model(saved)
        ref = np.load(os.path.join(out, f"s0_state_rank{rank}.npz"))
        loaded = state(model)
        record["continue"][stage] = {
            "state_max_diff": max(float(np.abs(a - ref[f"arr_{i}"]).max()) for i, a in enumerate(loaded)),
            "state_count": [len(loaded), len(ref.files)]}
        model.fit(ds, epochs=1, shuffle=False, verbose=0)
        np.savez(os.path.join(out, f"cont{stage}_rank{rank}.npz"), *model.get_weights())
        del model, strategy

    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    print(f"rank {rank}: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
