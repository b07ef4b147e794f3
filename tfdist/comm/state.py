"""This process's collectives backend (set by `tfdist.comm.init`), and how a failed collective is reported."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import tensorflow as tf

from tfdist.comm.process_group import Backend, CollectiveError, Group
from tfdist.errors import ConfigError, troubleshooting

__all__ = ["STATE", "backend_for", "context", "guard"]

T = TypeVar("T")
LAUNCH = "`tfdist launch -n N -- python script.py`"


@dataclass
class _State:
    backend: Backend | None = None  # None until init()
    check: bool = True  # exchange dtype/shape signatures before each collective (init(check=...))


#: the one state of this process (tests reset `STATE.backend` to None)
STATE = _State()


def backend_for(what: str) -> Backend:
    """The backend `init` chose, or a ConfigError saying to call init first."""
    backend = STATE.backend
    if backend is None:
        raise ConfigError(f"tfdist.comm.{what}: call tfdist.comm.init() first, at the start of the program on "
                          f"every process (started with {LAUNCH}, horovodrun or mpirun).")
    return backend


def context(what: str, group: Group | None) -> tuple[Backend, Group]:
    """(backend, group) of a collective on `group` (None: every process); this process must be a member."""
    backend = backend_for(what)
    group = backend.world if group is None else group
    if not isinstance(group, Group):
        raise ConfigError(f"tfdist.comm.{what}: group must come from tfdist.comm.new_group(...) (or None for all "
                          f"processes), got {type(group).__name__}.")
    if group.rank is None:
        raise ConfigError(f"tfdist.comm.{what}: this process (rank {backend.rank}) is not in the group of ranks "
                          f"{list(group.ranks)}; call a group's collectives only where group.rank is not None.")
    return backend, group


def guard(what: str, ranks: tuple[int, ...], run: Callable[[], T]) -> T:
    """Runs a collective among `ranks`; eagerly, a TF/Horovod failure becomes a CollectiveError that says
    what to check. (Inside tf.function the failure surfaces when the function runs, as TF's error.)"""
    try:
        return run()
    except tf.errors.OpError as err:
        backend = STATE.backend
        first = (err.message or str(err)).strip().splitlines()[0][:300]
        raise CollectiveError(
            f"tfdist.comm.{what} failed on rank {backend.rank} (ranks {list(ranks)}, timeout_s="
            f"{backend.timeout_s:g}): {type(err).__name__}: {first}. Every process of the group must call the same "
            "collectives in the same order with tensors of the same dtype (and shape, where the operation needs "
            "it); a process that stopped or skipped a call makes the others fail after timeout_s."
            + troubleshooting("a-collective-times-out")) from err
