"""tfdist.MirroredStrategy: synchronous data parallelism over this process's devices."""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from tfdist import compat
from tfdist.comm import cross_device_ops_from
from tfdist.devices import resolve_devices

__all__ = ["MirroredStrategy"]


class MirroredStrategy(tf.distribute.MirroredStrategy):
    """Synchronous data parallelism over the local devices, for the ordinary Keras 3 path.

    A drop-in `tf.distribute.MirroredStrategy` that also:
    - uses every local GPU, or else every logical CPU, when `devices` is None (stock TF takes only
      CPU:0 on a machine without GPUs), so `tfdist.devices.virtual_cpus(n)` gives n replicas;
    - checks `devices` against the machine and says which devices exist when one does not;
    - gets its own collective keys, so several strategies over different device sets can live in
      one process (a notebook, a test session) without joining each other's groups.

    Args:
        devices: device names such as `['/gpu:0', '/gpu:1']`, or None for all local devices.
        cross_device_ops: None (TF's collective all-reduce), a `tf.distribute.CrossDeviceOps`, or
            one of 'collective', 'reduce_to_one', 'hierarchical_copy', 'nccl'.

    Example:
        >>> import keras, numpy as np, tfdist
        >>> tfdist.devices.virtual_cpus(4)          # before TensorFlow initialises
        >>> strategy = tfdist.MirroredStrategy()
        >>> strategy.num_replicas_in_sync
        4
        >>> with strategy.scope():
        ...     model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        ...     model.compile(optimizer="sgd", loss="mse")
        >>> model.fit(np.ones((64, 8)), np.ones((64, 1)), batch_size=16, verbose=0)
    """

    def __init__(
        self,
        devices: Sequence[str] | None = None,
        cross_device_ops: tf.distribute.CrossDeviceOps | str | None = None,
    ):
        self._collective_key_base = compat.fresh_collective_key_base()
        super().__init__(devices=resolve_devices(devices), cross_device_ops=cross_device_ops_from(cross_device_ops))
