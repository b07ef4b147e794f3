"""What a strategy asks of the ZeRO engine: the stage, offload and collectives, and which optimizers can be sharded."""

from __future__ import annotations

from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

from tfdist.errors import ConfigError
from tfdist.zero.collectives import ShardCollectives

__all__ = ["SUPPORTED_STAGES", "ZeroConfig", "check_options", "check_stage3_options", "check_unit_bytes",
           "check_stage", "refusal", "register_elementwise",
           "sharded_optimizer_names"]

SUPPORTED_STAGES = (0, 1, 2)  # every data-parallel strategy; stage 3 where the strategy says it runs

# Optimizers whose update of one element depends only on that element's gradient, state and
# scalars: running them on a flat shard of the concatenated variables gives exactly the
# per-variable result, so their state can be cut anywhere.
_ELEMENTWISE: list[type] = [
    keras.optimizers.SGD, keras.optimizers.Adam, keras.optimizers.AdamW, keras.optimizers.Adamax,
    keras.optimizers.RMSprop, keras.optimizers.Adagrad, keras.optimizers.Adadelta, keras.optimizers.Lion,
    keras.optimizers.Ftrl,
]
# Optimizers whose update needs the whole variable (or state shared across variables): refused.
_NOT_ELEMENTWISE = {
    "Adafactor": "keeps factored second moments whose shape depends on each variable's shape",
    "Lamb": "scales each variable's update by a per-variable trust ratio (norms of whole variables)",
    "Muon": "orthogonalises each weight matrix as a whole",
    "Nadam": "keeps a scalar (u_product) advanced once per step outside update_step",
    "LossScaleOptimizer": "wraps another optimizer (its inner optimizer is the one sharded)",
}


def register_elementwise(cls: type) -> type:
    """Declares a custom Keras optimizer class element-wise, so ZeRO may shard it (usable as decorator).

    Only do this if `update_step` treats every element independently (no norms of whole variables,
    no state whose shape differs from the variable's).

    Example:
        >>> @tfdist.zero.register_elementwise
        ... class MySGD(keras.optimizers.SGD): ...
    """
    _ELEMENTWISE.append(cls)
    return cls


def refusal(optimizer) -> str | None:
    """Why `optimizer` cannot be sharded element-wise, or None when it can."""
    refused = next((why for n, why in _NOT_ELEMENTWISE.items()
                    if any(c.__name__ == n for c in type(optimizer).__mro__)), None)
    if refused:
        return f"it {refused}"
    if not isinstance(optimizer, tuple(_ELEMENTWISE)):
        return "tfdist does not know whether its update is element-wise"
    return None


def sharded_optimizer_names() -> list[str]:
    """Names of the optimizer classes ZeRO shards (built-in and registered)."""
    return [c.__name__ for c in _ELEMENTWISE]


@dataclass(frozen=True)
class ZeroConfig:
    """What a strategy asks of the ZeRO engine: the stage, offload, and its collectives."""

    stage: int
    offload: bool
    collectives: ShardCollectives
    host_device: str = "/job:localhost/replica:0/task:0/device:CPU:0"
    #: stage 3: a layer whose trainable weights total at most this many bytes is gathered as one unit with
    #: all its sublayers (None: every layer that owns weights is its own unit); see `check_unit_bytes`
    unit_bytes: int | None = None
    #: stage 3: False keeps each unit's gathered parameters from its forward until its backward (one
    #: all-gather per unit and step instead of two; the gathered parameters of every unit stay in memory)
    reshard_after_forward: bool = True
    #: stage 3: issue each unit's all-gather when the unit before it (in forward or backward order) starts
    prefetch: bool = False
    #: the dtype gradients are summed (reduce-scattered) in, cast back to their own after; None: their own
    grad_dtype: tf.DType | None = None


def check_unit_bytes(fsdp_unit_bytes, zero_stage: int = 3) -> int | None:
    """Validates `fsdp_unit_bytes` (ZeRO stage 3's size-based wrap policy): None or a positive int.

    Example:
        >>> check_unit_bytes(2**20)
        1048576
    """
    if fsdp_unit_bytes is None:
        return None
    if isinstance(fsdp_unit_bytes, bool) or not isinstance(fsdp_unit_bytes, (int, np.integer)) \
            or int(fsdp_unit_bytes) <= 0:
        raise ConfigError(f"fsdp_unit_bytes must be a positive number of bytes (a layer whose weights total at most "
                          f"this many is gathered as one ZeRO-3 unit with its sublayers) or None (one unit per "
                          f"layer), got {fsdp_unit_bytes!r}.")
    if zero_stage != 3:
        raise ConfigError(f"fsdp_unit_bytes={fsdp_unit_bytes} groups the parameters ZeRO stage 3 gathers; it needs "
                          f"zero_stage=3 (got zero_stage={zero_stage}).")
    return int(fsdp_unit_bytes)


def check_stage(zero_stage, stages: tuple[int, ...] = SUPPORTED_STAGES) -> int:
    if isinstance(zero_stage, bool) or not isinstance(zero_stage, (int, np.integer)) \
            or int(zero_stage) not in stages:
        hint = (" Stage 3 (partitioned parameters) runs on tfdist.MirroredStrategy, MultiWorkerMirroredStrategy "
                "and HorovodStrategy." if zero_stage == 3 and 3 not in stages else "")
        also = ", and 3 (parameters sharded too) on this strategy" if 3 in stages else ""
        raise ConfigError(f"zero_stage={zero_stage!r} is not supported; supported stages are "
                          f"{set(SUPPORTED_STAGES)} (0: plain data parallel, 1: optimizer state sharded, "
                          f"2: optimizer state and gradients sharded){also}.{hint}")
    return int(zero_stage)


def check_options(zero_stage, offload, stages: tuple[int, ...] = SUPPORTED_STAGES) -> tuple[int, bool]:
    """Validates a strategy's `zero_stage` and `offload` arguments; returns them normalised.

    `stages`: the stages the strategy runs (stage 3, parameters sharded too, only where it says so).
    """
    stage = check_stage(zero_stage, stages)
    if not isinstance(offload, bool):
        raise ConfigError(f"offload must be True or False, got {offload!r}.")
    if offload and stage == 0:
        raise ConfigError("offload=True moves the optimizer shards to host memory; it needs zero_stage=1, 2 or 3.")
    return stage, offload


def check_stage3_options(zero_stage: int, fsdp_unit_bytes, reshard_after_forward, fsdp_prefetch) -> None:
    """A strategy's ZeRO-3 arguments, checked before it starts anything (cluster, Horovod, TF's runtime).

    Example:
        >>> check_stage3_options(3, 4 * 2**20, True, False)   # fine; zero_stage=2 would be a ConfigError
    """
    check_unit_bytes(fsdp_unit_bytes, zero_stage)
    for name, flag in (("reshard_after_forward", reshard_after_forward), ("fsdp_prefetch", fsdp_prefetch)):
        if not isinstance(flag, bool):
            raise ConfigError(f"{name} must be True or False, got {flag!r}.")
