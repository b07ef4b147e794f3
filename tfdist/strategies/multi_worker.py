"""tfdist.MultiWorkerMirroredStrategy: synchronous data parallelism over N processes x M local devices."""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from tfdist._compat import distribute as tf_distribute
from tfdist.comm.launch_env import local_device_count, local_process
from tfdist.comm.peers import cluster_config_of
from tfdist.comm.runtime import join_tf_job
from tfdist.comm.tf_config import ClusterConfig
from tfdist.data_parallel._fused_flags import with_step_flags
from tfdist.data_parallel._grad_path import with_gradient_path
from tfdist.data_parallel.input_reuse import ReusedInputIterators
from tfdist.data_parallel.uneven import check_mode
from tfdist.devices import kind_and_indices, process_devices
from tfdist.errors import ConfigError, check_seconds
from tfdist.strategies.data_parallel import DataParallel
from tfdist.zero.collectives import LocalCollectives

__all__ = ["MultiWorkerMirroredStrategy"]

_COMMUNICATION = {
    "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
    "ring": tf.distribute.experimental.CommunicationImplementation.RING,
    "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
}


class MultiWorkerMirroredStrategy(ReusedInputIterators, DataParallel, tf.distribute.MultiWorkerMirroredStrategy):
    """Synchronous data parallelism across processes (TF_CONFIG), for the ordinary Keras 3 path.

    A `tf.distribute.MultiWorkerMirroredStrategy` under which Keras 3 `fit`/`evaluate`/`predict` work with 2+
    workers, with M local devices per worker (N workers x M devices give N*M replicas), a checked TF_CONFIG, and
    every wait bounded by `timeout_s` (a peer that never starts or is lost is named in the error). Create it first
    thing in the program, before any TensorFlow op; start the workers with `tfdist launch -n N -- python train.py`.

    Args:
        cluster_resolver: a `tf.distribute.cluster_resolver.ClusterResolver`; None reads TF_CONFIG.
        local_devices: devices per worker: None (TFDIST_LOCAL_DEVICES, else the configured logical
            CPUs or all GPUs), a count M, or names such as ['/cpu:0', '/cpu:1'] / ['/gpu:0'].
        communication: 'auto', 'ring' or 'nccl' (GPUs).
        timeout_s: seconds to wait for peers at start-up and for any one collective.
        heartbeat_s: seconds of silence after which a peer counts as dead (default: min(timeout_s, 20)).
        zero_stage: 0 (every replica holds all optimizer state), 1 (each of the N*M replicas holds 1/(N*M) of it),
            2 (and of the summed gradient) or 3 (and of the parameters: FSDP); every worker takes part in a save.
        offload: with zero_stage > 0, keep the owned optimizer shards (and run their update) in the
            worker's host memory instead of on the replica's device.
        uneven_data: 'stop' (default: every worker ends the epoch where the shortest worker's data ends) or
            'join' (workers without data take steps with empty batches until every worker's data ends).
        reuse_input_iterators: True (default): each distributed dataset keeps one input iterator, rewound per
            pass, as in `tfdist.MirroredStrategy`; False: TF's behaviour (a new iterator per epoch and validation).
        bucket_cap_mb: None (default: one all-reduce after the whole backward) or a size in MB (DDP: 25):
            gradients all-reduced in buckets, each as soon as its gradients exist; zero_stage 0 only.
        fsdp_unit_bytes, reshard_after_forward, fsdp_prefetch: zero_stage 3's options, as in
            `tfdist.MirroredStrategy` (wrap policy, keep gathered parameters until the backward, prefetch).
        ring_piece_mb: None (default) or a size in MB (2 suits 1 Gbit/s links): inside a tf.function, ring all-reduces
            of at least twice this size run as a chain of all-reduces of about this size (slow links; costs CPU).
        grad_dtype: None (default: gradients summed across replicas in their own dtype, float32 under Keras'
            mixed policies) or 'bfloat16' / 'float16' / 'float32': cast to it for the sum and back after (half the
            bytes per step in 16 bits); at every zero_stage (ZeRO reduce-scatters in it).

    Example:
        >>> # train.py, run with: tfdist launch -n 2 -- python train.py
        >>> import keras, tfdist
        >>> strategy = tfdist.MultiWorkerMirroredStrategy()
        >>> data = tfdist.data.mnist(global_batch_size=64, strategy=strategy)
        >>> with strategy.scope():
        ...     model = tfdist.models.cnn()
        ...     model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        >>> model.fit(data.train, epochs=2, verbose=1 if tfdist.cluster.is_chief(strategy) else 0)

    Guide: docs/multi-worker.md.
    """

    zero_stages = (0, 1, 2, 3)  # stage 3: parameter pieces on the N*M replicas, gathered across workers

    def __init__(
        self,
        cluster_resolver: tf.distribute.cluster_resolver.ClusterResolver | None = None,
        local_devices: int | Sequence[str] | None = None,
        communication: str = "auto",
        timeout_s: float = 60.0,
        heartbeat_s: float | None = None,
        zero_stage: int = 0,
        offload: bool = False,
        uneven_data: str = "stop",
        reuse_input_iterators: bool = True,
        bucket_cap_mb: float | None = None,
        fsdp_unit_bytes: int | None = None,
        reshard_after_forward: bool = True,
        fsdp_prefetch: bool = False,
        ring_piece_mb: float | None = None,
        grad_dtype: str | tf.DType | None = None,
    ):
        ring_piece_bytes = _check_ring_piece(ring_piece_mb)
        self._check_zero_options(zero_stage, offload, fsdp_unit_bytes, reshard_after_forward, fsdp_prefetch)
        bucket_cap_mb = self._check_bucket_cap(bucket_cap_mb)
        self._check_grad_dtype(grad_dtype)
        check_mode(uneven_data)
        self.reuse_input_iterators = bool(reuse_input_iterators)
        if communication not in _COMMUNICATION:
            raise ConfigError(f"communication must be one of {sorted(_COMMUNICATION)}, got {communication!r}.")
        self.timeout_s = check_seconds(timeout_s, "timeout_s")
        config = self._cluster_config = cluster_config_of(cluster_resolver)
        if local_devices is None:
            local_devices = local_device_count()  # from `tfdist launch --devices-per-worker M`
        kind, indices = kind_and_indices(process_devices(local_devices, parameter="local_devices",
                                                         local=local_process()))
        options = tf.distribute.experimental.CommunicationOptions(
            implementation=_COMMUNICATION[communication], timeout_seconds=self.timeout_s)
        extended = with_gradient_path(with_step_flags(tf_distribute.CollectiveExtended))
        join_tf_job(config, lambda: tf_distribute.init_strategy(
                        self, lambda: extended(self, cluster_resolver, options, kind, indices, ring_piece_bytes)),
                    timeout_s=self.timeout_s, heartbeat_s=heartbeat_s, who="tfdist.MultiWorkerMirroredStrategy must be created",
                    fix="Create the strategy first thing in the script; in a notebook, run the workers as "
                        "subprocesses (tfdist launch).")
        self._register_sharding(self._shard_collectives, host_device=self._host_device())
        self._attach_uneven_data(uneven_data, fused=True)  # TF sums the gradients' float32 pack exactly
        self._attach_gradient_path(bucket_cap_mb)  # the flags ride along with the first float32 bucket (not 16-bit)

    @property
    def cluster_config(self) -> ClusterConfig | None:
        """The checked TF_CONFIG this worker runs under (None for a single local worker)."""
        return self._cluster_config

    def reduce(self, reduce_op, value, axis):
        """`tf.distribute.Strategy.reduce`, also over nested structures, with `axis` ignored for scalars.

        Keras 3 calls `reduce("MEAN", (x, y), axis=None)` and `reduce("MEAN", scalar, axis=0)` when it
        detects multi-worker MWMS; both are meaningful (per-element reduce; a scalar has no axis to
        concatenate, so the mean over replicas is the answer) but stock MWMS raises on them.
        """
        parent = super()

        def one(v):
            return parent.reduce(reduce_op, v, None if axis is not None and _rank(v) == 0 else axis)

        return tf.nest.map_structure(one, value)

    def _shard_collectives(self):
        if tf_distribute.strategy_task(self)[2] > 1:
            from tfdist.zero.tf_collectives import TFShardCollectives

            return TFShardCollectives(self, timeout_s=self.timeout_s)
        return LocalCollectives(list(self.extended.worker_devices))  # one worker: plain device copies


def _check_ring_piece(ring_piece_mb: float | None) -> int | None:
    if ring_piece_mb is None:
        return None
    if isinstance(ring_piece_mb, bool) or not isinstance(ring_piece_mb, (int, float)) or not ring_piece_mb >= 0.25:
        raise ConfigError(f"ring_piece_mb must be None (whole all-reduces) or a size in MB >= 0.25 (2 suits 1 Gbit/s "
                          f"links), got {ring_piece_mb!r}.")
    return int(ring_piece_mb * 2**20)


def _rank(value) -> int | None:
    if isinstance(value, tf.distribute.DistributedValues):
        value = value.values[0]
    shape = getattr(value, "shape", None)
    if shape is None:
        return 0 if isinstance(value, (int, float)) else None
    return len(shape) if not hasattr(shape, "rank") else shape.rank
