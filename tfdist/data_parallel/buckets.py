"""Gradient buckets: a step's gradients all-reduced in groups, each as soon as its gradients exist (as PyTorch DDP).

Keras 3 hands a step's gradients to one all-reduce after the whole backward; TF's collective then packs
them into one tensor, which cannot start before the last gradient (the first layer's) exists. Here the
gradients are grouped into buckets of about `cap_bytes`, in reverse creation order (the order the backward
produces them: the last layer's gradients first), and each bucket is one collective whose only inputs are
its own gradients. Inside the step's `tf.function` TF's executor runs an op as soon as its inputs are ready,
so the first buckets' all-reduces run while the backward computes the earlier layers' gradients
(tests/test_buckets.py reads that from TF's profiler trace).

A communication hook (`tfdist.data_parallel.comm_hooks`) can replace each bucket's plain all-reduce.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import tensorflow as tf

from tfdist.comm.sum_dtype import gradient_sum_dtype, summed_in
from tfdist.errors import ConfigError

__all__ = ["DEFAULT_BUCKET_CAP_MB", "GradBucket", "GradientPath", "plan_buckets"]

DEFAULT_BUCKET_CAP_MB = 25.0  # PyTorch DDP's bucket_cap_mb


def plan_buckets(sizes: Sequence[int], dtypes: Sequence[tf.DType], cap_bytes: int) -> list[list[int]]:
    """Indices of the gradients in each bucket, in the order the buckets are all-reduced.

    Gradients are taken in reverse creation order; a bucket holds one dtype and is closed once it holds at
    least `cap_bytes` (DDP's rule: a single tensor larger than the cap is a bucket of its own).

    Example:
        >>> plan_buckets([40, 400, 40, 8], [tf.float32] * 4, cap_bytes=100)
        [[3, 2], [1], [0]]
    """
    buckets: list[list[int]] = []
    open_by_dtype: dict[tf.DType, tuple[list[int], int]] = {}
    for i in reversed(range(len(sizes))):
        dtype = tf.as_dtype(dtypes[i])
        members, filled = open_by_dtype.get(dtype, (None, 0))
        if members is None:
            members = []
            buckets.append(members)
        members.append(i)
        filled += int(sizes[i]) * dtype.size
        open_by_dtype[dtype] = (None, 0) if filled >= cap_bytes else (members, filled)
    return buckets


@dataclasses.dataclass
class GradBucket:
    """One bucket of a step's gradients, as a communication hook sees it.

    Attributes:
        index: position of the bucket in the step (0 is all-reduced first: the last layers' gradients).
        buffers: one flat tensor per local replica (this process's devices): the bucket's gradients,
            concatenated.
        gradients: per local replica, the bucket's gradients in their own shapes (the same values).
        devices: the local replicas' devices.
        gradient_ids: positions of the bucket's gradients in the step's list of gradients (a stable key for
            per-gradient state such as PowerSGD's error feedback).
        num_replicas: replicas over the whole job.

    `all_reduce(tensors)` takes one tensor per local replica and returns their sum over every replica of the
    job, one per local replica. A hook returns the bucket's summed buffers, one per local replica.
    """

    index: int
    buffers: list[tf.Tensor]
    gradients: list[list[tf.Tensor]]
    devices: list[str]
    gradient_ids: list[int]
    num_replicas: int
    _all_reduce: Callable[[list], list] = dataclasses.field(repr=False, default=None)
    _count: Callable[[list], None] = dataclasses.field(repr=False, default=None)

    def all_reduce(self, tensors: list[tf.Tensor]) -> list[tf.Tensor]:
        """Sum over every replica of the job; `tensors`: one per local replica, same shape and dtype."""
        tensors = list(tensors)
        if len(tensors) != len(self.devices):
            raise ConfigError(f"GradBucket.all_reduce: expected one tensor per local replica ({len(self.devices)}), "
                              f"got {len(tensors)}.")
        self._count(tensors)
        return self._all_reduce(tensors)


class GradientPath:
    """Routes a step's gradient all-reduce through buckets and an optional communication hook.

    `strategy.gradient_path` is one of these once `bucket_cap_mb` is set or a hook is registered.
    `wire_bytes` / `gradient_bytes` are counted while the step is traced: bytes per replica handed to
    collectives for one step's gradients, and the gradients' own bytes (their ratio is the hook's cut).

    Example:
        >>> import tfdist
        >>> strategy = tfdist.MirroredStrategy(bucket_cap_mb=25)
        >>> strategy.gradient_path.cap_bytes
        26214400
    """

    def __init__(self, cap_mb: float | None, num_replicas: int, hook: Callable | None = None,
                 sum_dtype: tf.DType | None = None):
        # None: no cap, one bucket per dtype after the whole backward (how `grad_dtype` alone reduces)
        self.cap_bytes = None if cap_mb is None else int(cap_mb * 1024 * 1024)
        self.num_replicas = num_replicas
        self.hook = hook
        self.sum_dtype = sum_dtype  # without a hook: each bucket summed in this dtype (None: the gradients')
        self.wire_bytes = 0
        self.gradient_bytes = 0
        self.buckets: list[list[int]] = []

    def reduce(self, per_device: list[list[tf.Tensor]], devices: list[str], all_reduce) -> list[list[tf.Tensor]]:
        """The summed gradients, per local device (the `tfdist.data_parallel._grad_path.GradientRouter` contract)."""
        first = per_device[0]
        sizes = [int(g.shape.num_elements()) if g.shape.is_fully_defined() else -1 for g in first]
        if min(sizes) < 0:  # unknown shapes cannot be planned: one bucket
            plan = [list(reversed(range(len(first))))]
        else:
            cap = sum(sizes) * 8 + 1 if self.cap_bytes is None else self.cap_bytes
            plan = plan_buckets(sizes, [g.dtype for g in first], cap)
        self.buckets, self.wire_bytes = plan, 0
        self.gradient_bytes = sum(max(s, 0) * g.dtype.size for s, g in zip(sizes, first))
        out: list[list[tf.Tensor | None]] = [[None] * len(first) for _ in devices]
        for index, members in enumerate(plan):
            grads = [[per_device[d][i] for i in members] for d in range(len(devices))]
            buffers = []
            for d, device in enumerate(devices):
                with tf.device(device):
                    buffers.append(tf.concat([tf.reshape(g, [-1]) for g in grads[d]], axis=0))
            bucket = GradBucket(index, buffers, grads, list(devices), list(members), self.num_replicas,
                                _all_reduce=all_reduce, _count=self._count)
            summed = (self.hook(bucket) if self.hook is not None
                      else summed_in(gradient_sum_dtype(self.sum_dtype, "at zero_stage 0"), buffers,
                                     bucket.all_reduce, devices))
            summed = _checked(self.hook, bucket, summed)
            for d, device in enumerate(devices):
                with tf.device(device):
                    parts = tf.split(summed[d], tf.stack([tf.size(g) for g in grads[d]]), num=len(members))
                    for i, g, part in zip(members, grads[d], parts):
                        out[d][i] = tf.reshape(part, tf.shape(g))
        return out

    def _count(self, tensors: list[tf.Tensor]) -> None:
        t = tensors[0]
        if t.shape.is_fully_defined():
            self.wire_bytes += int(t.shape.num_elements()) * t.dtype.size


def _checked(hook, bucket: GradBucket, summed) -> list[tf.Tensor]:
    """A hook's result as one tensor per local replica, in the gradients' dtype; ConfigError naming the hook."""
    name = getattr(hook, "__name__", None) or type(hook).__name__
    expected = bucket.buffers[0].shape
    if not isinstance(summed, (list, tuple)) or len(summed) != len(bucket.buffers):
        raise ConfigError(
            f"communication hook {name!r} returned {type(summed).__name__} for bucket {bucket.index}; expected a "
            f"list of {len(bucket.buffers)} tensors (one per local replica), each of shape {expected.as_list()} "
            "like bucket.buffers. Return the summed buffers, e.g. bucket.all_reduce(bucket.buffers).")
    out = []
    for d, (s, b) in enumerate(zip(summed, bucket.buffers)):
        s = tf.convert_to_tensor(s)
        if s.shape.rank is not None and (s.shape.rank != 1 or not s.shape.is_compatible_with(b.shape)):
            raise ConfigError(
                f"communication hook {name!r} returned a tensor of shape {s.shape.as_list()} for bucket "
                f"{bucket.index} (replica {d}); expected shape {b.shape.as_list()}, the flat buffer of the bucket's "
                f"{len(bucket.gradient_ids)} gradients. Return one flat tensor per local replica, as long as "
                "bucket.buffers[i].")
        if not s.dtype.is_floating:
            raise ConfigError(f"communication hook {name!r} returned dtype {s.dtype.name} for bucket {bucket.index}; "
                              f"expected a floating tensor (it is cast back to {b.dtype.name}).")
        out.append(tf.cast(s, b.dtype) if s.dtype != b.dtype else s)
    return out
