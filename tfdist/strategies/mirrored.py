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

    A drop-in `tf.distribute.MirroredStrategy` that also:
    - uses every local GPU, or else every logical CPU, when `devices` is None (stock TF takes only
      CPU:0 on a machine without GPUs), so `tfdist.devices.virtual_cpus(n)` gives n replicas;
    - checks `devices` against the machine and says which devices exist when one does not;
    - gets its own collective keys, so several strategies over different device sets can live in
      one process (a notebook, a test session) without joining each other's groups;
    - partitions the optimizer state (ZeRO stage 1) and the gradients (stage 2) across the replicas
      with `zero_stage`, for any element-wise Keras optimizer, with `model.compile`/`fit` unchanged.
      Checkpoints still hold the full logical optimizer state, loadable at any replica count and in
      plain Keras. Gradient clipping then uses the norms of the summed (global) gradient.
    - keeps one input iterator per distributed dataset and rewinds it for each epoch (`reuse_input_iterators`):
      stock MirroredStrategy builds a multi-device iterator per epoch and per validation, and tearing the old
      one down waits for tf.data's autotune threads — seconds-long first steps after each validation.
      One distributed dataset then has one iterator at a time (see `tfdist.data_parallel.input_reuse`).

    Args:
        devices: device names such as `['/gpu:0', '/gpu:1']`, or None for all local devices.
        cross_device_ops: None (TF's collective all-reduce), a `tf.distribute.CrossDeviceOps`, or
            one of 'collective', 'reduce_to_one', 'hierarchical_copy', 'nccl'.
        zero_stage: 0 (every replica holds all optimizer state), 1 (each replica holds 1/N of it,
            as flat even shards), 2 (and keeps only its 1/N of the summed gradient) or 3 (and 1/N of the
            parameters, gathered per layer for its forward and backward: FSDP; see docs/zero.md).
        offload: with zero_stage > 0, keep the owned optimizer shards (and run their update) in
            host memory instead of on the replica's device.
        reuse_input_iterators: True (default): distributed datasets keep one iterator, rewound per pass, and run
            their input pipelines without tf.data autotuning unless the dataset's options set
            `autotune.enabled`; False: TF's behaviour (a new iterator per pass).
        bucket_cap_mb: None (default: a step's gradients are all-reduced together after the whole backward) or
            a size in MB (PyTorch DDP uses 25): the gradients are all-reduced in buckets of that size, in reverse
            creation order, each as soon as its gradients exist, overlapping the rest of the backward.
            `register_comm_hook` compresses the buckets (fp16, bf16, PowerSGD). zero_stage 0 only.
        fsdp_unit_bytes: zero_stage 3: a layer whose weights (its sublayers' included) total at most this many
            bytes is gathered as one unit; None (default): every layer that owns weights is its own unit.
        reshard_after_forward: zero_stage 3: True (default) frees each unit's gathered parameters after its
            forward and gathers them again for its backward; False keeps them (less traffic, more memory).
        fsdp_prefetch: zero_stage 3: issue each unit's all-gather when the unit before it starts (default
            False: when its own inputs exist, which holds fewer gathered units at once).

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
        >>> zero = tfdist.MirroredStrategy(zero_stage=2)  # optimizer state and gradients sharded 4 ways
        >>> with zero.scope():
        ...     model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        ...     model.compile(optimizer="adam", loss="mse")
        >>> model.fit(np.ones((64, 8)), np.ones((64, 1)), batch_size=16, verbose=0)
        >>> print(zero.memory_report(model))             # bytes per replica, read from the variables
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
    ):
        self._check_zero_options(zero_stage, offload, fsdp_unit_bytes, reshard_after_forward, fsdp_prefetch)
        bucket_cap_mb = self._check_bucket_cap(bucket_cap_mb)
        self.reuse_input_iterators = bool(reuse_input_iterators)
        devices, ops = resolve_devices(devices), cross_device_ops_from(cross_device_ops)
        extended = with_gradient_path(tf_distribute.MirroredExtended)
        tf_distribute.init_strategy(self, lambda: extended(self, devices=devices, cross_device_ops=ops))
        self._register_sharding(lambda: LocalCollectives(self.extended.worker_devices))
        self._attach_gradient_path(bucket_cap_mb)
