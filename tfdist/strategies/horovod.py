"""tfdist.HorovodStrategy: Horovod's ring all-reduce under Keras 3 `model.fit`, one or more devices per process."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import tensorflow as tf

from tfdist._compat import distribute as tf_distribute
from tfdist.comm import horovod_peers
from tfdist.comm.horovod import (
    CPU_FUSION_THRESHOLD_MB,
    HorovodAllReduce,
    check_options,
    init_horovod,
)
from tfdist.comm.horovod_group import HorovodGroup
from tfdist.comm.launch_env import launched_by, local_device_count, local_process
from tfdist.data_parallel._fused_flags import with_step_flags
from tfdist.data_parallel._grad_path import with_gradient_path
from tfdist.data_parallel.input_reuse import ReusedInputIterators
from tfdist.data_parallel.uneven import check_mode
from tfdist.devices import LocalProcess, process_devices
from tfdist.errors import ConfigError, check_seconds
from tfdist.strategies.data_parallel import DataParallel

__all__ = ["HorovodStrategy", "launched_by"]

log = logging.getLogger(__name__)


class HorovodStrategy(ReusedInputIterators, DataParallel, tf.distribute.MirroredStrategy):
    """Data parallelism across processes with Horovod, for the ordinary Keras 3 path.

    A MirroredStrategy over this process's devices whose gradients are summed over the local devices, then across
    processes with one fused Horovod all-reduce per step; `strategy.num_replicas_in_sync` counts every process's
    replicas. Variables start as rank 0's, the input is sharded by rank and metrics are global on every rank. Run one
    process per GPU (or CPU socket) under `horovodrun`, `mpirun`, `srun` or `tfdist launch --backend horovod`; a plain
    `python script.py` is a one-process job.

    Args:
        local_devices: this process's devices, or None: its own GPU(s) (by local rank), else the CPU (or
            TFDIST_LOCAL_DEVICES logical CPUs).
        compression: None, 'fp16' or 'bf16' (gradients travel in that type).
        fusion_threshold_mb: Horovod's fusion buffer in MB; None: HOROVOD_FUSION_THRESHOLD if set, else 1 MB with
            the MPI controller on CPU-only hosts, Horovod's default with Gloo and on GPUs.
        cycle_time_ms: HOROVOD_CYCLE_TIME, the pause between Horovod's negotiations (None: the variable if set, else
            Horovod's 1 ms); 0.1 makes small all-reduces faster, at a CPU cost on idle ranks.
        op: 'average' (default; the usual data-parallel mean gradient), 'sum' or 'adasum' (MPI only).
        require_launcher: raise ConfigError when no launcher started this process (default: run as
            a one-process job).
        zero_stage: 0 (plain data parallel), 1 (optimizer state sharded over all ranks' replicas), 2 (gradients
            too) or 3 (parameters too: FSDP), as in `tfdist.MirroredStrategy`; saves then need every rank.
        offload: keep the owned optimizer shards in host memory (needs zero_stage 1, 2 or 3).
        uneven_data: 'stop' (default: every rank ends the epoch where the shortest rank's data ends) or 'join'
            (ranks without data take steps with empty batches until every rank's data ends).
        reuse_input_iterators: True (default): each distributed dataset keeps one input iterator, rewound per
            pass, as in `tfdist.MirroredStrategy`; False: TF's behaviour (a new iterator per epoch and validation).
        bucket_cap_mb: None (default: one grouped Horovod all-reduce after the whole backward) or a size in MB
            (DDP: 25): gradients all-reduced in buckets, each as soon as its gradients exist; zero_stage 0 only.
        fsdp_unit_bytes, reshard_after_forward, fsdp_prefetch: zero_stage 3's options, as in
            `tfdist.MirroredStrategy` (wrap policy, keep gathered parameters until the backward, prefetch).
        save_timeout_s: with zero_stage > 0, how long a read of sharded state outside tfdist's savers (a save,
            `get_weights` at stage 3) waits for every rank to make the same read.
        grad_dtype: None (default: gradients summed across replicas in their own dtype, float32 under Keras'
            mixed policies) or 'bfloat16' / 'float16' / 'float32': cast to it for the sum and back after (half the
            bytes per step in 16 bits); at every zero_stage (ZeRO reduce-scatters in
            it); not with `compression` or op='adasum'.

    Example (run with `horovodrun -np 2 python train.py`):
        >>> import keras, tfdist
        >>> strategy = tfdist.HorovodStrategy()
        >>> data = tfdist.data.mnist(global_batch_size=64, strategy=strategy)
        >>> with strategy.scope():
        ...     model = tfdist.models.cnn()
        ...     model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        >>> model.fit(data.train, epochs=3, verbose=2 if strategy.is_chief else 0)
        >>> if strategy.is_chief:
        ...     model.save("cnn.keras")

    Guide: docs/horovod.md.
    """

    zero_stages = (0, 1, 2, 3)  # stage 3: parameter pieces on every rank's replicas, gathered with hvd.allgather

    def __init__(
        self,
        local_devices: Sequence[str] | None = None,
        compression: str | None = None,
        fusion_threshold_mb: float | None = None,
        op: str = "average",
        require_launcher: bool = False,
        zero_stage: int = 0,
        offload: bool = False,
        uneven_data: str = "stop",
        reuse_input_iterators: bool = True,
        bucket_cap_mb: float | None = None,
        fsdp_unit_bytes: int | None = None,
        reshard_after_forward: bool = True,
        fsdp_prefetch: bool = False,
        save_timeout_s: float = 60.0,
        cycle_time_ms: float | None = None,
        grad_dtype: str | tf.DType | None = None,
    ):
        check_options(compression, op)
        self.save_timeout_s = check_seconds(save_timeout_s, "save_timeout_s")
        self._check_zero_options(zero_stage, offload, fsdp_unit_bytes, reshard_after_forward, fsdp_prefetch)
        bucket_cap_mb = self._check_bucket_cap(bucket_cap_mb)
        self._check_grad_dtype(grad_dtype)
        if self.grad_dtype is not None and (compression is not None or op == "adasum"):
            raise ConfigError(f"grad_dtype={self.grad_dtype.name} needs HorovodStrategy(compression=None, op='average' "
                              f"or 'sum'); this one has compression={compression!r}, op={op!r}. grad_dtype is the "
                              "compression here: drop `compression` (Adasum's combination is not a sum).")
        check_mode(uneven_data)
        self.reuse_input_iterators = bool(reuse_input_iterators)
        if require_launcher and launched_by() is None:
            raise ConfigError(
                "HorovodStrategy(require_launcher=True): this process was not started by a Horovod/MPI "
                "launcher (no HOROVOD_RANK, OMPI_COMM_WORLD_RANK, PMI_RANK or PMIX_RANK). Start it with "
                "`horovodrun -np 2 python script.py`, `mpirun -np 2 python script.py` or "
                "`tfdist launch --backend horovod -n 2 -- python script.py`."
            )
        explicit = fusion_threshold_mb is not None
        gloo = os.environ.get("HOROVOD_CONTROLLER") == "gloo"  # Gloo (TCP) pays per message: keep big fusion
        if (not explicit and "HOROVOD_FUSION_THRESHOLD" not in os.environ and not gloo
                and not tf.config.list_physical_devices("GPU")):
            fusion_threshold_mb = CPU_FUSION_THRESHOLD_MB
        hvd = init_horovod(fusion_threshold_mb, explicit=explicit, cycle_time_ms=cycle_time_ms)
        group = HorovodGroup(hvd)
        self.rank, self.size = group.rank, group.size
        self.local_rank, self.local_size = group.local_rank, group.local_size
        if op == "adasum":
            if not group.mpi_enabled:
                raise ConfigError("op='adasum': Horovod's Adasum runs on its MPI controller; this job uses Gloo. "
                                  "Launch with mpirun or `horovodrun --mpi`, or use op='average'.")
            if self.size & (self.size - 1):
                raise ConfigError(f"op='adasum' needs a power-of-2 number of processes, got {self.size}.")
        # Default: TFDIST_LOCAL_DEVICES devices (else one) per process, GPUs by local rank as Horovod does.
        spec = local_devices if local_devices is not None else (local_device_count() or 1)
        local = LocalProcess(self.local_rank, self.local_size, local_process().own_devices)
        devices = process_devices(spec, parameter="local_devices", local=local)
        if launched_by() is None and self.size == 1:
            log.info("HorovodStrategy: no launcher found; running as a one-process job over %s.", devices)
        ops = HorovodAllReduce(self.size, self.size * len(devices), compression=compression, op=op)
        extended = with_gradient_path(with_step_flags(tf_distribute.MultiProcessExtended))
        tf_distribute.init_strategy(self, lambda: extended(self, devices, ops, group))
        self.compression, self.op = compression, op
        self._register_sharding(self._shard_collectives)
        # The flags ride along with the gradients only where their floats are summed exactly.
        self._attach_uneven_data(uneven_data, fused=op == "average" and compression is None)
        self._attach_gradient_path(bucket_cap_mb)
        if self.size > 1:  # after the local devices are set up: exchanging the peers starts TensorFlow
            horovod_peers.start(hvd)  # a lost rank is then named (rank, host, pid) when a collective fails

    def register_comm_hook(self, hook) -> None:
        """`DataParallel.register_comm_hook`; not with `compression` (the hook is the compression) nor with
        op='adasum' (a hook's `bucket.all_reduce` is a sum)."""
        if self.compression is not None or self.op == "adasum":
            raise ConfigError(f"register_comm_hook needs HorovodStrategy(compression=None, op='average' or 'sum'); "
                              f"this one has compression={self.compression!r}, op={self.op!r}. A hook compresses "
                              "the gradients itself: drop `compression` (e.g. use the 'fp16' hook instead).")
        super().register_comm_hook(hook)

    def _shard_collectives(self):
        from tfdist.zero.horovod_collectives import HorovodShardCollectives

        return HorovodShardCollectives(self.extended.worker_devices, self.rank, self.size, self.save_timeout_s)

    @property
    def is_chief(self) -> bool:
        """True on rank 0: the process that should print, save models and write checkpoints."""
        from tfdist.cluster.rank import is_chief

        return is_chief(self)

    def __repr__(self) -> str:
        return (f"HorovodStrategy(rank={self.rank}, size={self.size}, local_devices={self.extended.worker_devices}, "
                f"compression={self.compression!r}, op={self.op!r}"
                + (f", zero_stage={self.zero_stage}" if self.zero_stage else "")
                + f", uneven_data={self.uneven_data!r})")
