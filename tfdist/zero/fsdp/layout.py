"""ParamShardLayout: every variable cut into N even pieces, replica r's shard = its piece of each variable."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from tfdist.zero.flat_layout import FlatLayout, Piece

__all__ = ["ParamShardLayout"]


class ParamShardLayout(FlatLayout):
    """The flat shards of ZeRO stage 3: variable j (flattened, zero-padded to N * k_j elements,
    k_j = ceil(size_j / N)) gives elements [r * k_j, (r + 1) * k_j) to replica r; replica r's flat
    shard is the concatenation of its pieces of all variables, in order.

    Every shard has the same length (sum of the k_j), so parameters, gradients and optimizer state
    are each 1/N of the model per replica (plus < N padding elements per variable). Cutting each
    variable (as PyTorch's FSDP2 does per parameter) instead of the concatenation lets a replica
    keep its piece of one variable as one variable, which a unit can all-gather and rebuild alone.

    Example:
        >>> layout = ParamShardLayout([(3, 2), (3,)], num_shards=2)   # k = 3 and 2
        >>> layout.shard_size, [(p.var, p.start, p.stop, p.offset) for p in layout.pieces(1)]
        (5, [(0, 3, 6, 0), (1, 2, 3, 3)])
    """

    def __init__(self, shapes: Sequence[Sequence[int]], num_shards: int):
        super().__init__(shapes, num_shards)
        self.piece_sizes = [math.ceil(s / self.num_shards) for s in self.sizes]
        self.piece_offsets = np.concatenate([[0], np.cumsum(self.piece_sizes, dtype=np.int64)]).tolist()
        self.shard_size = max(1, int(self.piece_offsets[-1]))
        self.padded = self.shard_size * self.num_shards
        self._pieces = [self._cut_pieces(r) for r in range(self.num_shards)]

    def _cut_pieces(self, shard: int) -> list[Piece]:
        pieces = []
        for j, (size, k) in enumerate(zip(self.sizes, self.piece_sizes)):
            start, stop = shard * k, min(size, (shard + 1) * k)
            if start < stop:
                pieces.append(Piece(j, start, stop, int(self.piece_offsets[j])))
        return pieces

    def piece_padding(self, var: int, shard: int) -> int:
        """Zero elements at the end of shard `shard`'s piece of variable `var`."""
        k, size = self.piece_sizes[var], self.sizes[var]
        return k - max(0, min(size, (shard + 1) * k) - shard * k)

    def __repr__(self) -> str:
        return (f"ParamShardLayout({len(self.sizes)} variables, {self.total} elements, "
                f"{self.num_shards} shards of {self.shard_size})")
