"""TensorFlow's own cross-device reductions, chosen by a short name or passed through."""

from __future__ import annotations

import tensorflow as tf

from tfdist.errors import ConfigError

# Short names users can pass instead of building the object. NCCL is GPU-only (no CPU kernel).
_BY_NAME = {
    "collective": None,  # TF's default: CollectiveAllReduce (RING on CPU, NCCL on GPUs)
    "reduce_to_one": tf.distribute.ReductionToOneDevice,
    "hierarchical_copy": tf.distribute.HierarchicalCopyAllReduce,
    "nccl": tf.distribute.NcclAllReduce,
}


def cross_device_ops_from(value: tf.distribute.CrossDeviceOps | str | None) -> tf.distribute.CrossDeviceOps | None:
    """Returns a CrossDeviceOps for `value`: None (TF's default), an instance, or a short name.

    Short names: 'collective' (default), 'reduce_to_one', 'hierarchical_copy', 'nccl' (GPUs only).
    """
    if value is None or isinstance(value, tf.distribute.CrossDeviceOps):
        return value
    if isinstance(value, str) and value in _BY_NAME:
        factory = _BY_NAME[value]
        return factory() if factory else None
    raise ConfigError(
        f"cross_device_ops must be None, a tf.distribute.CrossDeviceOps, or one of "
        f"{sorted(_BY_NAME)}; got {value!r}."
    )
