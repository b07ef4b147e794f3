"""StrategyExtended internals: a few numbers that ride along with a step's first all-reduce (the gradients').

Uneven-data agreement (tfdist.data_parallel.uneven) needs every rank to sum a short vector at each step. A separate
collective per step costs a round trip; appended to the gradient all-reduce that the step runs anyway it costs
a few bytes. `with_step_flags(ExtendedClass)` gives a StrategyExtended class whose reductions ask a
`FlagCarrier` for such a vector: the first SUM all-reduce of floating values inside a `strategy.run` carries
it (as one more value of the same dtype: TF packs it into the gradients' collective, Horovod into the same
grouped all-reduce), and the carrier receives the sum. Every other reduction is untouched.
"""

from __future__ import annotations

import functools
from typing import Protocol

import tensorflow as tf

from tfdist._compat.distribute import regroup_per_replica

__all__ = ["FlagCarrier", "with_step_flags"]


class FlagCarrier(Protocol):
    def take(self) -> tf.Tensor | None:
        """The float32 vector to all-reduce with this reduction, or None (none armed, or already sent this step)."""

    def receive(self, summed: tf.Tensor) -> None:
        """The vector summed over every replica."""


@functools.cache
def with_step_flags(extended_class: type) -> type:
    """A subclass of `extended_class` (a MirroredExtended or CollectiveAllReduceExtended, or one of tfdist's)
    whose gradient all-reduce also sums the vector of its `step_carrier` (None: no carrier, stock behaviour)."""

    class StepFlagsExtended(extended_class):
        step_carrier: FlagCarrier | None = None

        def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
            # The merge_call path: all local replicas' values at once, in cross-replica context.
            values = [v for v, _ in value_destination_pairs]
            flags = self._flags_for(reduce_op, values)
            if flags is None:
                return super()._batch_reduce_to(reduce_op, value_destination_pairs, options)
            devices = self.worker_devices
            parts = []
            for i, device in enumerate(devices):  # this process's share on its first replica, zeros elsewhere
                with tf.device(device):
                    parts.append(tf.identity(flags) if i == 0 else tf.zeros_like(flags))
            extra = regroup_per_replica(parts)
            out = super()._batch_reduce_to(reduce_op, [*value_destination_pairs, (extra, extra)], options)
            summed = out[-1]
            self.step_carrier.receive(summed.values[0] if isinstance(summed, tf.distribute.DistributedValues)
                                      else summed)
            return out[:-1]

        def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
            # The path without merge_call (one device per process): this replica's values, in replica context.
            if self._use_merge_call():
                return super()._replica_ctx_all_reduce(reduce_op, value, options)  # -> _batch_reduce_to
            flat = tf.nest.flatten(value)
            flags = self._flags_for(reduce_op, flat)
            if flags is None:
                return super()._replica_ctx_all_reduce(reduce_op, value, options)
            with tf.device(flat[0].device):
                flags = tf.identity(flags)
            out = super()._replica_ctx_all_reduce(reduce_op, [*flat, flags], options)
            self.step_carrier.receive(out[-1])
            return tf.nest.pack_sequence_as(value, out[:-1])

        def _flags_for(self, reduce_op, values: list):
            carrier = self.step_carrier
            if carrier is None or reduce_op != tf.distribute.ReduceOp.SUM or not values:
                return None
            dtypes = {_dtype(v) for v in values}
            # One dtype packs into one collective; the counts must sum exactly (float32 is exact to 2**24).
            if len(dtypes) != 1 or next(iter(dtypes)) not in (tf.float32, tf.float64):
                return None
            flags = carrier.take()
            return None if flags is None else tf.cast(flags, next(iter(dtypes)))

    StepFlagsExtended.__name__ = StepFlagsExtended.__qualname__ = f"StepFlags{extended_class.__name__}"
    return StepFlagsExtended


def _dtype(value) -> tf.DType:
    if isinstance(value, tf.distribute.DistributedValues):
        value = value.values[0]
    return tf.as_dtype(value.dtype)
