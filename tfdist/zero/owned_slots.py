"""SlotShards: the optimizer-state shards one process owns, read and written as whole per-variable slots."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import tensorflow as tf

from tfdist.errors import ConfigError
from tfdist.zero.collectives import ShardCollectives
from tfdist.zero.flat_layout import FlatLayout

__all__ = ["SlotShards"]


class SlotShards:
    """The slot variables of a ZeRO shard optimizer in this process, and their logical view.

    `slots[name][i]` is local replica i's flat shard of slot `name` (e.g. Adam's "momentum"),
    covering the elements `layout` assigns to global shard `comm.shard_ids[i]` of the
    concatenation of all trainable variables. Checkpoints see whole per-variable slots instead:
    `read` assembles one from its owners, `write` scatters one into the shards this process owns.
    When some owners are in other processes, reading is a collective: every process must read the
    same slots in the same order, either inside `gathered()` (one all-gather per slot, then reads
    are local, so only the chief needs to write the file) or inside `collective_reads()`.

    Example:
        >>> state = tfdist.zero.engine_of(model.optimizer).state   # zero_stage=1, after fit
        >>> state.names
        ['momentum', 'velocity']
        >>> state.read(0, "momentum").shape           # first variable's full Adam momentum
        TensorShape([3, 3, 1, 8])
    """

    def __init__(self, slots: dict[str, list], layout: FlatLayout, comm: ShardCollectives,
                 devices: Sequence[str], host_device: str, owner: str):
        self.slots = slots
        self.layout, self.comm = layout, comm
        self.devices = list(devices)  # where each local shard lives (the replica's device or the host)
        self.host_device = host_device
        self.owner = owner  # e.g. "ZeRO stage 2 (Adam)", for error messages
        self._local = {sid: i for i, sid in enumerate(comm.shard_ids)}
        self._gathered: dict[str, tf.Tensor] | None = None  # full slots while inside gathered()
        self._collective_reads = 0  # > 0 inside collective_reads()

    @property
    def names(self) -> list[str]:
        """The slot names, in the order the shard optimizer created them (e.g. Adam: momentum, velocity)."""
        return list(self.slots)

    def shards(self, slot: str) -> list:
        """The local shard variables of `slot`."""
        if slot not in self.slots:
            raise ConfigError(f"{self.owner}: the optimizer asked for slot {slot!r} that its shard optimizer "
                              f"did not create (it has {self.names}); this optimizer is not supported.")
        return self.slots[slot]

    def read(self, var: int, slot: str) -> tf.Tensor:
        """The full value of `slot` for variable `var`, on the host device."""
        shards = self.shards(slot)
        layout = self.layout
        if self._gathered is not None:
            start = layout.offsets[var]
            flat = self._gathered[slot][start:start + layout.sizes[var]]
        elif self.comm.all_local:
            parts = []
            for r, piece in layout.owners(var):
                i = self._local[r]
                with tf.device(self.devices[i]):
                    parts.append(tf.identity(shards[i].value[piece.offset:piece.offset + piece.size]))
            flat = tf.concat(parts, 0)
        else:  # each shard's piece of this variable, padded to one window: ~Psi_var traffic, not Psi
            self._before_gather(f"{self.owner}: slot {slot!r} of variable {var}", "the optimizer state")
            owners = layout.owners(var)
            window = max(p.size for _, p in owners)
            mine = []
            for i, sid in enumerate(self.comm.shard_ids):
                piece = next((p for r, p in owners if r == sid), None)
                with tf.device(self.devices[i]):
                    part = shards[i].value[piece.offset:piece.offset + piece.size] if piece \
                        else tf.zeros([0], shards[i].dtype)
                    mine.append(tf.pad(part, [[0, window - int(part.shape[0])]]))
            gathered = self.comm.all_gather(mine)[0]
            flat = tf.concat([gathered[r * window:r * window + p.size] for r, p in owners], 0)
        with tf.device(self.host_device):
            return tf.reshape(flat, layout.shapes[var])

    def _before_gather(self, what: str, reading: str) -> None:
        """Before a read outside `gathered()` all-gathers on its own: inside `collective_reads()` every process
        reads alike; otherwise the collectives must allow it (and every process agree to it), or it is refused
        here rather than waiting for processes that are not reading."""
        if self._collective_reads:
            return
        if not self.comm.gather_on_read:
            raise ConfigError(
                f"{what}: reading {reading} (e.g. model.save, save_weights, tf.train.Checkpoint, get_weights) "
                "needs the shards of every process, so every rank must take part. "
                "Use tfdist.training.save_model(model, path) on every rank (rank 0 writes), "
                "tfdist.training.ModelCheckpoint / BackupAndRestore, or run the save on every rank inside "
                "`with tfdist.zero.gathered_state(model):`.")
        self.comm.agree_to_read(what)

    def write(self, var: int, slot: str, value: tf.Tensor) -> None:
        """Scatters a full value of `slot` for variable `var` into the shards this process owns."""
        shards = self.shards(slot)
        flat = tf.reshape(tf.cast(value, shards[0].dtype), [-1])
        for r, piece in self.layout.owners(var):
            if r in self._local:
                i = self._local[r]
                with tf.device(self.devices[i]):
                    shards[i].value[piece.offset:piece.offset + piece.size].assign(flat[piece.start:piece.stop])

    @contextlib.contextmanager
    def gathered(self):
        """Collective (every process enters it, in the same order): all-gathers every slot once, so
        reads inside need no collective and may run on one rank only (the chief writing a file)."""
        if self.comm.all_local or self._gathered is not None:
            yield
            return
        cache = {}
        for name in self.names:
            full = self.comm.all_gather([s.value for s in self.slots[name]])[0]
            with tf.device(self.host_device):
                cache[name] = tf.identity(full)
        self._gathered = cache
        try:
            yield
        finally:
            self._gathered = None

    @contextlib.contextmanager
    def collective_reads(self):
        """Allows reads that all-gather one slot each; every process must then read the same slots
        in the same order (the same save code on every rank)."""
        self._collective_reads += 1
        try:
            yield
        finally:
            self._collective_reads -= 1
