"""Private: every reach into TensorFlow and Keras internals, behind one version check.

A TF or Keras upgrade should only have to revisit this package. It is split by what it reaches into:

- `distribute`: tf.distribute internals (StrategyExtended subclasses, collective keys and launchers,
  per-worker input pipelines);
- `keras_optimizer`: Keras optimizer internals (variable index, gradient all-reduce, weight decay,
  the build hook that is active only inside a tfdist strategy's scope);
- `keras_model`: Keras model and variable internals (layer graph, initial epoch, the model a step
  belongs to, the backend variable behind a Keras variable);
- `tf_runtime`: the TF runtime (eager context, coordination service, call-time values in tf.function,
  run metadata, profiler protos, checkpoint tracking, graph ops, tf.data internals, per-thread
  strategy stacks).

Nothing outside `tfdist` should import it. `tests/test_structure.py` checks that no other tfdist module
imports `tensorflow.python`/`keras.src`, reads another object's private attribute, or overrides a
private method of a TensorFlow or Keras class.
"""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf

# Versions these modules were written and tested against.
TESTED_TF = ("2.21",)
TESTED_KERAS_MAJOR = 3


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


if _major_minor(tf.__version__) not in TESTED_TF:
    warnings.warn(
        f"tfdist was tested with TensorFlow {', '.join(TESTED_TF)}; found {tf.__version__}. "
        "Private TF internals used by tfdist (tfdist/_compat/) may have moved.",
        RuntimeWarning,
        stacklevel=2,
    )
if int(keras.__version__.split(".")[0]) != TESTED_KERAS_MAJOR:
    raise ImportError(
        f"tfdist needs Keras 3 (the default tf.keras of TF 2.16+); found keras {keras.__version__}. "
        "Install it with: pip install 'keras>=3.15'"
    )
