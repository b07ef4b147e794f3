"""ZeRO takes every gradient form stock tf.distribute takes inside `strategy.run`: per-replica tensors, one tensor
shared by every replica, IndexedSlices, None and variables left out, with EMA, accumulation, weight decay and
clipping; each equal to one device given the summed gradient (stock's sum: a shared tensor counts once)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.errors import ConfigError

REPLICAS = 4
STEPS = 4
G = np.linspace(-1, 1, 12, dtype="float32").reshape(6, 2)
ROWS = [1, 4]

# global_clipnorm between the norms of the summed per-replica gradients (clipped) and of the shared tensor (not
# clipped; test_the_clip_threshold_separates_the_forms): a shared gradient counted once per replica, or
# per-replica gradients averaged instead of summed, would show.
OPTIONS = {
    "ema-decay-clip": dict(use_ema=True, ema_overwrite_frequency=3, weight_decay=0.1, global_clipnorm=15.0),
    "accumulate-ema-decay-clip": dict(gradient_accumulation_steps=2, use_ema=True, weight_decay=0.1,
                                      global_clipnorm=15.0),
}


def variables():
    return (keras.Variable(np.arange(12, dtype="float32").reshape(6, 2) / 10, name="w"),
            keras.Variable(np.ones((10, 3), "float32"), name="embedding"),
            keras.Variable(np.full((3,), 0.5, "float32"), name="unused"))


def optimizer(options: str) -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(0.1, momentum=0.5, **OPTIONS[options])


def pairs(form: str, w, e, u, replica, shared):
    """The (gradient, variable) list one replica passes; `replica` is its index as a float tensor, `shared` one
    tensor made outside the replica function (the same object on every replica)."""
    per_replica = tf.constant(G) * (replica + 1.0)
    if form == "per-replica":
        return [(per_replica, w)]  # the other variables left out: no gradient, no update
    if form == "shared":
        return [(shared, w), (None, e), (None, u)]
    slices = tf.IndexedSlices(tf.ones((2, 3)) * (replica + 1.0), tf.constant(ROWS), tf.constant([10, 3]))
    return [(per_replica, w), (slices, e), (None, u)]


def summed(form: str, w, e, u):
    """What one device applies: the sum over replicas (a shared tensor is already the sum, as stock reduces it)."""
    total = sum(range(1, REPLICAS + 1))
    if form == "per-replica":
        return [(tf.constant(G * total), w)]
    if form == "shared":
        return [(tf.constant(G), w)]
    dense = np.zeros((10, 3), "float32")
    dense[ROWS] = total
    return [(tf.constant(G * total), w), (tf.constant(dense), e)]


def one_device(form: str, options: str) -> list[np.ndarray]:
    w, e, u = variables()
    opt = optimizer(options)
    opt.build([w, e, u])
    for _ in range(STEPS):
        opt.apply_gradients(summed(form, w, e, u))
    opt.finalize_variable_values([w, e, u])  # as fit ends: the EMA written into the variables
    return [v.numpy() for v in (w, e, u)]


def under(strategy, form: str, options: str) -> list[np.ndarray]:
    with strategy.scope():
        w, e, u = variables()
        opt = optimizer(options)
        opt.build([w, e, u])

    @tf.function
    def step():
        shared = tf.constant(G)

        def replica_step():
            ctx = tf.distribute.get_replica_context()
            opt.apply_gradients(pairs(form, w, e, u, tf.cast(ctx.replica_id_in_sync_group, tf.float32), shared))

        strategy.run(replica_step)

    for _ in range(STEPS):
        step()
    with strategy.scope():
        opt.finalize_variable_values([w, e, u])
    return [v.numpy() for v in (w, e, u)]


@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("form", ["per-replica", "shared", "indexed-slices-and-none"])
def test_every_gradient_form_at_every_stage_equals_one_device(form, options):
    expected = one_device(form, options)
    for stage in (0, 1, 2):
        strategy = tfdist.MirroredStrategy(zero_stage=stage)
        if stage == 0 and "accumulate" in options:
            # Keras puts an accumulating update in a tf.cond, where merge_call replicas cannot meet; ZeRO accumulates.
            with pytest.raises(ConfigError, match="gradient_accumulation_steps=2 at zero_stage=0 needs one device"):
                under(strategy, form, options)
            continue
        got = under(strategy, form, options)
        for name, mine, theirs in zip(("w", "embedding", "unused"), got, expected, strict=True):
            np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-6, err_msg=f"stage {stage}: {name}")



class Owner(keras.layers.Layer):
    """A layer owning the three variables: stage 3 shards the weights of a model's layers (gathered by their
    calls), so there they are a layer's, with the same initial values."""

    def build(self, input_shape):
        initial = dict(zip(("w", "embedding", "unused"), (np.asarray(v) for v in variables())))
        for name, value in initial.items():
            setattr(self, name, self.add_weight(shape=value.shape, name=name,
                                                initializer=keras.initializers.Constant(value)))

    def call(self, x):
        return x + keras.ops.sum(self.w) + keras.ops.sum(self.embedding) + keras.ops.sum(self.unused)


@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("form", ["per-replica", "shared", "indexed-slices-and-none"])
def test_every_gradient_form_at_stage3_equals_one_device(form, options):
    """Whole gradients (the variables' shapes) passed in a custom loop at stage 3: summed over the replicas and cut
    into each replica's piece by one reduce-scatter; a shared tensor counts once; IndexedSlices as their dense
    gradient; a variable without one left alone."""
    strategy = tfdist.MirroredStrategy(zero_stage=3)
    with strategy.scope():
        owner = Owner()
        model = keras.Sequential([keras.Input((1,)), owner])
        opt = optimizer(options)
        opt.build(model.trainable_variables)
    weights = (owner.w, owner.embedding, owner.unused)

    @tf.function
    def step():
        shared = tf.constant(G)

        def replica_step():
            ctx = tf.distribute.get_replica_context()
            opt.apply_gradients(pairs(form, *weights, tf.cast(ctx.replica_id_in_sync_group, tf.float32), shared))

        strategy.run(replica_step)

    for _ in range(STEPS):
        step()
    with strategy.scope():
        opt.finalize_variable_values(list(weights))
    assert tfdist.zero.engine_of(opt).stage == 3
    for name, mine, theirs in zip(("w", "embedding", "unused"), weights, one_device(form, options), strict=True):
        np.testing.assert_allclose(mine.numpy(), theirs, rtol=1e-6, atol=1e-6, err_msg=f"stage 3: {name}")


def test_stage3_leaves_a_variable_without_a_gradient_as_keras_does():
    """A two-output model trained on one output's loss only: the other head gets no gradient (Keras drops it), so
    neither it nor its Adam state moves (weight decay skips it too; its EMA stays its value). ZeRO-3 equals one
    device, as stage 0 does, also when one unit holds both heads."""
    rng = np.random.RandomState(0)
    # 20 samples in batches of 8: the last batch is partial, so steps are also traced with an unknown batch size
    # (the tape then hands the unused head a ZerosLike, not a constant).
    x, y = rng.rand(20, 4).astype("float32"), rng.rand(20, 2).astype("float32")

    def train(strategy):
        with strategy.scope():
            keras.utils.set_random_seed(1)
            inputs = keras.Input((4,))
            hidden = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
            model = keras.Model(inputs, {"a": keras.layers.Dense(2, name="a")(hidden),
                                         "b": keras.layers.Dense(2, name="b")(hidden)})
            model.compile(keras.optimizers.Adam(0.01, weight_decay=0.1, use_ema=True, ema_overwrite_frequency=3),
                          loss={"a": "mse", "b": None})
        before = {w.path: w.numpy() for w in model.weights}
        model.fit(x, {"a": y, "b": y}, batch_size=8, epochs=3, shuffle=False, verbose=0)
        return before, {w.path: w.numpy() for w in model.weights}

    before, expected = train(tf.distribute.OneDeviceStrategy("/cpu:0"))
    np.testing.assert_array_equal(expected["b/kernel"], before["b/kernel"])  # Keras: no gradient, no step
    assert not np.allclose(expected["a/kernel"], before["a/kernel"])
    # Stage 3 with one unit per layer, and with the whole model as one unit (both heads gathered together: the
    # head without a loss is still left alone, not updated with a zero gradient).
    for stage, options in ((0, {}), (3, {}), (3, {"fsdp_unit_bytes": 1 << 20})):
        _, got = train(tfdist.MirroredStrategy(zero_stage=stage, **options))
        for path, value in expected.items():
            np.testing.assert_allclose(got[path], value, rtol=1e-6, atol=1e-6,
                                       err_msg=f"stage {stage} {options}: {path}")


def test_the_clip_threshold_separates_the_forms():
    clip = OPTIONS["ema-decay-clip"]["global_clipnorm"]
    assert all(options["global_clipnorm"] == clip for options in OPTIONS.values())
    per_replica_sum = np.linalg.norm(G * sum(range(1, REPLICAS + 1)))
    shared_four_times = np.linalg.norm(G * REPLICAS)
    assert per_replica_sum > clip > shared_four_times > np.linalg.norm(G)


def test_gradients_zero_cannot_take_are_config_errors():
    """Outside `strategy.run`, one variable twice, and at stage 3 a gradient of neither the variable's nor its
    piece's shape: each a ConfigError that says what to do, before anything is applied; raised while a user's
    step is traced, it reaches the user as a ConfigError still (AutoGraph keeps the type)."""
    for stage in (1, 2):
        strategy = tfdist.MirroredStrategy(zero_stage=stage)
        with strategy.scope():
            w, e, u = variables()
            opt = optimizer("ema-decay-clip")
            opt.build([w, e, u])
        with strategy.scope(), pytest.raises(ConfigError, match=r"must run inside strategy.run\(\)"):
            opt.apply_gradients([(tf.constant(G), w)])
        with pytest.raises(ConfigError, match="two gradients for one variable.*pass each variable once"):
            strategy.run(tf.function(lambda: opt.apply_gradients([(tf.constant(G), w), (tf.constant(G), w)])))
    strategy = tfdist.MirroredStrategy(zero_stage=3)
    with strategy.scope():
        owner = Owner()
        model = keras.Sequential([keras.Input((1,)), owner])
        opt = optimizer("ema-decay-clip")
        opt.build(model.trainable_variables)
    with pytest.raises(ConfigError, match=r"the gradient of .*w has shape \(12,\): pass the variable's shape "
                                          r"\(6, 2\) or its piece's \(3,\)"):
        strategy.run(tf.function(lambda: opt.apply_gradients([(tf.ones(12), owner.w)])))


# --- Lookups (IndexedSlices) with optimizers that are not linear in the gradient --------------------------------
# Keras on TensorFlow squares each looked-up row's slice separately (Adam's second moment of a row looked up k times
# gets k squares), and stock tf.distribute all-gathers the replicas' slices: ZeRO must hand its update the same.

def lookups(replica):
    """Replica r looks up rows 1 and 4, then row r % 3 r + 1 times: counts differ between replicas (a collective
    gathers them padded), rows repeat within a replica and across replicas."""
    rows = tf.concat([tf.constant(ROWS), tf.repeat(tf.cast(replica, tf.int32) % 3, tf.cast(replica, tf.int32) + 1)], 0)
    count = tf.shape(rows)[0]
    values = (replica + 1.0) * (1.0 + tf.reshape(tf.range(count * 3, dtype=tf.float32), [count, 3]) / 10)
    return tf.IndexedSlices(values, rows, tf.constant([10, 3]))


SHARED_ROWS = [0, 2, 0]  # the third variable's lookups: one int64 tensor made outside the replica function


def shared_lookups(replica, rows):
    return tf.IndexedSlices((replica + 1.0) * tf.constant([1.0, 2.0, 3.0]), rows, tf.constant([3], tf.int64))


def adam():
    return keras.optimizers.Adam(0.1, use_ema=True, ema_overwrite_frequency=3, weight_decay=0.1, clipvalue=4.0)


def one_device_adam(densified: bool) -> list[np.ndarray]:
    """One device given what stock's all-reduce gives it: the replicas' slices concatenated (or, `densified`, their
    dense sum: what ZeRO used to apply)."""
    w, e, u = variables()
    opt = adam()
    opt.build([w, e, u])
    every = [lookups(tf.constant(float(r))) for r in range(REPLICAS)]
    slices = tf.IndexedSlices(tf.concat([s.values for s in every], 0), tf.concat([s.indices for s in every], 0),
                              tf.constant([10, 3]))
    third = [shared_lookups(tf.constant(float(r)), tf.constant(SHARED_ROWS, tf.int64)) for r in range(REPLICAS)]
    third = tf.IndexedSlices(tf.concat([s.values for s in third], 0), tf.concat([s.indices for s in third], 0),
                             tf.constant([3], tf.int64))
    for _ in range(STEPS):
        opt.apply_gradients([(tf.constant(G * sum(range(1, REPLICAS + 1))), w),
                             (tf.convert_to_tensor(slices) if densified else slices, e),
                             (tf.convert_to_tensor(third) if densified else third, u)])
    opt.finalize_variable_values([w, e, u])
    return [v.numpy() for v in (w, e, u)]


def test_lookups_reach_adam_as_stock_hands_them_at_every_stage():
    """A custom loop's IndexedSlices (counts differing per replica; for a third, rank-1 variable one index tensor
    shared by every replica) under Adam with EMA, weight decay and clipvalue: stages 1, 2 and 3 equal one device
    given the concatenated slices, which differs from the dense sum's result."""
    expected = one_device_adam(densified=False)
    densified = one_device_adam(densified=True)
    for k in (1, 2):
        assert np.abs(expected[k] - densified[k]).max() > 1e-2  # the test tells the two apart
    for stage in (1, 2, 3):
        strategy = tfdist.MirroredStrategy(zero_stage=stage)
        with strategy.scope():
            owner = Owner()
            model = keras.Sequential([keras.Input((1,)), owner])
            opt = adam()
            opt.build(model.trainable_variables)
        weights = (owner.w, owner.embedding, owner.unused)

        @tf.function
        def step():
            rows = tf.constant(SHARED_ROWS, tf.int64)  # the same tensor object on every replica

            def replica_step():
                replica = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
                opt.apply_gradients([(tf.constant(G) * (replica + 1.0), weights[0]), (lookups(replica), weights[1]),
                                     (shared_lookups(replica, rows), weights[2])])

            strategy.run(replica_step)

        for _ in range(STEPS):
            step()
        with strategy.scope():
            opt.finalize_variable_values(list(weights))
        assert tfdist.zero.engine_of(opt).stage == stage
        for name, mine, theirs in zip(("w", "embedding", "unused"), weights, expected, strict=True):
            np.testing.assert_allclose(mine.numpy(), theirs, rtol=1e-6, atol=1e-6, err_msg=f"stage {stage}: {name}")
