"""PieceState: ZeRO stage 3's optimizer state kept per parameter piece (one slot variable per piece)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.zero.fsdp.state import Zero3State

__all__ = ["PieceShard", "PieceState"]


class PieceShard:
    """Local replica i's shard of one slot at stage 3: its piece of that slot for every variable, each
    its own variable (`pieces[j]`, shape [k_j], on the replica's device or the host with offload).

    It stands where stages 1/2 keep one flat shard variable (`SlotShards.slots[name][i]`): `shape` and
    `dtype` are the flat shard's, and `value` assembles the flat shard ([piece of variable 0 | piece of
    variable 1 | ...], `ParamShardLayout`'s order) only when read, for a collective save
    (`SlotShards.gathered`) or a test; a training step never builds it.

    Example:
        >>> shard = engine.state.slots["momentum"][0]   # zero_stage=3, Dense(8 -> 16) + Dense(16 -> 10), 4 replicas
        >>> shard.shape, [tuple(p.shape) for p in shard.pieces]
        (TensorShape([79]), [(32,), (4,), (40,), (3,)])
    """

    def __init__(self, pieces: list, device: str):
        self.pieces = list(pieces)
        self.device = device
        self.dtype = tf.as_dtype(self.pieces[0].dtype)
        self.shape = tf.TensorShape([sum(int(p.shape[0]) for p in self.pieces)])

    @property
    def value(self) -> tf.Tensor:
        """The flat shard (a new tensor on `device`)."""
        with tf.device(self.device):
            return tf.concat([tf.convert_to_tensor(p.value) for p in self.pieces], 0)

    def numpy(self):
        return self.value.numpy()

    def __repr__(self) -> str:
        return f"<PieceShard {len(self.pieces)} pieces, {self.shape[0]} elements on {self.device}>"


class PieceState(Zero3State):
    """The optimizer state of a per-piece ZeRO-3 engine: `pieces[name][i][j]` is local replica i's
    piece of slot `name` (e.g. Adam's "momentum") for variable j, a variable shaped like the parameter
    piece `FsdpParam.components[i]` it is updated with. `slots[name][i]` is the same state as a
    `PieceShard`, so everything that reads a `SlotShards` (memory_report, `gathered()`) keeps working.

    Reads and writes of one variable's slot touch only that variable's pieces: a read concatenates
    them (all-gathers them across processes, ~Ψ_var of traffic), a write scatters a full value into the
    pieces this process owns (loading at any number of replicas).

    Example:
        >>> state = tfdist.zero.engine_of(model).state   # zero_stage=3 on 4 replicas, after fit
        >>> [tuple(p.shape) for p in state.piece_variables("momentum", 0)]   # replica 0, every variable
        [(32,), (4,), (40,), (3,)]
        >>> state.read(0, "momentum").shape                                 # the whole first kernel's
        TensorShape([8, 16])
    """

    def __init__(self, pieces: dict[str, list[list]], layout, comm, devices, host_device: str, owner: str, params):
        slots = {name: [PieceShard(row, d) for row, d in zip(rows, devices)] for name, rows in pieces.items()}
        super().__init__(slots, layout, comm, devices, host_device, owner=owner, params=params)
        self.pieces = pieces
        self._index = {sid: i for i, sid in enumerate(comm.shard_ids)}

    def piece_variables(self, slot: str, replica: int) -> list:
        """Local replica `replica`'s piece variables of `slot`, one per trainable variable."""
        self.shards(slot)  # a clear error for an unknown slot
        return self.pieces[slot][replica]

    def read(self, var: int, slot: str) -> tf.Tensor:
        if self._gathered is not None:  # inside gathered(): the flat shards were all-gathered
            return super().read(var, slot)
        self.shards(slot)
        layout, rows = self.layout, self.pieces[slot]
        if self.comm.all_local:
            parts = []
            for r in range(layout.num_shards):
                i = self._index[r]
                with tf.device(self.devices[i]):
                    parts.append(tf.identity(rows[i][var].value))
            with tf.device(self.host_device):
                flat = tf.concat(parts, 0)
        else:  # every process's piece of this one variable: Ψ_var of traffic
            self._before_gather(f"{self.owner}: slot {slot!r} of variable {var}", "the optimizer state")
            mine = []
            for i in range(len(self.comm.shard_ids)):
                with tf.device(self.devices[i]):
                    mine.append(tf.identity(rows[i][var].value))
            flat = self.comm.all_gather(mine)[0]
        with tf.device(self.host_device):
            return tf.reshape(flat[:layout.sizes[var]], layout.shapes[var])

    def write(self, var: int, slot: str, value: tf.Tensor) -> None:
        self.shards(slot)
        layout, rows = self.layout, self.pieces[slot]
        k = layout.piece_sizes[var]
        with tf.device(self.host_device):
            flat = tf.reshape(tf.cast(value, rows[0][var].dtype), [-1])
            flat = tf.pad(flat, [[0, k * layout.num_shards - layout.sizes[var]]])
        for r, i in self._index.items():
            with tf.device(self.devices[i]):
                rows[i][var].assign(flat[r * k:(r + 1) * k])
