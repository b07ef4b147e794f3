"""Reading the model `tfdist plan --model` is given: the file checked before TensorFlow starts, custom objects
imported, Keras' load errors turned into one line that says what to pass, and its optimizer's state per
parameter."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import zipfile

from tfdist.errors import ConfigError

__all__ = ["check_model_file", "import_custom_objects", "load_model", "saved_optimizer_config",
           "state_bytes_per_param", "dtype_bytes"]

LEGACY_SUFFIXES = (".h5", ".hdf5")


def check_model_file(path: str) -> None:
    """Refuses, without TensorFlow, a path that is not a Keras model file: missing, a directory, or not the zip
    archive with a config.json that `model.save("m.keras")` writes (legacy .h5 files pass to Keras as they are)."""
    if not os.path.exists(path):
        raise ConfigError(f"--model: no file {path!r}.")
    if os.path.isdir(path):
        raise ConfigError(f"--model: {path!r} is a directory (a SavedModel?); give a .keras file: load the model "
                          "and save it with model.save('model.keras').")
    if path.lower().endswith(LEGACY_SUFFIXES):
        return
    try:
        with zipfile.ZipFile(path) as archive:
            json.loads(archive.read("config.json"))
    except (zipfile.BadZipFile, KeyError, json.JSONDecodeError, UnicodeDecodeError):
        raise ConfigError(f"--model: {path!r} is not a Keras model file (a .keras archive holding config.json, "
                          "as model.save('model.keras') writes).") from None


def saved_optimizer_config(path: str) -> dict | None:
    """The optimizer a .keras file was compiled with, read from its config.json (no weights loaded)."""
    try:
        with zipfile.ZipFile(path) as archive:
            config = json.loads(archive.read("config.json"))
    except (KeyError, zipfile.BadZipFile, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return (config.get("compile_config") or {}).get("optimizer")


def import_custom_objects(spec: str | None) -> None:
    """Imports a Python file or module whose classes are registered with
    `@keras.saving.register_keras_serializable()`, so that loading finds them."""
    if not spec:
        return
    try:
        if spec.endswith(".py") or os.path.sep in spec:
            if not os.path.isfile(spec):
                raise ConfigError(f"--custom-objects: no file {spec!r}.")
            name = os.path.splitext(os.path.basename(spec))[0]
            module_spec = importlib.util.spec_from_file_location(name, spec)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module
            module_spec.loader.exec_module(module)
        else:
            importlib.import_module(spec)
    except ConfigError:
        raise
    except Exception as err:  # the user's code: say which file failed and how, in one line
        raise ConfigError(f"--custom-objects: importing {spec!r} failed: {type(err).__name__}: {err}") from None


def load_model(path: str, custom_objects: str | None = None):
    """keras.models.load_model(path, compile=False), with a missing custom class explained."""
    import keras

    import_custom_objects(custom_objects)
    try:
        return keras.models.load_model(path, compile=False)
    except (TypeError, ValueError) as err:
        text = str(err)
        if "Could not locate" in text or "custom_objects" in text or "Unknown" in text:
            first = text.strip().splitlines()[0]
            raise ConfigError(f"--model: {path!r} uses a class Keras does not know ({first}). Put the class in a "
                              "file, decorate it with @keras.saving.register_keras_serializable(), and pass "
                              "--custom-objects that_file.py.") from None
        raise ConfigError(f"--model: Keras cannot load {path!r}: {text.strip().splitlines()[0]}") from None


def state_bytes_per_param(optimizer, variable_dtype: str = "float32") -> tuple[str, float]:
    """Measured: build the optimizer on a small variable of `variable_dtype` and count its per-element state
    (Keras' slots take their variable's dtype)."""
    import keras

    probe = keras.Variable(keras.ops.zeros((1000,), dtype=variable_dtype), name="probe")
    optimizer.build([probe])
    total = sum(1000 * dtype_bytes(v.dtype) for v in optimizer.variables if tuple(v.shape) == (1000,))
    return type(optimizer).__name__, total / 1000


def dtype_bytes(dtype) -> int:
    """Bytes per element of a dtype or its name ('bfloat16' included, which NumPy alone does not name)."""
    import numpy as np

    name = str(getattr(dtype, "name", dtype))
    return 2 if name == "bfloat16" else np.dtype(name).itemsize
