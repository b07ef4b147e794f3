"""StrategyExtended internals: a step's gradient all-reduce handed to a router (buckets, communication hooks).

Keras 3 all-reduces a step's gradients with one `replica_context.all_reduce(SUM, grads)`. Across several
local devices that is a merge_call into `_batch_reduce_to` (all local replicas' values at once, in
cross-replica context); with one device per process (Horovod) it is `_replica_ctx_all_reduce` in the
replica. `with_gradient_path(ExtendedClass)` gives a StrategyExtended class that, while its
`gradient_router` is set and a step is open (`in_step()`, opened by the strategy's `run`), hands SUM
all-reduces of dense floating values to the router instead:

    router.reduce(per_device, devices, all_reduce) -> per_device results

`per_device[i]` is the list of values on local device i; `all_reduce(tensors)` takes one tensor per local
device and returns their sum over every replica of the job (one stock reduction of the class below, so
the collective, its ordering token and any step flags riding along are the stock ones). Everything else
(MEAN, integers, IndexedSlices, reductions outside a step, metrics) is untouched.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Protocol

import tensorflow as tf
from tensorflow.python.distribute import distribute_utils as _distribute_utils
from tensorflow.python.distribute import values as _values

from tfdist._compat.distribute import devices_of

__all__ = ["GradientRouter", "with_gradient_path"]

AllReduce = Callable[[list], list]


class GradientRouter(Protocol):
    def reduce(self, per_device: list[list[tf.Tensor]], devices: list[str], all_reduce: AllReduce
               ) -> list[list[tf.Tensor]]:
        """The summed values, per local device, in the order given."""


@functools.cache
def with_gradient_path(extended_class: type) -> type:
    """A subclass of `extended_class` (a MirroredExtended or CollectiveAllReduceExtended, or one of tfdist's)
    whose in-step SUM all-reduces of floating values go through its `gradient_router` (None: stock)."""

    class GradientPathExtended(extended_class):
        gradient_router: GradientRouter | None = None

        @contextlib.contextmanager
        def in_step(self) -> Iterator[None]:
            """Open around `strategy.run`: the reductions inside it are a training step's."""
            # A count on the extended, not per thread: MirroredStrategy runs each replica's fn in a thread
            # of its own and merge_calls in the caller's thread; the replicas wait for the call to return.
            self._tfdist_step_depth = getattr(self, "_tfdist_step_depth", 0) + 1
            try:
                yield
            finally:
                self._tfdist_step_depth -= 1

        def _routes(self, reduce_op, values: list) -> bool:
            if self.gradient_router is None or reduce_op != tf.distribute.ReduceOp.SUM or not values:
                return False
            if not getattr(self, "_tfdist_step_depth", 0):
                return False
            for v in values:
                parts = v.values if isinstance(v, tf.distribute.DistributedValues) else (v,)
                if isinstance(v, _values.Mirrored) or any(
                        isinstance(p, tf.IndexedSlices) or not tf.is_tensor(p) or not p.dtype.is_floating
                        for p in parts):
                    return False
            return True

        def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
            value_destination_pairs = [self._shared_as_per_replica(reduce_op, v, d) for v, d in value_destination_pairs]
            values = [v for v, _ in value_destination_pairs]
            # Routed: one component per local device (PerReplica; a plain tensor with one local device), reduced
            # onto those same devices (Keras passes each gradient as its own destination).
            if not self._routes(reduce_op, values) or not all(
                    len(_components(v)) == len(self.worker_devices) and (d is v or devices_of(d) == devices_of(v))
                    for v, d in value_destination_pairs):
                return super()._batch_reduce_to(reduce_op, value_destination_pairs, options)
            parent = super()

            def all_reduce(tensors: list) -> list:
                one = _distribute_utils.regroup(list(tensors), always_wrap=True)
                out = parent._batch_reduce_to(tf.distribute.ReduceOp.SUM, [(one, one)], options)[0]
                return list(out.values) if isinstance(out, tf.distribute.DistributedValues) else [out]

            devices = list(self.worker_devices)
            per_device = [[_components(v)[i] for v in values] for i in range(len(devices))]
            reduced = self.gradient_router.reduce(per_device, devices, all_reduce)
            return [_distribute_utils.regroup([reduced[i][j] for i in range(len(devices))], wrap_class=_values.Mirrored)
                    for j in range(len(values))]

        def _shared_as_per_replica(self, reduce_op, value, destination) -> tuple:
            """A gradient made outside the replica function reaches a step's sum as one tensor, the same on every
            replica, which TF's reduction refuses ("destinations can not be empty"). Its sum over the replicas is
            the tensor itself (TF's replica all-reduce of such a tensor returns it): as per-replica values, the
            tensor on the first device and zeros on the others, it is reduced like any gradient."""
            if (reduce_op != tf.distribute.ReduceOp.SUM or not getattr(self, "_tfdist_step_depth", 0)
                    or len(self.worker_devices) < 2 or isinstance(value, tf.distribute.DistributedValues)
                    or not tf.is_tensor(value) or isinstance(value, tf.IndexedSlices) or not value.dtype.is_floating):
                return value, destination
            parts = []
            for i, device in enumerate(self.worker_devices):
                with tf.device(device):
                    parts.append(tf.identity(value) if i == 0 else tf.zeros_like(value))
            per_replica = _distribute_utils.regroup(parts, always_wrap=True)
            # Its destination was the tensor itself, or that tensor's device ('' when it was made unplaced).
            mine = destination is value or (isinstance(destination, str) and destination in ("", value.device))
            return per_replica, per_replica if mine else destination

        def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
            if self._use_merge_call():
                return super()._replica_ctx_all_reduce(reduce_op, value, options)  # -> _batch_reduce_to
            flat = tf.nest.flatten(value)
            if not self._routes(reduce_op, flat):
                return super()._replica_ctx_all_reduce(reduce_op, value, options)
            parent = super()

            def all_reduce(tensors: list) -> list:
                (tensor,) = tensors
                return [parent._replica_ctx_all_reduce(tf.distribute.ReduceOp.SUM, [tensor], options)[0]]

            device = flat[0].device or self.worker_devices[0]
            (reduced,) = self.gradient_router.reduce([list(flat)], [device], all_reduce)
            return tf.nest.pack_sequence_as(value, reduced)

    GradientPathExtended.__name__ = GradientPathExtended.__qualname__ = f"GradientPath{extended_class.__name__}"
    return GradientPathExtended



def _components(value) -> tuple:
    return tuple(value.values) if isinstance(value, tf.distribute.DistributedValues) else (value,)
