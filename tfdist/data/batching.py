"""Global and per-replica batch sizes: global batch = per-replica batch x replicas, exactly."""

from __future__ import annotations

from tfdist.errors import ConfigError


def per_replica_batch_size(global_batch_size: int, num_replicas: int) -> int:
    """Returns the per-replica batch, refusing a global batch the replicas cannot share evenly.

    Example:
        >>> per_replica_batch_size(256, 4)
        64
    """
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ConfigError(f"num_replicas must be a whole number >= 1, got {num_replicas!r}.")
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ConfigError(f"global_batch_size must be a whole number >= 1, got {global_batch_size!r}.")
    if global_batch_size % num_replicas:
        lower = global_batch_size - global_batch_size % num_replicas
        nearby = " or ".join(str(b) for b in (lower, lower + num_replicas) if b > 0)
        raise ConfigError(
            f"global_batch_size={global_batch_size} does not divide by the {num_replicas} replicas, "
            f"so replicas would get different shares of every batch. Use a multiple of {num_replicas}, "
            f"e.g. {nearby}."
        )
    return global_batch_size // num_replicas


def global_batch_size(per_replica: int, num_replicas: int) -> int:
    """Returns per_replica x num_replicas, checking both are whole numbers >= 1."""
    for name, value in (("per_replica", per_replica), ("num_replicas", num_replicas)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a whole number >= 1, got {value!r}.")
    return per_replica * num_replicas
