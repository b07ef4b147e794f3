"""What a strategy asks of the ZeRO engine: the stage, offload and collectives, and which optimizers can be sharded."""

from __future__ import annotations

from dataclasses import dataclass

import keras
import numpy as np

from tfdist.comm.shard_collectives import ShardCollectives
from tfdist.errors import ConfigError

__all__ = ["SUPPORTED_STAGES", "ZeroConfig", "check_options", "check_stage", "refusal", "register_elementwise",
           "sharded_optimizer_names"]

SUPPORTED_STAGES = (0, 1, 2)

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
        >>> @tfdist.sharding.register_elementwise
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


def check_stage(zero_stage) -> int:
    if isinstance(zero_stage, bool) or not isinstance(zero_stage, (int, np.integer)) \
            or int(zero_stage) not in SUPPORTED_STAGES:
        hint = (" Stage 3 (partitioned parameters) is not supported: parameters stay replicated."
                if zero_stage == 3 else "")
        raise ConfigError(f"zero_stage={zero_stage!r} is not supported; supported stages are "
                          f"{set(SUPPORTED_STAGES)} (0: plain data parallel, 1: optimizer state sharded, "
                          f"2: optimizer state and gradients sharded).{hint}")
    return int(zero_stage)


def check_options(zero_stage, offload) -> tuple[int, bool]:
    """Validates a strategy's `zero_stage` and `offload` arguments; returns them normalised."""
    stage = check_stage(zero_stage)
    if not isinstance(offload, bool):
        raise ConfigError(f"offload must be True or False, got {offload!r}.")
    if offload and stage == 0:
        raise ConfigError("offload=True moves the optimizer shards to host memory; it needs zero_stage=1 or 2.")
    return stage, offload
