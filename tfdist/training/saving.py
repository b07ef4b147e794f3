"""save_model: `model.save` for multi-process jobs (every rank calls it, the chief writes)."""

from __future__ import annotations

import os
import tempfile

from tfdist.cluster.rank import is_chief
from tfdist.zero.attach import gathered_state

__all__ = ["save_model"]


def save_model(model, filepath, strategy=None, **kwargs) -> bool:
    """`model.save(filepath)` for multi-process jobs: call it on every rank; the chief writes.

    With the model axis across processes (a ModelParallelStrategy mesh row spanning processes) every rank
    saves (reading a split variable whole is a collective); only the chief keeps its file.
    With ZeRO across processes (HorovodStrategy / MultiWorkerMirroredStrategy with zero_stage > 0)
    the optimizer state is sharded over the ranks, so every rank joins one all-gather first and the
    file holds the full logical optimizer state (loadable in plain Keras on one device). Without
    it, only the chief does anything. Returns True on the rank that wrote the file.

    Example:
        >>> from tfdist.training import save_model
        >>> save_model(model, "out/model.keras")        # every rank
    """
    strategy = strategy if strategy is not None else model.distribute_strategy
    chief = is_chief(strategy)
    with gathered_state(model):
        if chief:
            if os.path.dirname(os.fspath(filepath)):
                os.makedirs(os.path.dirname(os.fspath(filepath)), exist_ok=True)
            model.save(filepath, **kwargs)
        elif getattr(strategy, "saves_collectively", False):
            # The model axis across processes: reading a split variable whole is a collective of every process
            # of the row, so the others save too, in the same order, to a file they then drop.
            with tempfile.TemporaryDirectory() as scratch:
                model.save(os.path.join(scratch, os.path.basename(os.fspath(filepath))), **kwargs)
    return chief
