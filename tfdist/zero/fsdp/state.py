"""Zero3State: stage 3's optimizer-state shards, whose collective reads also assemble the parameters."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import tensorflow as tf

from tfdist.zero.owned_slots import SlotShards

__all__ = ["Zero3State"]


class Zero3State(SlotShards):
    """The `SlotShards` of a ZeRO-3 engine. Under ZeRO stage 3 across processes the parameters are
    sharded like the optimizer state, so reading one (a save, `get_weights`) is a collective too:
    `gathered()` all-gathers every slot and then every parameter once (reads inside are local, so
    only the chief needs to write the file), and `gather_param` is the read of one parameter
    (allowed where a read of one slot is: inside `gathered()` / `collective_reads()`, or always with
    collectives that may gather on read, e.g. TF's, which time out clearly).

    Example:
        >>> engine = tfdist.zero.engine_of(model)   # zero_stage=3 on 2 workers x 2 devices
        >>> with engine.state.gathered():              # on every worker
        ...     weights = model.get_weights()          # full values, no further collective
    """

    def __init__(self, *args, params: Callable[[], list], **kwargs):
        super().__init__(*args, **kwargs)
        self._params = params  # the engine's FsdpParams (filled once the variables are converted)
        self._gathered_params: dict[int, tf.Tensor] | None = None

    @contextlib.contextmanager
    def gathered(self):
        if self.comm.all_local or self._gathered is not None:
            yield
            return
        with super().gathered():
            self._gathered_params = {id(p): self._all_gather(p) for p in self._params()}
            try:
                yield
            finally:
                self._gathered_params = None

    def read(self, var: int, slot: str) -> tf.Tensor:
        if self._gathered is None:
            return super().read(var, slot)
        # The gathered slot is [shard 0 | shard 1 | ...], and a stage-3 shard holds a piece of every
        # variable: variable `var` is the concatenation of its owners' pieces, not one contiguous range.
        self.shards(slot)  # a clear error for an unknown slot
        full, size = self._gathered[slot], self.layout.shard_size
        parts = [full[r * size + p.offset:r * size + p.offset + p.size] for r, p in self.layout.owners(var)]
        with tf.device(self.host_device):
            return tf.reshape(tf.concat(parts, 0), self.layout.shapes[var])

    def gather_param(self, param) -> tf.Tensor:
        """The flat (padded) value of FsdpParam `param` from every process's pieces, on the host."""
        if self._gathered_params is not None and id(param) in self._gathered_params:
            return self._gathered_params[id(param)]
        self._before_gather(f"ZeRO stage 3: weight {param.name!r}", "a sharded weight")
        return self._all_gather(param)

    def _all_gather(self, param) -> tf.Tensor:
        mine = []
        for c in param.components:
            with tf.device(c.device):
                mine.append(tf.identity(c))
        full = self.comm.all_gather(mine)[0]
        with tf.device(self.host_device):
            return tf.identity(full)
