"""HorovodShardCollectives: ZeRO's reduce-scatter / all-gather / all-reduce across Horovod processes."""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from tfdist.comm.horovod import horovod
from tfdist.comm.horovod_backend import HorovodBackend
from tfdist.comm.read_agreement import ReadAgreement
from tfdist.comm.wire import carry
from tfdist.zero.collectives import ShardCollectives

__all__ = ["HorovodShardCollectives"]


class HorovodShardCollectives(ShardCollectives):
    """ShardCollectives for `tfdist.HorovodStrategy`: M local replicas per process, P processes.

    Global replica (= shard) index of local replica i on rank p is p * M + i, as the strategy numbers
    its replicas. Each method first combines the M local values on this process (a local sum or
    concatenation), then makes one Horovod call across the processes:
    - reduce_scatter: the local sums of all N = P * M shard parts, in global shard order, go through
      `hvd.alltoall`, which sends rank p the M consecutive shards it owns; rank p adds up what the
      P ranks sent. That is the sum over every replica of every process, and per process it moves
      (P-1)/P of the gradient once, like a ring reduce-scatter.
    - all_gather: the M local shards, concatenated, through `hvd.allgather` (rank order = shard order).
    - all_reduce_sum: local sum, then `hvd.allreduce(op=Sum)`.
    The results are copied to every local device. Works eagerly and inside tf.function. Horovod
    matches ops across ranks by name (in graphs: derived from the input tensor's name), so every
    input first goes through an identity with a rank-independent name (the shard variables'
    names contain the shard index, which would give each rank a different op name: a hang).

    Example (under `horovodrun -np 2`):
        >>> comm = HorovodShardCollectives(["/cpu:0"], rank=hvd.rank(), size=hvd.size())
        >>> comm.shard_ids, comm.num_shards
        ([0], 2)   # on rank 0; [1] on rank 1
    """

    def __init__(self, devices: Sequence[str], rank: int, size: int, read_timeout_s: float = 60.0):
        self._hvd = horovod()
        # A rank-0-only model.save would wait in hvd.allgather until Horovod's stall shutdown: reads that gather
        # on their own are agreed on first (through the Gloo rendezvous store, or MPI messages under mpirun).
        self._agreement = ReadAgreement.from_environment(rank, size, read_timeout_s,
                                                         mpi=bool(self._hvd.mpi_enabled()))
        self.gather_on_read = self._agreement is not None
        self.devices = list(devices)
        m = len(self.devices)
        self.rank, self.size = int(rank), int(size)
        self.shard_ids = [self.rank * m + i for i in range(m)]
        self.num_shards = self.size * m

    def agree_to_read(self, what: str) -> None:
        # Inside a tf.function the check would run once, at tracing; reads there are the caller's to order.
        if self._agreement is not None and tf.executing_eagerly():
            self._agreement.agree(what)

    def _local_sum(self, values: Sequence[tf.Tensor]) -> tf.Tensor:
        values = list(values)
        return values[0] if len(values) == 1 else tf.add_n([tf.identity(v) for v in values])

    def _to_devices(self, value: tf.Tensor) -> list[tf.Tensor]:
        out = []
        for device in self.devices:
            with tf.device(device):
                out.append(tf.identity(value))
        return out

    def reduce_scatter(self, chunks: Sequence[Sequence[tf.Tensor]]) -> list[tf.Tensor]:
        flats = []
        for i, device in enumerate(self.devices):
            with tf.device(device):
                flats.append(tf.concat(list(chunks[i]), 0) if len(chunks[i]) > 1 else chunks[i][0])
        return self.reduce_scatter_flat(flats)

    def reduce_scatter_flat(self, flats: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """Like reduce_scatter, with each local replica's parts already concatenated in shard order
        (`flats[i]` = num_shards * shard_size elements).

        An all-to-all and a local sum: rank p is sent the columns of the shards it owns by every
        rank, and adds them up, so each rank moves (P-1)/P of the gradient once, as a ring
        reduce-scatter does. Not `hvd.reducescatter`: under Gloo on CPU it was slower than an
        all-reduce of the whole gradient (measured in docs/design.md). Sent in chunks of about
        CHUNK_BYTES, one after the other
        (`all_to_all_sums`).
        """
        m = len(self.devices)
        with tf.device(self.devices[0]):
            flat = self._local_sum(flats)
            if self.size == 1:
                mine = tf.split(flat, m) if m > 1 else [flat]
            else:
                rows = tf.reshape(flat, [self.num_shards, -1])  # a view: row r is shard r

                def exchange(cols: tf.Tensor) -> tf.Tensor:
                    # rows p*M..p*M+M-1 (rank p's shards) go to rank p: alltoall splits evenly by rank
                    # Horovod has no bfloat16 kernels: bfloat16 (grad_dtype) travels bitcast, summed here after
                    got = carry(tf.reshape(cols, [-1]), HorovodBackend.move_dtypes,
                                lambda wire: self._hvd.alltoall(tf.identity(wire, name="zero_grads")))
                    return tf.reshape(got, [self.size, m * int(cols.shape[1])])  # one row per sending rank

                sums = self.all_to_all_sums(rows, exchange, self.size)  # chunk k: my M shards' columns
                pieces = [tf.split(c, m) if m > 1 else [c] for c in sums]
                mine = [tf.concat([p[i] for p in pieces], 0) if len(pieces) > 1 else pieces[0][i] for i in range(m)]
        out = []
        for device, shard_value in zip(self.devices, mine):
            with tf.device(device):
                out.append(tf.identity(shard_value))
        return out

    def all_gather(self, shards: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        with tf.device(self.devices[0]):
            local = tf.concat([tf.identity(s) for s in shards], 0) if len(shards) > 1 else shards[0]
            full = self._hvd.allgather(tf.identity(local, name="zero_shard")) if self.size > 1 else local
            if local.shape[0] is not None:
                full = tf.reshape(full, [local.shape[0] * self.size])
        return self._to_devices(full) if len(self.devices) > 1 else [tf.identity(full)]

    def all_reduce_sum(self, values: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        with tf.device(self.devices[0]):
            total = self._local_sum(values)
            if self.size > 1:
                total = self._hvd.allreduce(tf.identity(total, name="zero_sum"), op=self._hvd.Sum)
        return self._to_devices(total)

    def __repr__(self) -> str:
        return (f"HorovodShardCollectives(rank={self.rank}/{self.size}, devices={self.devices}, "
                f"shards={self.shard_ids} of {self.num_shards})")
