"""Every reach into TensorFlow and Keras private internals, in one place, behind a version check."""

from __future__ import annotations

import itertools
import warnings

import keras
import tensorflow as tf

# Versions this module was written and tested against. A TF or Keras upgrade should only have to
# revisit this file: every `tensorflow.python.*` / `keras.src.*` import in tfdist lives here.
TESTED_TF = ("2.21",)
TESTED_KERAS_MAJOR = 3


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


if _major_minor(tf.__version__) not in TESTED_TF:
    warnings.warn(
        f"tfdist was tested with TensorFlow {', '.join(TESTED_TF)}; found {tf.__version__}. "
        "Private TF internals used by tfdist (tfdist/compat.py) may have moved.",
        RuntimeWarning,
        stacklevel=2,
    )
if int(keras.__version__.split(".")[0]) != TESTED_KERAS_MAJOR:
    raise ImportError(
        f"tfdist needs Keras 3 (the default tf.keras of TF 2.16+); found keras {keras.__version__}. "
        "Install it with: pip install 'keras>=3.15'"
    )


# --- Collective keys -------------------------------------------------------------------------
# MirroredExtended numbers its collective groups from `container_strategy._collective_key_base`.
# Every stock MirroredStrategy starts at 0, so two strategies over different device sets in one
# process join the same group and fail ("joining a group with size 2, but that group has size 4").
# Giving each tfdist strategy its own base keeps them apart (TF's own tests do the same).
_KEY_STRIDE = 100_000
_key_bases = itertools.count(start=_KEY_STRIDE, step=_KEY_STRIDE)


def fresh_collective_key_base() -> int:
    """Returns a collective key base no other tfdist strategy in this process uses."""
    return next(_key_bases)


# --- Keras fit state ---------------------------------------------------------------------------
def keras_initial_epoch(model) -> int:
    """The epoch `fit` starts from: Keras' BackupAndRestore sets the private `model._initial_epoch`
    when it restores a checkpoint (keras/src/callbacks/backup_and_restore.py, `_load_model`)."""
    return int(getattr(model, "_initial_epoch", 0) or 0)
