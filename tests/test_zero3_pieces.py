"""ZeRO stage 3's per-piece update: optimizer state per parameter piece, no flat buffers, every option equal."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist

RNG = np.random.default_rng(5)
X = RNG.normal(size=(256, 8, 8, 1)).astype("float32")
Y = RNG.integers(0, 10, 256)
XD = RNG.normal(size=(64, 32)).astype("float32")
YD = RNG.integers(0, 10, 64)


def small_cnn():
    return tfdist.models.cnn((8, 8, 1), 10, filters=(4, 8), dense_units=16, seed=0)


def train(stage: int, optimizer=lambda: keras.optimizers.Adam(1e-2), steps: int = 8, offload: bool = False):
    strategy = tfdist.MirroredStrategy(tfdist.devices.virtual_cpus(4), zero_stage=stage, offload=offload)
    with strategy.scope():
        model = small_cnn()
        model.compile(optimizer=optimizer(), loss="sparse_categorical_crossentropy")
    model.fit(X, Y, batch_size=64, epochs=steps * 64 // len(X), shuffle=False, verbose=0)
    return strategy, model


def train_one_device(optimizer, steps: int = 8):
    """Plain Keras on one device with the same global batch: what data parallelism computes."""
    model = small_cnn()
    model.compile(optimizer=optimizer(), loss="sparse_categorical_crossentropy")
    model.fit(X, Y, batch_size=64, epochs=steps * 64 // len(X), shuffle=False, verbose=0)
    return model


def max_rel(a: list, b: list) -> float:
    assert len(a) == len(b)
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)), initial=0.0))
               / max(float(np.max(np.abs(x), initial=0.0)), 1e-12) for x, y in zip(a, b))


def canon(device: str) -> str:
    return tf.DeviceSpec.from_string(device).to_string()


def _slots(optimizer, name: str) -> list[np.ndarray]:
    return [np.asarray(v.numpy()) for v in optimizer.variables if v.path.endswith(name)]


# --- where the state lives ------------------------------------------------------------------------------
@pytest.mark.parametrize("offload", [False, True])
def test_each_slot_piece_is_shaped_and_placed_like_its_parameter_piece(offload):
    strategy, model = train(3, offload=offload, steps=4)
    engine = tfdist.zero.engine_of(model)
    state = engine.state
    assert state.names == ["momentum", "velocity"]
    assert engine.shard_params == []  # no flat parameter-shard buffer at stage 3
    host = canon(engine.config.host_device)
    for name in state.names:
        for i, device in enumerate(strategy.extended.worker_devices):
            slots = state.piece_variables(name, i)
            assert len(slots) == len(engine.params)
            for slot, param in zip(slots, engine.params):
                piece = param.components[i]
                assert tuple(slot.shape) == tuple(piece.shape) == (engine.layout.piece_sizes[engine.params.index(param)],)
                assert canon(slot.value.device) == (host if offload else canon(piece.device))
                assert canon(piece.device) == canon(device)  # the parameter piece stays on its replica
    # the update wrote the pieces in place: the shard optimizer's variables are the pieces' own
    assert all(ref.value is p.components[i] for i, row in enumerate(engine.piece_refs)
               for ref, p in zip(row, engine.params))
    # memory_report reads those variables: Adam's two slots, piece by piece, where they live
    rows = {row.device: row for row in strategy.memory_report(model).rows}
    slot_bytes = {}
    for name in state.names:
        for i in range(4):
            for v in state.piece_variables(name, i):
                d = canon(v.value.device)
                slot_bytes[d] = slot_bytes.get(d, 0) + int(np.prod(v.shape)) * 4
    for d, nbytes in slot_bytes.items():
        assert nbytes <= rows[d].optimizer_state <= nbytes + 64  # + mirrored scalars (iterations, lr)


def test_slot_reads_and_writes_go_through_the_pieces():
    _, model = train(3, steps=4)
    engine = tfdist.zero.engine_of(model)
    state, layout = engine.state, engine.layout
    for j, v in enumerate(model.trainable_variables):
        pieces = [state.piece_variables("momentum", i)[j].numpy() for i in range(4)]
        flat = np.concatenate(pieces)
        assert not np.any(flat[layout.sizes[j]:])  # the padding stays zero
        np.testing.assert_array_equal(state.read(j, "momentum").numpy(), flat[:layout.sizes[j]].reshape(v.shape))
    # a write (what a checkpoint restore does) scatters a full value into the pieces
    kernel = model.trainable_variables[0]
    value = np.arange(np.prod(kernel.shape), dtype="float32").reshape(kernel.shape)
    slot = next(s for s in model.optimizer.variables if s.path.endswith(f"{kernel.path.replace('/', '_')}_velocity"))
    slot.assign(value)
    k = layout.piece_sizes[0]
    for i in range(4):
        np.testing.assert_array_equal(state.piece_variables("velocity", i)[0].numpy(),
                                      np.pad(value.ravel(), (0, 4 * k - value.size))[i * k:(i + 1) * k])
    np.testing.assert_array_equal(slot.numpy(), value)


# --- no flat buffer in the step -------------------------------------------------------------------------
def _step_tensor_sizes(stage: int) -> tuple[list[int], object]:
    """Element counts of every tensor in a traced custom-loop step (4 replicas, Adam) of a 6-layer MLP."""
    strategy = tfdist.MirroredStrategy(tfdist.devices.virtual_cpus(4), zero_stage=stage)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((32,)), *[keras.layers.Dense(32, activation="tanh") for _ in range(6)],
                                  keras.layers.Dense(10)])
        optimizer = keras.optimizers.Adam(1e-2)
        optimizer.build(model.trainable_variables)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    @tf.function
    def step(x, y):
        def replica(x, y):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_fn(y, model(x, training=True)), global_batch_size=64)
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
            return loss
        return strategy.reduce("SUM", strategy.run(replica, args=(x, y)), axis=None)

    data = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((XD, YD)).batch(64))
    x, y = next(iter(data))
    graph = step.get_concrete_function(x, y).graph
    step(x, y)
    sizes = []
    for op in graph.get_operations():
        for t in op.outputs:
            if t.shape.is_fully_defined():
                sizes.append(int(np.prod(t.shape.as_list(), dtype=np.int64)))
    return sizes, tfdist.zero.engine_of(optimizer)


def test_a_stage3_step_builds_no_flat_gradient_or_parameter_shard():
    sizes3, engine = _step_tensor_sizes(3)
    layout = engine.layout
    # Each Dense layer is one unit (kernel, bias): all-gathered together, padded to 4 pieces each.
    largest_unit = max(4 * (layout.piece_sizes[j] + layout.piece_sizes[j + 1]) for j in range(0, 14, 2))
    # The largest tensors of the step are whole units (gathered weights, their full gradient before the
    # reduce-scatter), never a replica's flat shard (the sum of its pieces, 1667 here) or the model (6666).
    assert largest_unit < layout.shard_size < layout.total
    assert max(sizes3) <= largest_unit
    assert engine.layout.shard_size not in sizes3
    # The check sees flat buffers where they exist: stage 2 concatenates every gradient into one.
    sizes2, engine2 = _step_tensor_sizes(2)
    assert max(sizes2) >= engine2.layout.total


# --- every option, piece by piece ------------------------------------------------------------------------
OPTIMIZERS = {
    "adamw_schedule_exclusions": lambda: _adamw(),
    "sgd_momentum_nesterov": lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.05, 5, 0.5), momentum=0.9, nesterov=True),
    "rmsprop_centered": lambda: keras.optimizers.RMSprop(1e-3, momentum=0.5, centered=True),
    "adagrad": lambda: keras.optimizers.Adagrad(0.05, initial_accumulator_value=0.2),
    "lion": lambda: keras.optimizers.Lion(1e-3),
    "ftrl": lambda: keras.optimizers.Ftrl(0.05, l1_regularization_strength=0.01),
}


def _adamw():
    opt = keras.optimizers.AdamW(keras.optimizers.schedules.CosineDecay(1e-2, 10), weight_decay=0.1)
    opt.exclude_from_weight_decay(var_names=["bias"])
    return opt


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizers_at_stage3_match_stage0(name):
    (_, m0), (_, m3) = train(0, OPTIMIZERS[name]), train(3, OPTIMIZERS[name])
    assert max_rel(m0.get_weights(), m3.get_weights()) < 1e-4
    assert max_rel([np.asarray(v.numpy()) for v in m0.optimizer.variables],
                   [np.asarray(v.numpy()) for v in m3.optimizer.variables]) < 1e-3
    assert not np.allclose(m0.get_weights()[0], small_cnn().get_weights()[0])  # it did train


@pytest.mark.parametrize("clip", [{"global_clipnorm": 0.05}, {"clipnorm": 0.02}, {"clipvalue": 0.001}])
def test_clipping_at_stage3_uses_the_global_gradient(clip):
    tf.keras.utils.set_random_seed(0)
    ref = train_one_device(lambda: keras.optimizers.SGD(0.1, **clip))
    _, zero = train(3, lambda: keras.optimizers.SGD(0.1, **clip))
    assert max_rel(ref.get_weights(), zero.get_weights()) < 1e-4


def test_gradient_accumulation_accumulates_each_gradient_piece():
    opt = lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.05, gradient_accumulation_steps=2)  # noqa: E731
    ref = train_one_device(opt, steps=12)
    strategy, model = train(3, opt, steps=12)
    assert int(model.optimizer.iterations.numpy()) == 6  # updates, as Keras counts them
    assert max_rel(ref.get_weights(), model.get_weights()) < 1e-4
    engine = tfdist.zero.engine_of(model)
    accumulators = [engine.state.piece_variables("gradient_accumulator", i) for i in range(4)]
    for i, device in enumerate(strategy.extended.worker_devices):
        assert [tuple(a.shape) for a in accumulators[i]] == [tuple(p.components[i].shape) for p in engine.params]
        assert all(canon(a.value.device) == canon(device) for a in accumulators[i])
    assert not any(np.any(a.numpy()) for row in accumulators for a in row)  # emptied by the update
    assert [s.shape for s in _slots(model.optimizer, "gradient_accumulator")] == \
        [tuple(w.shape) for w in model.trainable_weights]  # checkpoints see Keras' own accumulators
    model.fit(X[:64], Y[:64], batch_size=64, epochs=1, shuffle=False, verbose=0)  # one more micro-step
    assert any(np.any(a.numpy()) for row in accumulators for a in row)


def test_ema_keeps_the_average_of_each_piece():
    opt = lambda: keras.optimizers.Adam(1e-2, use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=7)  # noqa: E731
    ref = train_one_device(opt, steps=16)
    _, model = train(3, opt, steps=16)
    # fit ends by writing the averages into the model; the overwrite every 7 steps changes the trajectory
    assert max_rel(ref.get_weights(), model.get_weights()) < 1e-4
    assert max_rel(_slots(ref.optimizer, "average"), _slots(model.optimizer, "average")) < 1e-4
    engine = tfdist.zero.engine_of(model)
    assert [tuple(a.shape) for a in engine.state.piece_variables("average", 1)] == \
        [tuple(p.components[1].shape) for p in engine.params]
