"""Pipeline parallelism: which layer runs on which stage (plans, balancing), micro-batches, one op stream per
stage, and the proof of where ops ran. `tfdist.LayerPlacementStrategy` and the stage axis of
`tfdist.ModelParallelStrategy` run on these pieces."""

from __future__ import annotations

from collections.abc import Callable

from tfdist.pipeline.plan import StagePlan, describe_model, make_plan

__all__ = ["StagePlan", "describe_model", "executed_devices", "layer_graph", "make_plan"]


def layer_graph(model) -> list[tuple]:
    """(layer, parent layers, input shapes, output shapes) for every layer of a built Keras model, in
    topological order (InputLayers left out; shapes with the batch dimension).

    Example:
        >>> [layer.name for layer, *_ in tfdist.pipeline.layer_graph(model)]
        ['conv2d', 'max_pooling2d', 'flatten', 'dense']
    """
    from tfdist._compat import keras_model

    return keras_model.layer_graph(model)


def executed_devices(fn: Callable[[], object]) -> dict[str, set[str]]:
    """Runs `fn()` once and returns node name -> the devices TensorFlow really ran it on (after placement).

    Call it on the first run of a tf.function (functions traced before are not reported): the proof
    that a layer's forward and backward ops ran on its stage.

    Example:
        >>> where = tfdist.pipeline.executed_devices(lambda: train_step(x, y))
        >>> {d for name, ds in where.items() if "dense_1" in name for d in ds}
        {'/job:localhost/replica:0/task:0/device:CPU:1'}
    """
    from tfdist._compat import tf_runtime

    return tf_runtime.executed_partition_devices(fn)
