"""Horovod internals: finding a process set registered earlier (Horovod 0.28 has no public lookup).

`hvd.add_process_set(ranks)` raises "Attempted to add a duplicate process set" when a set of the same ranks exists
(horovod/common/process_sets.py, `add_process_set`), and Horovod keeps no Python object for sets added by other
callers (tfdist.comm's groups, another strategy). The table lives in Horovod's C++ core; its Python reader is the
private `_basics._get_process_set_ids_and_ranks()`, and `_temp_process_set_object(id)` wraps an id.
"""

from __future__ import annotations

import tfdist._compat  # noqa: F401  (the TF/Keras version check, before any reach-in below)

from collections.abc import Sequence

__all__ = ["registered_process_set"]


def registered_process_set(hvd, ranks: Sequence[int]):
    """The registered Horovod process set whose ranks are `ranks` (sorted), or None. `hvd`: horovod.tensorflow."""
    from horovod.common.process_sets import _temp_process_set_object
    from horovod.tensorflow.mpi_ops import _basics

    del hvd  # the table is the process's one (horovod.tensorflow's basics)
    wanted = sorted(int(r) for r in ranks)
    for set_id, members in _basics._get_process_set_ids_and_ranks().items():
        if sorted(members) == wanted:
            found = _temp_process_set_object(int(set_id))
            found.ranks = wanted
            return found
    return None
