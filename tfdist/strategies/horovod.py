"""tfdist.HorovodStrategy: Horovod's ring all-reduce under Keras 3 `model.fit`, one or more devices per process."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from tfdist import compat
from tfdist.comm.horovod import CPU_FUSION_THRESHOLD_MB, HorovodAllReduce, check_options, init_horovod
from tfdist.errors import ConfigError
from tfdist.sharding import zero
from tfdist.sharding.memory import MemoryReport, memory_report

__all__ = ["HorovodStrategy", "launched_by"]

log = logging.getLogger(__name__)

# Environment variables that each launcher sets in every rank (first match names the launcher).
_LAUNCHER_ENV = {
    "HOROVOD_RANK": "horovodrun --gloo / tfdist launch --backend horovod",
    "OMPI_COMM_WORLD_RANK": "mpirun (OpenMPI) / horovodrun --mpi",
    "PMI_RANK": "mpirun (MPICH) / srun",
    "PMIX_RANK": "srun --mpi=pmix",
}


def launched_by() -> str | None:
    """Names the launcher that started this process, or None for a plain `python script.py`."""
    for var, name in _LAUNCHER_ENV.items():
        if var in os.environ:
            return name
    return None


def _default_local_devices(local_rank: int) -> list[str]:
    # TFDIST_LOCAL_DEVICES=M (set by `tfdist launch --devices-per-worker M`): M replicas per process.
    # GPUs follow Horovod's convention (process `local_rank` takes its own GPUs); on CPU the process
    # splits its CPU into M logical devices.
    raw = os.environ.get("TFDIST_LOCAL_DEVICES", "1")
    try:
        m = int(raw)
        assert m >= 1
    except (ValueError, AssertionError):
        raise ConfigError(f"TFDIST_LOCAL_DEVICES must be a whole number >= 1, got {raw!r}.") from None
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        first = local_rank * m
        if first + m > len(gpus):
            raise ConfigError(f"local rank {local_rank} wants GPUs {first}..{first + m - 1} "
                              f"({m} per process) but this host has {len(gpus)}.")
        return [f"/gpu:{i}" for i in range(first, first + m)]
    if m == 1:
        return ["/cpu:0"]
    from tfdist.devices import virtual_cpus

    return virtual_cpus(m)


class HorovodStrategy(tf.distribute.MirroredStrategy):
    """Data parallelism across processes with Horovod, for the ordinary Keras 3 path.

    A MirroredStrategy over this process's devices whose cross-device ops reduce over the local
    devices, then across processes with one fused Horovod all-reduce per step. Replicas = processes
    x local devices, and `num_replicas_in_sync` is that global count (Keras divides the loss by it).
    Run one process per GPU (or per CPU socket) under `horovodrun`, `mpirun`, `srun` or
    `tfdist launch --backend horovod`; a plain `python script.py` is a one-process job.

    What it adds to MirroredStrategy:
    - every variable is broadcast from rank 0 when it is created (same initial weights everywhere),
      after an all-gather of its shape/dtype signature: ranks that build different models get a
      ConfigError naming the variable, not a hang;
    - `experimental_distribute_dataset` / `distribute_datasets_from_function` shard the input by
      (size, rank): `fit` on the same dataset in every rank gives each rank its own slice of every
      global batch (use a global batch size, as with any strategy);
    - `strategy.reduce` and Keras' epoch-end metrics are reduced across processes (metric states
      are summed over all ranks, so `History` and `evaluate` report global values on every rank).
      These are collectives: call them on every rank, never in a rank-0-only branch.

    Args:
        local_devices: this process's devices, or None: its own GPU(s) (by local rank), else the
            CPU (or TFDIST_LOCAL_DEVICES logical CPUs).
        compression: None, 'fp16' or 'bf16' (gradients travel in that type).
        fusion_threshold_mb: Horovod's fusion buffer size (HOROVOD_FUSION_THRESHOLD if set, else 1 MB
            with the MPI controller on CPU-only hosts, where fusion's copies cost more than they save
            for big gradients; Horovod's default with Gloo, whose TCP messages are dear, and on GPUs).
        op: 'average' (default; the usual data-parallel mean gradient), 'sum' or 'adasum' (MPI only).
        require_launcher: raise ConfigError when no launcher started this process (default: run as
            a one-process job).
        zero_stage: 0 (plain data parallel), 1 (optimizer state sharded across all replicas of all
            processes: each rank keeps 1/N of it) or 2 (gradients reduce-scattered too), as in
            `tfdist.MirroredStrategy`. The shards move with `hvd.alltoall` (+ a local sum) / `hvd.allgather`
            (tfdist.comm.horovod_shards). Saving a model or checkpoint gathers the full optimizer state:
            with zero_stage > 0 every rank must take part (tfdist.cluster.ModelCheckpoint,
            BackupAndRestore and `tfdist.cluster.save_model` do that; a bare `model.save` on rank 0
            alone is refused with a ConfigError instead of hanging).
        offload: keep the owned optimizer shards in host memory (needs zero_stage 1 or 2).

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

    ZeRO (each of the 2 ranks keeps half of Adam's state; `tfdist train --strategy horovod --zero-stage 2`):
        >>> strategy = tfdist.HorovodStrategy(zero_stage=2)
        >>> with strategy.scope():
        ...     model = tfdist.models.cnn()
        ...     model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        >>> model.fit(data.train, epochs=3, verbose=0)
        >>> print(strategy.memory_report(model))          # this rank's bytes, read from the variables
        >>> tfdist.cluster.save_model(model, "cnn.keras")  # on every rank: gathers; rank 0 writes
    """

    def __init__(
        self,
        local_devices: Sequence[str] | None = None,
        compression: str | None = None,
        fusion_threshold_mb: float | None = None,
        op: str = "average",
        require_launcher: bool = False,
        zero_stage: int = 0,
        offload: bool = False,
    ):
        check_options(compression, op)
        self.zero_stage, self.offload = zero.check_options(zero_stage, offload)
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
        hvd = init_horovod(fusion_threshold_mb, explicit=explicit)
        self.rank, self.size = hvd.rank(), hvd.size()
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()
        if op == "adasum":
            if not hvd.mpi_enabled():
                raise ConfigError("op='adasum': Horovod's Adasum runs on its MPI controller; this job uses Gloo. "
                                  "Launch with mpirun or `horovodrun --mpi`, or use op='average'.")
            if self.size & (self.size - 1):
                raise ConfigError(f"op='adasum' needs a power-of-2 number of processes, got {self.size}.")
        if local_devices is None:
            devices = _default_local_devices(self.local_rank)
        else:
            from tfdist.devices import resolve_devices

            devices = resolve_devices(local_devices, parameter="local_devices")
        if launched_by() is None and self.size == 1:
            log.info("HorovodStrategy: no launcher found; running as a one-process job over %s.", devices)
        self._collective_key_base = compat.fresh_collective_key_base()
        ops = HorovodAllReduce(self.size, self.size * len(devices), compression=compression, op=op)
        tf.distribute.Strategy.__init__(self, _HorovodExtended(self, devices, ops, hvd))
        self.compression, self.op = compression, op
        self._zero = None
        if self.zero_stage:
            from tfdist.comm.horovod_shards import HorovodShardCollectives

            comm = HorovodShardCollectives(self.extended.worker_devices, self.rank, self.size)
            self._zero = zero.ZeroConfig(self.zero_stage, offload, comm)
        zero.enable()  # also gives stage 0 a clear error for an optimizer created outside the scope

    def _tfdist_zero_config(self) -> zero.ZeroConfig | None:
        # Read by the optimizer build hook (tfdist.sharding.zero) to decide whether to shard.
        return self._zero

    def memory_report(self, model) -> MemoryReport:
        """This process's per-replica bytes of parameters, gradients and optimizer state of `model`.

        Read from the devices and shapes of the variables (and of the gradient tensors the traced
        step keeps), next to the ZeRO formula values for all `num_replicas_in_sync` replicas.
        Call it after the optimizer is built (after the first `fit` step).
        """
        return memory_report(self, model)

    @property
    def is_chief(self) -> bool:
        """True on rank 0: the process that should print, save models and write checkpoints."""
        return self.rank == 0

    def __repr__(self) -> str:
        return (f"HorovodStrategy(rank={self.rank}, size={self.size}, local_devices={self.extended.worker_devices}, "
                f"compression={self.compression!r}, op={self.op!r}"
                + (f", zero_stage={self.zero_stage}" if self.zero_stage else "") + ")")


class _HorovodExtended(compat.mirrored_extended_class()):
    """MirroredExtended that counts replicas of every process and reduces through Horovod."""

    def __init__(self, container_strategy, devices: list[str], ops: HorovodAllReduce, hvd):
        self._hvd = hvd
        self._rank, self._size = hvd.rank(), hvd.size()
        self._created = 0  # variables created so far, for the cross-rank signature check
        super().__init__(container_strategy, devices=devices, cross_device_ops=ops)

    # -- replicas: global count, global ids ----------------------------------------------------------
    @property
    def _num_replicas_in_sync(self) -> int:
        return len(self._devices) * self._size

    def _get_replica_id_in_sync_group(self, replica_id: int) -> int:
        return self._rank * len(self._devices) + replica_id

    def _get_local_replica_id(self, replica_id_in_sync_group: int) -> int:
        return replica_id_in_sync_group - self._rank * len(self._devices)

    def _in_multi_worker_mode(self) -> bool:
        return self._size > 1

    # -- reductions: everything through Horovod -------------------------------------------------------
    def _get_cross_device_ops(self, value):
        return self._cross_device_ops  # every dtype, every destination: Horovod spans the processes

    def _use_merge_call(self) -> bool:
        # One device per process (Horovod's usual layout): replicas reduce right where they run, with
        # no merge_call. That is what lets an all-reduce sit inside tf.cond, as Keras 3's
        # gradient_accumulation_steps needs (it reduces only on update steps). Several local devices
        # need merge_call to meet in one thread first (as in stock MirroredStrategy).
        return len(self._devices) > 1

    def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
        if self._use_merge_call():
            return super()._replica_ctx_all_reduce(reduce_op, value, options)
        flat = tf.nest.flatten(value)
        return tf.nest.pack_sequence_as(value, self._cross_device_ops.replica_all_reduce(reduce_op, flat))

    def _reduce_to(self, reduce_op, value, destinations, options):
        # MirroredExtended sends reductions to a CPU destination (metrics, strategy.reduce) through a
        # local ReductionToOneDevice; here they go through Horovod too, so they span every process.
        if compat.is_mirrored(value) and reduce_op == tf.distribute.ReduceOp.MEAN:
            return value

        def one(v):
            if not isinstance(v, tf.distribute.DistributedValues):
                if self._size == 1:
                    return compat.reduce_non_distributed_value(reduce_op, v, destinations, len(self._devices))
                # As in MultiWorkerMirroredStrategy, a plain value is this process's contribution
                # (tf.data uses a SUM of one to agree across workers on whether data is left).
                v = tf.convert_to_tensor(v)
            return self._cross_device_ops.reduce(reduce_op, v, destinations=destinations)

        return tf.nest.map_structure(one, value)

    # -- input: each process reads its own shard ------------------------------------------------------
    def _experimental_distribute_dataset(self, dataset, options):
        return compat.distribute_dataset_for_worker(self, dataset, options, self._size, self._rank)

    def _distribute_datasets_from_function(self, dataset_fn, options):
        return compat.distribute_datasets_from_function_for_worker(self, dataset_fn, options, self._size,
                                                                   self._rank)

    def _experimental_distribute_values_from_function(self, value_fn):
        n = len(self._devices)
        return compat.regroup_per_replica([
            value_fn(tf.distribute.experimental.ValueContext(self._rank * n + i, self._num_replicas_in_sync))
            for i in range(n)])

    # -- variables: identical start on every rank -----------------------------------------------------
    def _create_variable(self, next_creator, **kwargs):
        var = super()._create_variable(next_creator, **kwargs)
        if self._size > 1:
            self._sync_new_variable(var)
        return var

    def _sync_new_variable(self, var) -> None:
        """Checks that every rank creates the same variable, then copies rank 0's value to all ranks."""
        hvd = self._hvd
        index = self._created
        self._created += 1
        with tf.init_scope():
            if not tf.executing_eagerly():
                return  # TF1-style graph building: nothing to run now
            shape = var.shape.as_list() if var.shape.rank is not None else []
            signature = _signature(index, shape, var.dtype)
            gathered = hvd.allgather(tf.constant(signature[None, :])).numpy()
            if not (gathered == signature[None, :]).all():
                raise ConfigError(_mismatch_message(index, var, gathered))
            if compat.is_mirrored(var):  # metric states (sync on read) start at zero everywhere already
                var.assign(hvd.broadcast(tf.convert_to_tensor(compat.local_values(var)[0]), root_rank=0))


_MAX_DIMS = 8


def _signature(index: int, shape: list, dtype: tf.DType) -> np.ndarray:
    # [hash, index, ndims, dims (padded), dtype]: equal on every rank iff the k-th variable agrees.
    dims = [-1 if d is None else int(d) for d in shape][:_MAX_DIMS]
    text = f"{index}|{shape}|{dtype.name}".encode()
    digest = int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "little")
    return np.array([digest, index, len(shape), *dims, *([-2] * (_MAX_DIMS - len(dims))), dtype.as_datatype_enum],
                    dtype=np.int64)


def _mismatch_message(index: int, var, gathered: np.ndarray) -> str:
    per_rank = []
    for rank, row in enumerate(gathered):
        ndims = int(row[2])
        per_rank.append(f"rank {rank}: shape {tuple(int(d) for d in row[3:3 + min(ndims, _MAX_DIMS)])} "
                        f"{tf.as_dtype(int(row[-1])).name}")
    return (f"HorovodStrategy: the ranks are building different models. Variable #{index} "
            f"(here {var.name}) differs: {'; '.join(per_rank)}. Every rank must build the same model "
            "(same layers, same order) inside strategy.scope().")
