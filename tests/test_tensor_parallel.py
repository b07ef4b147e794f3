"""Feature splitting (tensor parallelism): DeviceMesh/LayoutMap semantics, bad input, equivalence to one device,
shards on their devices, Megatron pairing counted in the traced step, and saving at one mesh / loading at another."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.errors import ConfigError
from tfdist.tensor_parallel import collective_counts

import tp_models
from tp_models import cnn_layout, mlp_layout, transformer_layout  # noqa: F401 (other tests import them from here)

DEVICES = [f"/cpu:{i}" for i in range(4)]
MESHES = [(1, 2), (1, 4), (2, 2)]


def mlp() -> keras.Model:
    return tp_models.mlp(seed=7)


def data(n: int = 64):
    rng = np.random.RandomState(0)
    return rng.rand(n, 12).astype("float32"), rng.randint(0, 5, size=n)


def strategy_for(shape) -> tfdist.ModelParallelStrategy:
    mesh = tfdist.DeviceMesh(shape, ("batch", "model"), DEVICES[:int(np.prod(shape))])
    return tfdist.ModelParallelStrategy(mlp_layout(mesh), batch_dim_name="batch")


def train(strategy, optimizer: Callable, epochs: int = 2) -> keras.Model:
    x, y = data()
    with strategy.scope() if strategy else _nothing():
        model = mlp()
        model.compile(optimizer=optimizer(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    return model


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def weights_by_layer(model) -> dict[str, list[np.ndarray]]:
    """Each layer's logical weights (kernel, bias), read through the layer: the same for split and whole."""
    return {layer.name: [layer.kernel.numpy(), layer.bias.numpy()] for layer in model.layers[1:]}


# --- DeviceMesh and LayoutMap ---------------------------------------------------------------------------------
def test_mesh_and_layout_map_follow_keras_semantics():
    mesh = tfdist.DeviceMesh((2, 2), ("batch", "model"), DEVICES)
    assert mesh.shape == (2, 2) and mesh.axis_names == ("batch", "model")
    assert mesh.devices[1, 0] == "/device:CPU:2" and mesh.axis_size("model") == 2
    assert mesh.grid("batch") == [["/device:CPU:0", "/device:CPU:1"], ["/device:CPU:2", "/device:CPU:3"]]
    assert mesh.grid("model") == [["/device:CPU:0", "/device:CPU:2"], ["/device:CPU:1", "/device:CPU:3"]]
    layout_map = tfdist.LayoutMap(mesh)
    layout_map["dense.*kernel"] = (None, "model")
    layout_map["dense.*bias"] = ("model",)
    layout_map["dense_2/kernel"] = ["model", None]  # exact key wins over the regex, as in Keras
    assert layout_map["dense_1/kernel"] == (None, "model")
    assert layout_map["dense_2/kernel"] == ("model", None)
    assert layout_map["conv/kernel"] is None
    assert len(layout_map) == 3 and list(layout_map) == ["dense.*kernel", "dense.*bias", "dense_2/kernel"]
    with pytest.raises(ConfigError, match="already holds"):
        layout_map["dense.*bias"] = (None,)


def test_keras_layout_map_is_accepted():
    keras_mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"), ["/cpu:0", "/cpu:1"])
    keras_map = keras.distribution.LayoutMap(keras_mesh)
    keras_map[".*up1/kernel"] = (None, "model")
    keras_map[".*up1/bias"] = ("model",)
    keras_map[".*down1/kernel"] = ("model", None)
    strategy = tfdist.ModelParallelStrategy(keras_map)
    assert dict(strategy.layout_map) == {".*up1/kernel": (None, "model"), ".*up1/bias": ("model",),
                                         ".*down1/kernel": ("model", None)}
    assert strategy.mesh_rows == [["/device:CPU:0", "/device:CPU:1"]]


def test_bad_meshes_and_layouts_raise_clear_errors():
    with pytest.raises(ConfigError, match=r"holds 4 devices but 2 were given"):
        tfdist.DeviceMesh((2, 2), ("batch", "model"), DEVICES[:2])
    with pytest.raises(ConfigError, match="same length"):
        tfdist.DeviceMesh((2, 2), ("batch",), DEVICES)
    mesh = tfdist.DeviceMesh((1, 4), ("batch", "model"), DEVICES)
    layout_map = tfdist.LayoutMap(mesh)
    with pytest.raises(ConfigError, match=r"names axis 'tensor', which the mesh lacks.*\('batch', 'model'\)"):
        layout_map["dense/kernel"] = (None, "tensor")
    with pytest.raises(ConfigError, match="batch_dim_name='data' is not an axis"):
        tfdist.ModelParallelStrategy(layout_map, batch_dim_name="data")


def _shard_with(layout: dict, shape=(1, 4), model_fn=mlp):
    mesh = tfdist.DeviceMesh(shape, ("batch", "model"), DEVICES[:int(np.prod(shape))])
    layout_map = tfdist.LayoutMap(mesh)
    for key, value in layout.items():
        layout_map[key] = value
    strategy = tfdist.ModelParallelStrategy(layout_map)
    with strategy.scope():
        model = model_fn()
    return strategy.shard(model)


def test_bad_layouts_for_a_model_name_the_variable_and_the_fix():
    # 5 output features of "head" over 4 devices: names the variable, the dimension and the sizes that divide
    with pytest.raises(ConfigError, match=r"'head/kernel'.*dimension 1 of size 5 .*axis 'model' of size 4.*\[1, 5\]"):
        _shard_with({"head/kernel": (None, "model")})
    with pytest.raises(ConfigError, match=r"'up1/kernel' matches several LayoutMap keys: \['up.\*', '.\*kernel'\]"):
        _shard_with({"up.*": (None, "model"), ".*kernel": (None, "model")})
    with pytest.raises(ConfigError, match="row-parallel Dense .* leave the bias replicated"):
        _shard_with({"down1/kernel": ("model", None), "down1/bias": ("model",)})
    with pytest.raises(ConfigError, match="over the batch axis"):
        _shard_with({"up1/kernel": (None, "batch")}, shape=(2, 2))
    with pytest.raises(ConfigError, match="has 1 entries but variable 'up1/kernel' has shape"):
        _shard_with({"up1/kernel": ("model",)})

    def cnn():
        inputs = keras.Input((8, 8, 1))
        return keras.Model(inputs, keras.layers.Conv2D(4, 3, name="conv")(inputs))

    with pytest.raises(ConfigError, match="Conv2D kernel can be split on its output channels"):
        # a 3x3 kernel over 3 devices: divisible, but a spatial split is no way to split a convolution
        _shard_with({"conv/kernel": ("model", None, None, None)}, model_fn=cnn, shape=(1, 3))

    def normed():
        inputs = keras.Input((8,))
        return keras.Model(inputs, keras.layers.LayerNormalization(name="norm")(inputs))

    with pytest.raises(ConfigError, match="LayerNormalization cannot be split yet"):
        _shard_with({"norm/gamma": ("model",)}, model_fn=normed)
    with pytest.warns(UserWarning, match=r"LayoutMap key 'nothing.\*' matches no variable"):
        _shard_with({"nothing.*": (None, "model"), "up1/kernel": (None, "model")})


# --- training equals one device ----------------------------------------------------------------------------
@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_sgd_training_equals_one_device(shape):
    reference = weights_by_layer(train(None, lambda: keras.optimizers.SGD(0.1)))
    strategy = strategy_for(shape)
    split = weights_by_layer(train(strategy, lambda: keras.optimizers.SGD(0.1)))
    for name, values in reference.items():
        for ref, got in zip(values, split[name]):
            assert np.abs(ref - got).max() < 1e-5, name
    assert any(np.abs(ref - mlp().get_layer(name).kernel.numpy()).max() > 1e-3
               for name, (ref, _) in reference.items())  # training did move the weights


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_adam_training_equals_one_device(shape):
    reference = weights_by_layer(train(None, lambda: keras.optimizers.Adam(0.01)))
    split = weights_by_layer(train(strategy_for(shape), lambda: keras.optimizers.Adam(0.01)))
    for name, values in reference.items():
        for ref, got in zip(values, split[name]):
            assert np.abs(ref - got).max() <= 1e-4 * max(np.abs(ref).max(), 1e-3), name


def test_shards_are_variables_on_their_devices():
    strategy = strategy_for((2, 2))
    model = train(strategy, lambda: keras.optimizers.Adam(0.01), epochs=1)
    kernels = [v for v in model.trainable_variables if v.path.startswith("up1/kernel_shard")]
    assert [tuple(v.shape) for v in kernels] == [(12, 16), (12, 16)]
    devices = [[c.device.rsplit("/", 1)[-1] for c in v.value.values] for v in kernels]
    assert devices == [["device:CPU:0", "device:CPU:2"], ["device:CPU:1", "device:CPU:3"]]
    down = [v for v in model.trainable_variables if v.path.startswith("down2/kernel_shard")]
    assert [tuple(v.shape) for v in down] == [(16, 16), (16, 16)]
    assert model.get_layer("up1").kernel.shape == (12, 32)  # the logical variable reads whole
    # Adam's slots sit next to their shard
    slots = [v for v in model.optimizer.variables if "up1_kernel_shard_1" in v.path]
    assert slots and all([c.device.rsplit("/", 1)[-1] for c in s.value.values] == devices[1] for s in slots)
    plan = strategy.shard_plan(model)
    sizes = plan.bytes_per_device
    assert sizes["/device:CPU:1"] < 0.6 * plan.replicated_bytes  # replicated head and biases stay on CPU:0
    assert sizes["/device:CPU:0"] == sizes["/device:CPU:2"] and sizes["/device:CPU:1"] == sizes["/device:CPU:3"]


# --- Megatron pairing, counted in the traced step ------------------------------------------------------------
def sgd_step(strategy, model, from_logits: bool = True):
    """TF's custom-training-loop step (strategy.run inside a tf.function) for `model`, SGD built in the scope."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits, reduction="sum")
    with strategy.scope():
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True)) / 16
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def step(xb, yb):
        return strategy.run(replica_step, args=(xb, yb))

    return step


def traced_step_counts(strategy, model) -> dict[str, int]:
    x, y = data(16)
    step = sgd_step(strategy, model)
    return collective_counts(step.get_concrete_function(tf.constant(x), tf.constant(y)).graph)


def test_column_row_pairs_exchange_once_forward_and_once_backward():
    strategy = strategy_for((1, 2))
    with strategy.scope():
        model = mlp()
    counts = traced_step_counts(strategy, model)
    # Two column/row pairs: one all-reduce forward per pair (g), one backward per pair (f) -- except the
    # first pair, whose input is the data (no gradient wanted). Nothing between the layers of a pair.
    assert counts == {"tp_all_reduce": 2 + 1, "tp_all_gather": 0, "tp_scatter": 0}


def test_an_unpaired_column_layer_costs_a_gather():
    mesh = tfdist.DeviceMesh((1, 2), ("batch", "model"), DEVICES[:2])
    layout_map = tfdist.LayoutMap(mesh)
    layout_map["up2/kernel"] = (None, "model")  # column-parallel, read by a replicated layer
    strategy = tfdist.ModelParallelStrategy(layout_map)
    with strategy.scope():
        model = mlp()
    counts = traced_step_counts(strategy, model)
    assert counts == {"tp_all_reduce": 1, "tp_all_gather": 1, "tp_scatter": 0}  # f backward, concat forward


def test_each_shard_computes_on_its_device_forward_and_backward():
    strategy = strategy_for((1, 2))
    with strategy.scope():
        model = mlp()
    step = sgd_step(strategy, model)
    x, y = data(16)
    where = tfdist.pipeline.executed_devices(lambda: step(tf.constant(x), tf.constant(y)))
    on_second = {name for name, devices in where.items() if any(d.endswith("CPU:1") for d in devices)}
    for layer in ("up1", "down1", "up2", "down2"):
        ops = [name for name in on_second if re.search(rf"(^|/){layer}(_\d+)?/", name)]
        forward = [name for name in ops if not name.startswith("gradient_tape")]
        backward = [name for name in ops if name.startswith("gradient_tape")]
        assert forward and backward, (layer, ops)  # shard 1 of every split layer computes on CPU:1, both ways
    # the replicated head computes at home (only the transfer of its input gradient, a `/_N` node, reaches CPU:1)
    assert not [name for name in on_second if re.search(r"(^|/)head(_\d+)?/", name) and not re.search(r"/_\d+$", name)]


# --- the Keras path: evaluate, predict, callbacks, saving ----------------------------------------------------
def test_evaluate_predict_and_keras_file_across_meshes(tmp_path):
    x, y = data()
    strategy = strategy_for((2, 2))
    path = str(tmp_path / "model.keras")
    model = train(strategy, lambda: keras.optimizers.Adam(0.01), epochs=1)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
              callbacks=[keras.callbacks.ModelCheckpoint(path), keras.callbacks.History()])
    expected = model.predict(x, batch_size=16, verbose=0)
    loss = model.evaluate(x, y, batch_size=16, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Keras warns when it skips optimizer state it cannot match
        # plain Keras reads the file: full logical variables, and Adam's state in plain Keras' layout
        plain = keras.saving.load_model(path)
        # another mesh shape reads it too
        other = strategy_for((1, 4))
        with other.scope():
            reloaded = keras.saving.load_model(path)
    assert plain.get_layer("up1").kernel.shape == (12, 32)
    np.testing.assert_allclose(plain.predict(x, verbose=0), expected, atol=1e-5)
    np.testing.assert_allclose(plain.evaluate(x, y, verbose=0), loss, rtol=1e-5)
    np.testing.assert_allclose(reloaded.predict(x, batch_size=16, verbose=0), expected, atol=1e-5)
    assert len(other.shard_plan(reloaded).layers) == 4
    # all three continue training from the same weights and optimizer state
    for m in (model, plain, reloaded):
        m.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    for name, values in weights_by_layer(model).items():
        for other_model in (plain, reloaded):
            for ref, got in zip(values, weights_by_layer(other_model)[name]):
                assert np.abs(ref - got).max() <= 1e-4 * max(np.abs(ref).max(), 1e-3), name
    # weights saved from a split model load into a split model of another shape
    model.save_weights(str(tmp_path / "w.weights.h5"))
    with other.scope():
        fresh = mlp()
    other.shard(fresh)
    fresh.load_weights(str(tmp_path / "w.weights.h5"))
    np.testing.assert_allclose(fresh.predict(x, batch_size=16, verbose=0), model.predict(x, batch_size=16, verbose=0),
                               atol=1e-5)


def test_a_model_split_before_fit_still_saves_logical_optimizer_state(tmp_path):
    """strategy.shard_plan(model) before fit splits the model before its optimizer is built: the optimizer is
    then built on the shards directly, and must still save Adam's state in plain Keras' layout."""
    x, y = data()
    strategy = strategy_for((2, 2))
    with strategy.scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert len(strategy.shard_plan(model).layers) == 4
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / "early.keras")
    model.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Keras warns when it skips optimizer state it cannot match
        plain = keras.saving.load_model(path)
    up1 = plain.get_layer("up1").kernel
    momentum = plain.optimizer.variables[2 + 2 * [v.path for v in plain.trainable_variables].index(up1.path)]
    assert tuple(momentum.shape) == (12, 32) and float(np.abs(momentum.numpy()).max()) > 0


def test_custom_training_loop_and_checkpoint(tmp_path):
    x, y = data()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")

    def run(strategy):
        with strategy.scope():
            model = mlp()
            optimizer = keras.optimizers.SGD(0.1)
            optimizer.build(model.trainable_variables)
        dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(16))

        def replica_step(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True)) / 16
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        @tf.function
        def step(xb, yb):
            return strategy.reduce("SUM", strategy.run(replica_step, args=(xb, yb)), axis=None)

        for xb, yb in dataset:
            step(xb, yb)
        return model, optimizer

    reference, _ = run(tf.distribute.get_strategy())
    strategy = strategy_for((2, 2))
    model, optimizer = run(strategy)
    for name, values in weights_by_layer(reference).items():
        for ref, got in zip(values, weights_by_layer(model)[name]):
            assert np.abs(ref - got).max() < 1e-5, name
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    saved = checkpoint.save(str(tmp_path / "ckpt"))
    before = model.get_layer("up2").kernel.numpy()
    model.get_layer("up2").kernel.assign(np.zeros_like(before))
    assert np.abs(model.get_layer("up2").kernel.numpy()).max() == 0
    checkpoint.restore(saved).assert_existing_objects_matched()
    np.testing.assert_array_equal(model.get_layer("up2").kernel.numpy(), before)


def test_vocabulary_split_embedding_equals_one_device():
    def lm():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((6,), dtype="int32")
        x = keras.layers.Embedding(40, 8, name="embed")(inputs)
        x = keras.layers.GlobalAveragePooling1D()(x)
        return keras.Model(inputs, keras.layers.Dense(3, name="out")(x))

    rng = np.random.RandomState(1)
    x, y = rng.randint(0, 40, size=(32, 6)), rng.randint(0, 3, size=32)

    def fit(strategy):
        with strategy.scope():
            model = lm()
            model.compile(optimizer=keras.optimizers.SGD(0.5), loss=keras.losses.SparseCategoricalCrossentropy(
                from_logits=True))
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return model.get_layer("embed").embeddings.numpy()

    reference = fit(tf.distribute.get_strategy())
    mesh = tfdist.DeviceMesh((2, 2), ("batch", "model"), DEVICES)
    layout_map = tfdist.LayoutMap(mesh)
    layout_map["embed/embeddings"] = ("model", None)
    strategy = tfdist.ModelParallelStrategy(layout_map)
    np.testing.assert_allclose(fit(strategy), reference, atol=1e-5)


@pytest.mark.parametrize("tied, layout", [
    (True, {"token_embedding/embeddings": ("model", None)}),  # logits column-parallel over the vocabulary
    (True, {"token_embedding/embeddings": (None, "model")}),  # logits row-parallel over the features
    (False, {"token_embedding/embeddings": ("model", None), "token_embedding/reverse_embeddings": (None, "model")}),
    (False, {"token_embedding/reverse_embeddings": ("model", None)}),  # only the output kernel split
], ids=["tied-vocab", "tied-features", "untied-both", "untied-reverse-only"])
def test_reversible_embedding_both_ways_equals_one_device(tied, layout):
    """A decoder's tied (or untied) input/output embedding, KerasHub's ReversibleEmbedding, called again with
    reverse=True for the logits: the split model's logits have the vocabulary as last dimension and 6 Adam steps
    equal one device, with the mask of mask_zero and a logit soft cap."""
    vocab, width, length = 32, 8, 6

    def lm():
        keras.utils.set_random_seed(4)
        inputs = keras.Input((length,), dtype="int32")
        table = keras.layers.ReversibleEmbedding(vocab, width, tie_weights=tied, mask_zero=True, logit_soft_cap=5.0,
                                                 name="token_embedding")
        x = table(inputs)
        x = keras.layers.Dense(width, activation="tanh", name="ff")(x)
        return keras.Model(inputs, table(x, reverse=True))

    rng = np.random.RandomState(2)
    x, y = rng.randint(0, vocab, size=(24, length)), rng.randint(0, vocab, size=(24, length))

    def fit(strategy):
        with strategy.scope():
            model = lm()
            model.compile(optimizer=keras.optimizers.Adam(0.02),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return model

    reference = fit(tf.distribute.get_strategy())
    layout_map = tfdist.LayoutMap(tfdist.DeviceMesh((2, 2), ("batch", "model"), DEVICES))
    for key, value in layout.items():
        layout_map[key] = value
    strategy = tfdist.ModelParallelStrategy(layout_map)
    split = fit(strategy)
    assert len(strategy.shard_plan(split).layers) == 1 and strategy.shard_plan(split).layers[0].kind == "reversible"
    assert split.predict(x[:4], verbose=0).shape == (4, length, vocab)
    np.testing.assert_allclose(split.predict(x, verbose=0), reference.predict(x, verbose=0), rtol=1e-4, atol=1e-5)
    for mine, theirs in zip(split.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-5)


def test_auto_layout_map_pairs_consecutive_dense_layers():
    mesh = tfdist.DeviceMesh((1, 4), ("batch", "model"), DEVICES)
    layout_map = tfdist.LayoutMap.auto(mlp(), mesh)
    assert dict(layout_map) == {
        "up1/kernel": (None, "model"), "up1/bias": ("model",), "down1/kernel": ("model", None),
        "up2/kernel": (None, "model"), "up2/bias": ("model",), "down2/kernel": ("model", None)}
    assert all(re.escape(key) == key for key in layout_map)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy = tfdist.ModelParallelStrategy(layout_map)
        reference = weights_by_layer(train(None, lambda: keras.optimizers.SGD(0.1)))
        split = weights_by_layer(train(strategy, lambda: keras.optimizers.SGD(0.1)))
    for name, values in reference.items():
        assert np.abs(values[0] - split[name][0]).max() < 1e-5


def test_an_optimizer_built_before_the_split_is_refused():
    strategy = strategy_for((1, 2))
    with strategy.scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.optimizer.build(model.trainable_variables)  # outside the scope: no split, full-size state
    with pytest.raises(ConfigError, match="optimizer was built before the model was split"):
        strategy.shard(model)


def test_data_by_model_2x4_on_8_devices_equals_one_device(python):
    out = python("""
        import numpy as np, keras, tfdist
        tfdist.devices.virtual_cpus(8)
        import sys; sys.path.insert(0, "tests")
        from test_tensor_parallel import mlp_layout, data, mlp
        x, y = data()
        def fit(strategy):
            with strategy.scope():
                model = mlp()
                model.compile(optimizer=keras.optimizers.SGD(0.1),
                              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
            return model
        import tensorflow as tf
        reference = fit(tf.distribute.get_strategy())
        mesh = tfdist.DeviceMesh((2, 4), ("batch", "model"), [f"/cpu:{i}" for i in range(8)])
        strategy = tfdist.ModelParallelStrategy(mlp_layout(mesh))
        split = fit(strategy)
        diff = max(float(np.abs(a.kernel.numpy() - b.kernel.numpy()).max()) for a, b in
                   zip(reference.layers[1:], split.layers[1:]))
        shards = [tuple(v.shape) for v in split.trainable_variables if v.path.startswith("up1/kernel_shard")]
        print("RESULT", diff, shards, strategy.mesh_rows[1])
    """)
    line = next(line for line in out.stdout.splitlines() if line.startswith("RESULT"))
    assert float(line.split()[1]) < 1e-5, line
    assert "[(12, 8), (12, 8), (12, 8), (12, 8)]" in line and "CPU:7" in line


def transformer_block() -> keras.Model:
    return tp_models.transformer_block(seed=5)


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_transformer_block_with_heads_split_equals_one_device(shape):
    rng = np.random.RandomState(2)
    x, y = rng.rand(32, 6, 16).astype("float32"), rng.randint(0, 3, size=32)

    def fit(strategy):
        with strategy.scope():
            model = transformer_block()
            model.compile(optimizer=keras.optimizers.Adam(0.01),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return model

    reference = fit(tf.distribute.get_strategy())
    mesh = tfdist.DeviceMesh(shape, ("batch", "model"), DEVICES[:int(np.prod(shape))])
    strategy = tfdist.ModelParallelStrategy(transformer_layout(mesh))
    split = fit(strategy)
    for path in ("mha/query/kernel", "mha/attention_output/kernel", "ff_up/kernel", "ln1/gamma", "out/kernel"):
        layer_name, *_ = path.split("/")
        ref = {v.path: v.numpy() for v in reference.get_layer(layer_name).weights}
        got = {v.path: v.numpy() for v in _logical(split.get_layer(layer_name))}
        assert np.abs(ref[path] - got[path]).max() <= 1e-4 * max(np.abs(ref[path]).max(), 1e-3), path
    kinds = {layer.name: layer.kind for layer in strategy.shard_plan(split).layers}
    assert kinds == {"query": "einsum_column", "key": "einsum_column", "value": "einsum_column",
                     "attention_output": "einsum_row", "ff_up": "column", "ff_down": "row"}
    if shape == (1, 2):
        counts = traced_step_counts_for(strategy, split, x[:8], y[:8])
        # forward: the attention output projection's sum and the feed-forward's; backward: the feed-forward's f
        # (the attention block reads the input data: no gradient wanted there). Heads never gathered.
        assert counts == {"tp_all_reduce": 2 + 1, "tp_all_gather": 0, "tp_scatter": 0}


def _logical(layer) -> list:
    """A layer's logical variables (the split ones read through the layer's own attributes)."""
    if isinstance(layer, keras.layers.MultiHeadAttention):
        return [w for sub in (layer.query_dense, layer.key_dense, layer.value_dense, layer.output_dense)
                for w in (sub.kernel, sub.bias)]
    names = ("kernel", "bias", "gamma", "beta")
    return [getattr(layer, n) for n in names if getattr(layer, n, None) is not None]


def traced_step_counts_for(strategy, model, x, y, from_logits: bool = True) -> dict[str, int]:
    step = sgd_step(strategy, model, from_logits)
    return collective_counts(step.get_concrete_function(tf.constant(x), tf.constant(y)).graph)


def test_auto_layout_map_splits_attention_heads_and_the_feed_forward():
    mesh = tfdist.DeviceMesh((1, 4), ("batch", "model"), DEVICES)
    model = transformer_block()
    layout_map = tfdist.LayoutMap.auto(model, mesh)
    expected = transformer_layout(mesh)
    paths = [v.path for v in model.weights]
    assert {p: layout_map[p] for p in paths} == {p: expected[p] for p in paths}


def test_tf_checkpoint_moves_between_mesh_shapes_and_plain_keras_with_adam_state(tmp_path):
    x, y = data()
    model = train(strategy_for((2, 2)), lambda: keras.optimizers.Adam(0.01), epochs=1)
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(str(tmp_path / "ckpt"))
    names = dict(tf.train.list_variables(path))
    # plain Keras' layout: logical shapes for the variables and Adam's slots of the split ones
    assert sorted(shape for name, shape in names.items() if name.startswith("optimizer/_variables/")).count(
        [12, 32]) == 2

    def restored(strategy):
        with strategy.scope() if strategy else _nothing():
            other = mlp()
            other.compile(optimizer=keras.optimizers.Adam(0.01),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            other.optimizer.build(other.trainable_variables)
        tf.train.Checkpoint(model=other, optimizer=other.optimizer).restore(path).assert_existing_objects_matched()
        return other

    others = [restored(strategy_for((1, 4))), restored(None)]
    for m in (model, *others):
        m.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    for name, values in weights_by_layer(model).items():
        for other in others:
            for ref, got in zip(values, weights_by_layer(other)[name]):
                assert np.abs(ref - got).max() <= 1e-4 * max(np.abs(ref).max(), 1e-3), name


def test_a_sequential_model_and_its_inner_functional_model_split_once():
    mesh = tfdist.DeviceMesh((1, 2), ("batch", "model"), DEVICES[:2])
    layout_map = tfdist.LayoutMap(mesh)
    layout_map[".*up/kernel"] = (None, "model")  # Sequential paths carry the model's name: sequential_N/up/kernel
    layout_map[".*down/kernel"] = ("model", None)
    strategy = tfdist.ModelParallelStrategy(layout_map)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="up"),
                                      keras.layers.Dense(2, name="down")])
            model.compile(optimizer="sgd", loss="mse")
        model.fit(np.ones((8, 4)), np.ones((8, 2)), batch_size=4, verbose=0)
    assert [v.path for v in model.trainable_variables] == [
        "up/kernel_shard_0", "up/kernel_shard_1", model.get_layer("up").bias.path,
        "down/kernel_shard_0", "down/kernel_shard_1", model.get_layer("down").bias.path]
    assert [split.name for split in strategy.shard(model).layers] == ["up", "down"]


@pytest.mark.parametrize("shape", [(1, 2), (2, 2)], ids=lambda s: "x".join(map(str, s)))
def test_example_cnn_with_channels_split_equals_one_device(shape):
    rng = np.random.RandomState(4)
    x, y = rng.rand(32, 8, 8, 1).astype("float32"), rng.randint(0, 10, size=32)

    def fit(strategy):
        with strategy.scope():
            model = tfdist.models.cnn(input_shape=(8, 8, 1), filters=(8, 8), dense_units=16)
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return model

    reference = fit(tf.distribute.get_strategy())
    mesh = tfdist.DeviceMesh(shape, ("batch", "model"), DEVICES[:int(np.prod(shape))])
    strategy = tfdist.ModelParallelStrategy(cnn_layout(mesh))
    split = fit(strategy)
    for name in ("conv1", "conv2", "dense1", "logits"):
        ref, got = reference.get_layer(name), split.get_layer(name)
        assert np.abs(ref.kernel.numpy() - got.kernel.numpy()).max() < 1e-5, name
        assert np.abs(ref.bias.numpy() - got.bias.numpy()).max() < 1e-5, name
    assert {s.name: s.kind for s in strategy.shard(split).layers} == {
        "conv1": "conv_column", "conv2": "conv_row", "dense1": "column", "logits": "row"}
    if shape == (1, 2):
        # the pooling between conv1 and conv2 keeps the channels split: no gather, two pairs
        counts = traced_step_counts_for(strategy, split, x[:8], y[:8], from_logits=False)
        assert counts == {"tp_all_reduce": 2 + 1, "tp_all_gather": 0, "tp_scatter": 0}


def test_run_eagerly_trains_like_one_device():
    x, y = data(32)

    def fit(strategy):
        with strategy.scope() if strategy else _nothing():
            model = mlp()
            model.compile(optimizer=keras.optimizers.SGD(0.1), run_eagerly=True,
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        return weights_by_layer(model)

    reference, split = fit(None), fit(strategy_for((1, 2)))
    for name, values in reference.items():
        for ref, got in zip(values, split[name]):
            assert np.abs(ref - got).max() < 1e-5, name
