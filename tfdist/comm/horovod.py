"""Horovod as a tf.distribute CrossDeviceOps: local devices first, then a fused all-reduce across processes."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import tensorflow as tf

from tfdist._compat import distribute as tf_distribute
from tfdist.comm.wire import sum_bf16_by_gather
from tfdist.errors import ConfigError, troubleshooting

__all__ = ["HorovodAllReduce", "horovod", "init_horovod", "INSTALL_HINT", "COMPRESSIONS", "OPS"]

INSTALL_HINT = (
    "Horovod is not installed in this Python. Build it against the installed TensorFlow with "
    "`tfdist build-horovod` (GPU clusters: `tfdist build-horovod --gpu`), or from a tfdist checkout: "
    "`make horovod`. It needs cmake, g++ and OpenMPI (Debian: apt-get install cmake g++ openmpi-bin libopenmpi-dev)."
    + troubleshooting("horovod-is-missing-or-does-not-build")
)
COMPRESSIONS = {None: None, "none": None, "fp16": tf.float16, "bf16": tf.bfloat16}
OPS = ("average", "sum", "adasum")


def horovod():
    """Returns the `horovod.tensorflow` module, or raises ImportError with the install command."""
    try:
        import horovod.tensorflow as hvd
    except ImportError as err:
        raise ImportError(f"{INSTALL_HINT} (import failed: {err})") from err
    return hvd


# Fusion buffer default on CPU-only hosts. Horovod fuses tensors by copying them into a buffer and
# back out (two memcpys); on CPUs (shared memory, TCP) those copies cost more than the fusion saves
# for big gradients, so only small gradients are fused (up to 1 MB). GPUs and the Gloo controller
# (per-message TCP cost) keep Horovod's default. The measurements are in docs/design.md.
CPU_FUSION_THRESHOLD_MB = 1.0


def init_horovod(fusion_threshold_mb: float | None = None, *, explicit: bool = True,
                 cycle_time_ms: float | None = None, dynamic_process_sets: bool = False,
                 stall_timeout_s: float | None = None):
    """Initialises Horovod once per process and returns `horovod.tensorflow`: the one place tfdist calls
    `hvd.init()` (HorovodStrategy, a mesh over Horovod ranks and `tfdist.comm.init` all come here).

    `fusion_threshold_mb` sets HOROVOD_FUSION_THRESHOLD (the size of Horovod's fusion buffer: small
    gradients travel together in one all-reduce up to this size); `cycle_time_ms` sets HOROVOD_CYCLE_TIME
    (how long Horovod's background thread waits between rounds of negotiation: a lower value lets a small
    all-reduce start sooner, at the price of an idle thread that wakes up more often). Both are read by
    `hvd.init()`, so they only apply to the first initialisation in a process; a different explicit value
    later raises (`fusion_threshold_mb` when `explicit`, `cycle_time_ms` whenever given).

    `dynamic_process_sets` lets process sets be added later (`hvd.add_process_set`: groups of `tfdist.comm`, a
    mesh's rows); `stall_timeout_s` sets HOROVOD_STALL_SHUTDOWN_TIME_SECONDS (unless the environment does), so a
    collective some rank never joins ends Horovod with an error instead of hanging. Both apply only when this
    call initialises Horovod.
    """
    if fusion_threshold_mb is not None and fusion_threshold_mb < 0:
        raise ConfigError(f"fusion_threshold_mb must be >= 0 (0 turns fusion off), got {fusion_threshold_mb!r}.")
    if cycle_time_ms is not None and (isinstance(cycle_time_ms, bool) or not isinstance(cycle_time_ms, (int, float))
                                      or not math.isfinite(cycle_time_ms) or cycle_time_ms < 0):
        raise ConfigError(f"cycle_time_ms must be a number >= 0 (Horovod's default is 1 ms), got {cycle_time_ms!r}.")
    hvd = horovod()  # after the checks: a bad value is a ConfigError even where Horovod is missing
    settings = {}  # environment variable -> (parameter, value given, wanted text, checked when initialised)
    if fusion_threshold_mb is not None:
        settings["HOROVOD_FUSION_THRESHOLD"] = ("fusion_threshold_mb", fusion_threshold_mb,
                                                str(int(fusion_threshold_mb * 1024 * 1024)), explicit)
    if cycle_time_ms is not None:
        settings["HOROVOD_CYCLE_TIME"] = ("cycle_time_ms", cycle_time_ms, f"{cycle_time_ms:g}", True)
    if hvd.is_initialized():
        for var, (name, given, wanted, checked) in settings.items():
            have = os.environ.get(var)
            if checked and not _same_setting(have, wanted):
                raise ConfigError(
                    f"{name}={given}: Horovod is already initialised in this process with {var}="
                    f"{have or 'its default'}; it is fixed at hvd.init(). Create the first HorovodStrategy "
                    "with this value, or restart the process."
                )
        return hvd
    for var, (_, _, wanted, _) in settings.items():
        os.environ[var] = wanted
    if stall_timeout_s is not None:
        os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", str(max(1, int(stall_timeout_s))))
        os.environ.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", str(max(1, int(min(stall_timeout_s / 2, 60)))))
    if dynamic_process_sets:
        hvd.init(process_sets="dynamic")
    else:
        hvd.init()
    return hvd


def _same_setting(have: str | None, wanted: str) -> bool:
    """Whether an environment value Horovod read equals ours as numbers ("1.0" from horovodrun is "1")."""
    try:
        return have is not None and float(have) == float(wanted)
    except ValueError:
        return False


def check_options(compression: str | None, op: str) -> None:
    """Raises ConfigError for an unknown compression or reduction op name."""
    if compression not in COMPRESSIONS:
        raise ConfigError(f"compression must be None, 'fp16' or 'bf16', got {compression!r}.")
    if op not in OPS:
        raise ConfigError(f"op must be one of {list(OPS)}, got {op!r}.")


class HorovodAllReduce(tf_distribute.ProcessCrossDeviceOps):
    """Reduces over this process's devices, then across processes with one grouped Horovod all-reduce.

    Keras 3 hands every gradient of a step to `batch_reduce` at once (SUM; the loss is already divided
    by the global number of replicas), so the cross-process part is a single
    `hvd.grouped_allreduce` that Horovod fuses into buffers of HOROVOD_FUSION_THRESHOLD bytes.

    Args:
        num_processes: Horovod's size. Reported to TF as the number of between-graph workers, so TF
            never short-circuits a reduction with one local value into a copy.
        compression: None, 'fp16' or 'bf16': floating tensors travel in that type and are cast back.
        op: how gradients combine across replicas: 'average' (the data-parallel mean, what Keras
            expects), 'sum' (the sum of every replica's gradient: num_replicas x the mean) or 'adasum'
            (Horovod's Adasum across processes; needs an MPI build and a power-of-2 process count).

    Example:
        >>> hvd = init_horovod()
        >>> ops = HorovodAllReduce(num_processes=hvd.size(), num_replicas=hvd.size(), compression="fp16")
        >>> # tfdist.HorovodStrategy builds this and reports the global replica count to Keras.
    """

    def __init__(self, num_processes: int, num_replicas: int, compression: str | None = None, op: str = "average"):
        super().__init__()
        check_options(compression, op)
        self._hvd = horovod()
        self.num_processes = num_processes  # reported to TF as between-graph workers (see the base class)
        self._num_replicas = num_replicas  # global replicas: processes x local devices
        self._wire_dtype = COMPRESSIONS[compression]
        self.op = op
        self.compression = compression

    # -- the cross-process part ------------------------------------------------------------------
    def _allreduce(self, tensors: list[tf.Tensor], reduce_op: tf.distribute.ReduceOp, local_count: int,
                   compress: bool = True):
        """All-reduces local sums across processes. Returns reduced tensors in their own dtype."""
        hvd = self._hvd
        mean = reduce_op == tf.distribute.ReduceOp.MEAN
        if self.num_processes == 1:
            return [t / local_count if mean and t.dtype.is_floating else t for t in tensors]
        prescale, postscale, hvd_op = 1.0, 1.0, hvd.Sum
        if mean:  # average of all replicas' values: sum everywhere, divide once by the global count
            postscale = 1.0 / (local_count * self.num_processes)
        elif self.op == "sum":  # Keras divided the loss by num_replicas; undo it to sum raw gradients
            postscale = float(self._num_replicas)
        elif self.op == "adasum":  # Adasum wants each process's own mean gradient, not a 1/N share
            prescale, hvd_op = float(self.num_processes), hvd.Adasum
        floats = [t.dtype.is_floating for t in tensors]
        if not all(floats):  # integers: exact sum (a count, a step), no scaling or compression
            ints = [i for i, f in enumerate(floats) if not f]
            out = list(tensors)
            for i, r in zip(ints, hvd.grouped_allreduce([tensors[i] for i in ints], op=hvd.Sum)):
                out[i] = r // (local_count * self.num_processes) if mean else r
            rest = [i for i, f in enumerate(floats) if f]
            if rest:
                for i, r in zip(rest, self._allreduce([tensors[i] for i in rest], reduce_op, local_count, compress)):
                    out[i] = r
            return out
        wire_dtype = self._wire_dtype if compress else None
        if any(t.dtype == tf.bfloat16 for t in tensors) and hvd_op is not hvd.Adasum:
            wire_dtype = tf.bfloat16  # already bf16 (the 'bf16' comm hook): Horovod has no bf16 all-reduce
        if wire_dtype == tf.bfloat16 and hvd_op is not hvd.Adasum:
            return self._bf16_allgather_sum(tensors, prescale * postscale)
        wire = [tf.cast(t, wire_dtype) if wire_dtype is not None and t.dtype.is_floating else t for t in tensors]
        reduced = hvd.grouped_allreduce(wire, op=hvd_op, prescale_factor=prescale, postscale_factor=postscale)
        return [tf.cast(r, t.dtype) if r.dtype != t.dtype else r for r, t in zip(reduced, tensors)]

    def _bf16_allgather_sum(self, tensors: list[tf.Tensor], scale: float) -> list[tf.Tensor]:
        """bf16 on the wire, summed in float32 (`comm.wire.sum_bf16_by_gather`: Horovod has no bf16 all-reduce;
        fp16 moves fewer bytes beyond 4 processes)."""
        summed = sum_bf16_by_gather(self._hvd.allgather, tensors, self.num_processes)
        return [tf.cast(s * scale if scale != 1.0 else s, t.dtype) for s, t in zip(summed, tensors)]

    # -- CrossDeviceOps hooks ----------------------------------------------------------------------
    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        # Single reductions are metrics, losses and strategy.reduce: exact, never compressed.
        return self._reduce(reduce_op, [(per_replica_value, destinations)], compress=False)[0]

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        del options  # Horovod's own settings (fusion, cycle time) apply
        # Keras 3 sends a step's gradients here, all at once: compression applies.
        return self._reduce(reduce_op, value_destination_pairs, compress=True)

    def replica_all_reduce(self, reduce_op, tensors: list) -> list[tf.Tensor]:
        """All-reduce from inside the replica (one device per process): no merge_call, compressed.

        This is the path of a training step's gradients when each process has one device.
        """
        return self._reduce_local_sums(list(tensors), reduce_op, local_count=1, compress=True)

    def _reduce_local_sums(self, tensors: list, reduce_op, local_count: int, compress: bool) -> list:
        """`_allreduce` for this process's sums, except lookups (`tf.IndexedSlices`), which are all-gathered as
        slices (`_allgather_slices`)."""
        sliced = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices) and self.op != "adasum"]
        dense = [i for i in range(len(tensors)) if i not in sliced]
        out = [None] * len(tensors)
        for i, r in zip(dense, self._allreduce([tf.convert_to_tensor(tensors[i]) for i in dense], reduce_op,
                                               local_count, compress) if dense else []):
            out[i] = r
        for i in sliced:
            out[i] = self._allgather_slices(tensors[i], reduce_op, local_count)
        return out

    def _allgather_slices(self, slices: tf.IndexedSlices, reduce_op, local_count: int) -> tf.IndexedSlices:
        """Every process's slices, concatenated in rank order, as stock tf.distribute all-reduces IndexedSlices (and
        Horovod's own optimizer without `sparse_as_dense`): Keras' optimizers then square or sum each lookup's
        slice as they do on one device. Uncompressed; scaled as `_allreduce` scales."""
        values, indices = slices.values, slices.indices
        if self.num_processes > 1:
            values = self._hvd.allgather(tf.identity(values, name="lookup_values"))
            indices = self._hvd.allgather(tf.identity(indices, name="lookup_indices"))
        if reduce_op == tf.distribute.ReduceOp.MEAN:
            values = values / tf.cast(local_count * self.num_processes, values.dtype)
        elif self.op == "sum" and self.num_processes > 1:
            values = values * tf.cast(self._num_replicas, values.dtype)
        return tf.IndexedSlices(values, indices, slices.dense_shape)

    def _reduce(self, reduce_op, value_destination_pairs, compress: bool):
        if not value_destination_pairs:
            return []
        first_device = tf_distribute.devices_of(value_destination_pairs[0][1])[0]
        local_counts = {len(tf_distribute.local_values(v)) for v, _ in value_destination_pairs}
        if len(local_counts) != 1:
            raise ConfigError(f"HorovodAllReduce: values have different numbers of local replicas {sorted(local_counts)}.")
        (local_count,) = local_counts
        with tf.device(first_device):
            local_sums = [_local_sum(tf_distribute.local_values(v)) for v, _ in value_destination_pairs]
            reduced = self._reduce_local_sums(local_sums, reduce_op, local_count, compress)
        return [self.broadcast(r, d) for r, (_, d) in zip(reduced, value_destination_pairs)]

    def gather_implementation(self, per_replica_value, destinations, axis):
        parts = tf_distribute.local_values(per_replica_value)
        device = tf_distribute.devices_of(destinations)[0]
        with tf.device(device):
            local = tf.concat([tf.identity(p) for p in parts], axis=axis)
            if self.num_processes > 1:
                # hvd.allgather concatenates along axis 0 (and allows different sizes there).
                perm = _axis_first(local.shape.rank, axis)
                gathered = self._hvd.allgather(tf.transpose(local, perm) if axis else local)
                local = tf.transpose(gathered, _inverse(perm)) if axis else gathered
        return self.broadcast(local, destinations)


def _local_sum(parts: Sequence):
    """This process's replicas' values summed; lookups (IndexedSlices) concatenated, in replica order."""
    if any(isinstance(p, tf.IndexedSlices) for p in parts):
        parts = [p if isinstance(p, tf.IndexedSlices) else tf.IndexedSlices(
            p, tf.range(tf.shape(p, out_type=tf.int64)[0]), tf.shape(p, out_type=tf.int64)) for p in parts]
        return tf.IndexedSlices(tf.concat([p.values for p in parts], 0),
                                tf.concat([tf.cast(p.indices, tf.int64) for p in parts], 0), parts[0].dense_shape)
    return tf.math.add_n([tf.identity(p) for p in parts]) if len(parts) > 1 else tf.identity(parts[0])


def _axis_first(rank: int, axis: int) -> list[int]:
    return [axis] + [i for i in range(rank) if i != axis]


def _inverse(perm: Sequence[int]) -> list[int]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv
