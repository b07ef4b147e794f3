"""tfdist.MirroredStrategy: synchronous data parallelism over this process's devices."""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from tfdist._compat import distribute as tf_distribute
from tfdist.comm import cross_device_ops_from
from tfdist.data_parallel._grad_path import with_gradient_path
from tfdist.data_parallel.input_reuse import ReusedInputIterators
from tfdist.devices import resolve_devices
from tfdist.strategies.data_parallel import DataParallel
from tfdist.zero.collectives import LocalCollectives

__all__ = ["MirroredStrategy"]


class MirroredStrategy(ReusedInputIterators, DataParallel, tf.distribute.MirroredStrategy):
    """Synchronous data parallelism over the local devices, for the ordinary Keras 3 path.

    A drop-in `tf.distribute.MirroredStrategy` for several devices in one process. It takes every local GPU, or
    else every logical CPU, when `devices` is None (stock TF takes only CPU:0 without GPUs), checks `devices`
    against the machine, has its own collective keys (several strategies can live in one process), shards the
    optimizer state, gradients and parameters with `zero_stage=1|2|3`, and keeps one input iterator per distributed
    dataset, rewound for each epoch.

    Args:
        devices: device names such as `['/gpu:0', '/gpu:1']`, or None for all local devices.
        cross_device_ops: None (TF's collective all-reduce), a `tf.distribute.CrossDeviceOps`, or
            one of 'collective', 'reduce_to_one', 'hierarchical_copy', 'nccl'.
        zero_stage: 0 (every replica holds all optimizer state), 1 (each replica holds 1/N of it), 2 (and its 1/N
            of the summed gradient) or 3 (and 1/N of the parameters, gathered per layer: FSDP).
        offload: with zero_stage > 0, keep the owned optimizer shards (and run their update) in
            host memory instead of on the replica's device.
        reuse_input_iterators: True (default): each distributed dataset keeps one iterator, rewound per pass, and
            runs without tf.data autotuning unless its options set `autotune.enabled`; False: TF's behaviour.
        bucket_cap_mb: None (default: a step's gradients all-reduced together after the whole backward) or a size in
            MB (PyTorch DDP uses 25): gradients all-reduced in buckets, each as soon as it is full; zero_stage 0 only.
        fsdp_unit_bytes: zero_stage 3: a layer whose weights (its sublayers' included) total at most this many
            bytes is gathered as one unit; None (default): every layer that owns weights is its own unit.
        reshard_after_forward: zero_stage 3: True (default) frees each unit's gathered parameters after its
            forward and gathers them again for its backward; False keeps them (less traffic, more memory).
        fsdp_prefetch: zero_stage 3: issue each unit's all-gather when the unit before it starts (default
            False: when its own inputs exist, which holds fewer gathered units at once).
        grad_dtype: None (default: gradients summed across replicas in their own dtype, float32 under Keras'
            mixed policies) or 'bfloat16' / 'float16' / 'float32': cast to it for the sum and back after (half the
            bytes per step in 16 bits); at every zero_stage (ZeRO reduce-scatters in it).

    Example:
        >>> import keras, numpy as np, tfdist
        >>> tfdist.devices.virtual_cpus(4)          # before TensorFlow initialises
        >>> strategy = tfdist.MirroredStrategy()
        >>> with strategy.scope():
        ...     model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        ...     model.compile(optimizer="sgd", loss="mse")
        >>> model.fit(np.ones((64, 8)), np.ones((64, 1)), batch_size=16, verbose=0)

    Guide: docs/mirrored.md.
    """

    zero_stages = (0, 1, 2, 3)  # stage 3 (parameters sharded too) runs in one process so far

    def __init__(
        self,
        devices: Sequence[str] | None = None,
        cross_device_ops: tf.distribute.CrossDeviceOps | str | None = None,
        zero_stage: int = 0,
        offload: bool = False,
        reuse_input_iterators: bool = True,
        bucket_cap_mb: float | None = None,
        fsdp_unit_bytes: int | None = None,
        reshard_after_forward: bool = True,
        fsdp_prefetch: bool = False,
        grad_dtype: str | tf.DType | None = None,
    ):
        self._check_zero_options(zero_stage, offload, fsdp_unit_bytes, reshard_after_forward, fsdp_prefetch)
        bucket_cap_mb = self._check_bucket_cap(bucket_cap_mb)
        self._check_grad_dtype(grad_dtype)
        self.reuse_input_iterators = bool(reuse_input_iterators)
        devices, ops = resolve_devices(devices), cross_device_ops_from(cross_device_ops)
        extended = with_gradient_path(tf_distribute.MirroredExtended)
        tf_distribute.init_strategy(self, lambda: extended(self, devices=devices, cross_device_ops=ops))
        self._register_sharding(lambda: LocalCollectives(self.extended.worker_devices))
        self._attach_gradient_path(bucket_cap_mb)
