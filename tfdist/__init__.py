"""tfdist: custom tf.distribute strategies for Keras 3 — Horovod, ZeRO, layer placement, multi-worker fit.

Every strategy works through the ordinary Keras path:

    import tfdist
    tfdist.devices.virtual_cpus(4)                 # a machine without GPUs: 4 logical CPUs
    strategy = tfdist.MirroredStrategy()
    data = tfdist.data.mnist(global_batch_size=64, strategy=strategy)
    with strategy.scope():
        model = tfdist.models.cnn()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(data.train, validation_data=data.test, epochs=3)

Names are imported on first use, so `import tfdist` (and the `tfdist` command's --help) does not
start TensorFlow. In a notebook, TensorFlow's C++ start-up lines are hidden unless TF_CPP_MIN_LOG_LEVEL is set
(0 shows them all).
"""

from __future__ import annotations

from tfdist.errors import ConfigError, InitOrderError, TfdistError
from tfdist.lazy import exports
from tfdist.tf_logs import quiet_in_notebooks

quiet_in_notebooks()  # a notebook's cells store their outputs, not TensorFlow's start-up lines (tf_logs says how)

__version__ = "0.1.0"

# public name -> module that defines it (a module name maps to itself)
_LAZY = {
    "MirroredStrategy": "tfdist.strategies.mirrored",
    "HorovodStrategy": "tfdist.strategies.horovod",
    "LayerPlacementStrategy": "tfdist.strategies.layer_placement",
    "MultiWorkerMirroredStrategy": "tfdist.strategies.multi_worker",
    "ParameterServerStrategy": "tfdist.strategies.parameter_server",
    "ModelParallelStrategy": "tfdist.strategies.model_parallel.strategy",
    "DeviceMesh": "tfdist.tensor_parallel.mesh",
    "LayoutMap": "tfdist.tensor_parallel.layout_map",
    "auto_strategy": "tfdist.strategies.auto",
    "enable_keras_distribution": "tfdist.keras_distribution.front",
    "cluster": "tfdist.cluster",
    "pipeline": "tfdist.pipeline",
    "tensor_parallel": "tfdist.tensor_parallel",
    "keras_distribution": "tfdist.keras_distribution",
    "data": "tfdist.data",
    "devices": "tfdist.devices",
    "models": "tfdist.models",
    "zero": "tfdist.zero",
    "training": "tfdist.training",
    "comm": "tfdist.comm",
    "strategies": "tfdist.strategies",
}

__all__ = ["ConfigError", "InitOrderError", "TfdistError", *_LAZY]

__getattr__, __dir__ = exports(__name__, _LAZY)
