"""FlatLayout: the concatenated parameter vector cut into N equal shards (DeepSpeed-style)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["FlatLayout", "Piece"]


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of variable `var` (flattened) that fall into one shard, at `offset` in it."""

    var: int
    start: int
    stop: int
    offset: int

    @property
    def size(self) -> int:
        return self.stop - self.start


class FlatLayout:
    """Where each element of a list of variables lives once they are concatenated and cut in N shards.

    The variables are flattened and concatenated in their order; the vector is zero-padded to
    `num_shards * shard_size` and shard r owns elements [r * shard_size, (r + 1) * shard_size).
    Every shard has the same size, so a large kernel is split across owners instead of landing
    whole on one of them (per-variable ownership leaves the owner of the largest variable with
    most of the state).

    Example:
        >>> layout = FlatLayout([(3, 4), (4,)], num_shards=4)   # 16 elements, 4 per shard
        >>> layout.shard_size
        4
        >>> [(p.var, p.start, p.stop) for p in layout.pieces(3)]
        [(1, 0, 4)]
    """

    def __init__(self, shapes: Sequence[Sequence[int]], num_shards: int):
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)]).tolist()
        self.total = int(self.offsets[-1])
        self.num_shards = int(num_shards)
        self.shard_size = max(1, math.ceil(self.total / self.num_shards))
        self.padded = self.shard_size * self.num_shards
        self._pieces = [self._cut(r) for r in range(self.num_shards)]

    def _cut(self, shard: int) -> list[Piece]:
        lo, hi = shard * self.shard_size, (shard + 1) * self.shard_size
        pieces = []
        for i, size in enumerate(self.sizes):
            a, b = max(lo, self.offsets[i]), min(hi, self.offsets[i] + size)
            if a < b:
                pieces.append(Piece(i, a - self.offsets[i], b - self.offsets[i], a - lo))
        return pieces

    def pieces(self, shard: int) -> list[Piece]:
        """The parts of variables that shard `shard` holds, in order."""
        return self._pieces[shard]

    def owners(self, var: int) -> list[tuple[int, Piece]]:
        """(shard, piece) pairs that together hold variable `var`, in element order."""
        return [(r, p) for r in range(self.num_shards) for p in self._pieces[r] if p.var == var]

    def padding(self, shard: int) -> int:
        """Zero elements at the end of `shard` (only the last shards have any)."""
        used = sum(p.size for p in self._pieces[shard])
        return self.shard_size - used

    def segment_ids(self, shard: int) -> np.ndarray:
        """For each element of `shard`, the index of its variable (len(variables) for padding)."""
        ids = np.full(self.shard_size, len(self.sizes), dtype=np.int32)
        for p in self._pieces[shard]:
            ids[p.offset:p.offset + p.size] = p.var
        return ids

    def __repr__(self) -> str:
        return (f"FlatLayout({len(self.sizes)} variables, {self.total} elements, "
                f"{self.num_shards} shards of {self.shard_size})")
