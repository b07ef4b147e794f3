"""HorovodGroup: the processes of a Horovod job, and the identical start of every variable across them."""

from __future__ import annotations

import tensorflow as tf

from tfdist._compat import distribute as tf_distribute
from tfdist.comm.variable_signature import mismatch_message, signature
from tfdist.errors import ConfigError

__all__ = ["HorovodGroup"]


class HorovodGroup:
    """Rank and size of this Horovod job, and what happens when a variable is created.

    Every variable is checked across ranks (an all-gather of its shape/dtype signature: ranks that
    build different models get a ConfigError naming the variable, not a hang), then rank 0's value is
    broadcast to all ranks, so every replica starts from the same weights.

    Example (under `horovodrun -np 2`):
        >>> group = HorovodGroup(tfdist.comm.horovod.init_horovod())
        >>> group.rank, group.size
        (0, 2)   # (1, 2) on the other rank
    """

    def __init__(self, hvd):
        self._hvd = hvd
        self.rank, self.size = hvd.rank(), hvd.size()
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()
        self.mpi_enabled = bool(hvd.mpi_enabled())
        self._created = 0  # variables created so far: the k-th variable must agree on every rank

    def on_variable_created(self, var) -> None:
        """Checks that every rank creates the same variable, then copies rank 0's value to all ranks."""
        hvd = self._hvd
        index = self._created
        self._created += 1
        with tf.init_scope():
            if not tf.executing_eagerly():
                return  # TF1-style graph building: nothing to run now
            shape = var.shape.as_list() if var.shape.rank is not None else []
            own = signature(index, shape, var.dtype)
            gathered = hvd.allgather(tf.constant(own[None, :])).numpy()
            if not (gathered == own[None, :]).all():
                raise ConfigError(mismatch_message("HorovodStrategy", "rank", index, var, gathered))
            if tf_distribute.is_mirrored(var):  # metric states (sync on read) start at zero everywhere already
                var.assign(hvd.broadcast(tf.convert_to_tensor(tf_distribute.local_values(var)[0]), root_rank=0))

