"""Private: the reaches into TensorFlow and Keras internals, behind one version check.

A TF or Keras upgrade should only have to revisit the modules listed here. The shared ones live in this package:

- `distribute`: tf.distribute internals (StrategyExtended subclasses, collective keys and launchers,
  per-worker input pipelines);
- `ring`: MultiWorkerMirroredStrategy's collective launchers, subdivided or cut in pieces for slow links;
- `keras_optimizer`: Keras optimizer internals (variable index, gradient all-reduce, weight decay,
  the build hook that is active only inside a tfdist strategy's scope);
- `keras_model`: Keras model and variable internals (layer graph, initial epoch, the model a step
  belongs to, the backend variable behind a Keras variable);
- `captured_inputs`: tensors a `tf.custom_gradient` block reads by closure;
- `autograph`: AutoGraph's conversion rules, which exempt tfdist's own code as they exempt Keras';
- `tf_runtime`: the TF runtime (eager context, coordination service, call-time values in tf.function,
  run metadata, profiler protos, checkpoint tracking, graph ops, tf.data internals, per-thread
  strategy stacks, whether oneDNN is on).

A capability's own reaches sit in a private module of its package, each importing this package first (so the
version check runs before them):

- `comm._horovod_sets`: finding a Horovod process set registered earlier;
- `data_parallel._grad_path`, `data_parallel._no_sync`, `data_parallel._fused_flags`: a step's gradient
  all-reduce handed to buckets and hooks, accumulation instead of `apply`, numbers riding along with it;
- `data_parallel._sum_in_dtype`: a step's gradient reduction carried in another dtype, gradient by gradient;
- `data_parallel._uneven_input`, `data_parallel._rewinding_input`: distributed datasets for uneven per-rank data
  and one iterator rewound per pass;
- `zero.fsdp._keras`: a layer's own variables and per-instance call wrapping for stage 3;
- `tensor_parallel._keras_layers`, `tensor_parallel._tf_rows`: per-instance layer methods and logical views,
  and a mesh whose rows live in several processes;
- `parameter_server._tf_sharded`, `parameter_server._shard_init`, `parameter_server._shard_updates`: variables
  sharded over parameter servers, created and updated shard by shard on their servers;
- `keras_distribution._keras_api`: Keras' `set_distribution` handed to tfdist and the TensorFlow backend's missing
  `initialize`/`num_processes`/`process_id`, once `tfdist.enable_keras_distribution()` is called.

Nothing outside `tfdist` should import these. `tests/test_structure.py` checks that no other tfdist module
imports `tensorflow.python`/`keras.src`, reads another object's private attribute, or overrides a
private method of a TensorFlow or Keras class, and that this list is complete.
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

# tfdist's own code is never rewritten by AutoGraph (autograph.py says why): set once, before any trace.
from tfdist._compat.autograph import exempt_tfdist  # noqa: E402

exempt_tfdist()
