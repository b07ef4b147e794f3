"""The models and layouts of the tensor-parallel tests, shared by the pytest modules and the multi-process job
scripts, and the comparison with one device they make. Plain functions (no pytest), and keras is imported inside
each builder: a job script creates its strategy before TensorFlow starts, and only then builds models. Also the
mpirun start of the Horovod tests (pytest imported there only, for its skip)."""

from __future__ import annotations

import os

import numpy as np

import tfdist


def mlp(seed: int | None = None):
    """Two column/row pairs (Megatron's MLP block twice) and a replicated head; `seed`: Keras' seed first."""
    import keras

    if seed is not None:
        keras.utils.set_random_seed(seed)
    inputs = keras.Input((12,))
    x = keras.layers.Dense(32, activation="relu", name="up1")(inputs)
    x = keras.layers.Dense(16, activation="tanh", name="down1")(x)
    x = keras.layers.Dense(32, activation="relu", name="up2")(x)
    x = keras.layers.Dense(16, name="down2")(x)
    return keras.Model(inputs, keras.layers.Dense(5, name="head")(x))


def mlp_layout(mesh) -> tfdist.LayoutMap:
    layout_map = tfdist.LayoutMap(mesh)
    layout_map["up.*/kernel"] = (None, "model")
    layout_map["up.*/bias"] = ("model",)
    layout_map["down.*/kernel"] = ("model", None)
    return layout_map


def transformer_block(seed: int | None = None):
    """MultiHeadAttention + feed-forward + LayerNorm (a Transformer encoder block) and a small head."""
    import keras

    if seed is not None:
        keras.utils.set_random_seed(seed)
    inputs = keras.Input((6, 16))
    attention = keras.layers.MultiHeadAttention(num_heads=4, key_dim=8, name="mha")(inputs, inputs)
    x = keras.layers.LayerNormalization(name="ln1")(inputs + attention)
    h = keras.layers.Dense(32, activation="relu", name="ff_up")(x)
    h = keras.layers.Dense(16, name="ff_down")(h)
    x = keras.layers.LayerNormalization(name="ln2")(x + h)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, keras.layers.Dense(3, name="out")(x))


def transformer_layout(mesh) -> tfdist.LayoutMap:
    layout_map = tfdist.LayoutMap(mesh)
    layout_map["mha/(query|key|value)/kernel"] = (None, "model", None)  # heads split
    layout_map["mha/(query|key|value)/bias"] = ("model", None)
    layout_map["mha/attention_output/kernel"] = ("model", None, None)  # row-parallel over heads
    layout_map["ff_up/kernel"] = (None, "model")
    layout_map["ff_up/bias"] = ("model",)
    layout_map["ff_down/kernel"] = ("model", None)
    return layout_map


def cnn_layout(mesh) -> tfdist.LayoutMap:
    """tfdist.models.cnn's layers: conv1 output channels split, conv2 input channels (then the sum), dense pair."""
    layout_map = tfdist.LayoutMap(mesh)
    layout_map[".*conv1/kernel"] = (None, None, None, "model")
    layout_map[".*conv1/bias"] = ("model",)
    layout_map[".*conv2/kernel"] = (None, None, "model", None)
    layout_map[".*dense1/kernel"] = (None, "model")
    layout_map[".*dense1/bias"] = ("model",)
    layout_map[".*logits/kernel"] = ("model", None)
    return layout_map


def assert_equals_one_device(tag: str, got: dict, ref: dict, other: dict) -> None:
    """Logical weights by path of a split run (`got`, this process; `other`, another process) against one device
    (`ref`): processes bit-identical; SGD runs (tag containing "sgd") within 1e-5, others 1e-4 relative."""
    assert set(got) == set(ref), tag
    for path in got:
        np.testing.assert_array_equal(got[path], other[path], err_msg=f"{tag} {path}: processes differ")
        diff = float(np.max(np.abs(got[path] - ref[path])))
        if "sgd" in tag:
            assert diff <= 1e-5, (tag, path, diff)
        elif path == "mha/key/bias":
            # Softmax ignores a per-key constant: this bias's true gradient is 0 and what reaches it is rounding
            # noise, which Adam's m / sqrt(v) turns into +-lr steps (one device vs two differ by ~1e-4 there).
            assert np.max(np.abs(ref[path])) < 1e-3 and diff < 1e-3, (tag, path, diff)
        else:
            assert diff <= 1e-4 * max(float(np.max(np.abs(ref[path]))), 1e-3), (tag, path, diff)


def run_under_mpirun(job: str, args: list[str], env: dict, local_devices: int, timeout: float = 400):
    """`mpirun -np 2 python job *args` as Horovod's MPI controller sees it (OMPI_COMM_WORLD_RANK/SIZE, no HOROVOD_*
    variables, no TF_CONFIG), `local_devices` logical CPUs per rank; the finished process (skips without mpirun)."""
    import shutil
    import subprocess
    import sys

    import pytest

    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("OpenMPI's mpirun is not installed")
    env = {**env, "TFDIST_LOCAL_DEVICES": str(local_devices), "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    for var in ("HOROVOD_RANK", "HOROVOD_SIZE", "TF_CONFIG", "TFDIST_RANK"):
        env.pop(var, None)
    cmd = [mpirun, "-np", "2", "--oversubscribe", *[a for v in ("PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL",
                                                               "TFDIST_LOCAL_DEVICES") for a in ("-x", v)],
           sys.executable, job, *args]
    return subprocess.run(cmd, cwd=os.path.dirname(job), env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


def regression():
    """(x, y, model_fn): 48 samples of a linear target and a small Dense model with fixed initial weights, compiled
    with SGD and MSE. Four global batches of 12, which 1, 2, 3 or 4 replicas split evenly."""
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1)) + 0.1).astype("float32")

    def model_fn():
        model = keras.Sequential([
            keras.Input((8,)),
            keras.layers.Dense(16, activation="tanh", kernel_initializer=keras.initializers.GlorotUniform(1)),
            keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(2)),
        ])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        return model

    return x, y, model_fn
