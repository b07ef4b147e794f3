"""Checks of what a caller passes to a collective, before anything is sent: each error names the
parameter, what came and what would work.

Example:
    >>> check_rank(3, 2, "root", "broadcast")
    Traceback (most recent call last):
    ConfigError: tfdist.comm.broadcast: root=3 is not a rank of the job (ranks 0..1).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfdist.comm.process_group import Group
from tfdist.comm.wire import check_numeric
from tfdist.errors import ConfigError

__all__ = ["as_tensor", "check_divisible", "check_rank", "parse_like"]


def as_tensor(x: object, what: str, parameter: str = "x") -> tf.Tensor:
    """`x` (tensor, variable, array or number) as a tensor of a dtype the collectives carry, of known rank."""
    try:
        t = tf.convert_to_tensor(x)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"tfdist.comm.{what}: {parameter} must be a tensor, array or number, got "
                          f"{type(x).__name__} ({err}).") from None
    check_numeric(t.dtype, parameter, what)
    if t.shape.rank is None:
        raise ConfigError(f"tfdist.comm.{what}: {parameter} has an unknown number of dimensions; give the "
                          "tf.function an input_signature with a known number of dimensions.")
    return t


def check_rank(value: object, bound: int, parameter: str, what: str, group: Group | None = None) -> int:
    """`value` as an int in 0..bound-1: a rank of `group` (group ranks) or of the job (global ranks)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= int(value) < bound:
        where = (f"the group of ranks {list(group.ranks)} (group ranks 0..{bound - 1})" if group is not None
                 else f"the job (ranks 0..{bound - 1})")
        raise ConfigError(f"tfdist.comm.{what}: {parameter}={value!r} is not a rank of {where}.")
    return int(value)


def check_divisible(x: tf.Tensor, group: Group, what: str, parameter: str = "x") -> None:
    """ConfigError unless `x`'s first dimension (when known) is a multiple of the group size."""
    first = x.shape[0] if x.shape.rank else None
    if x.shape.rank == 0 or (first is not None and first % group.size):
        raise ConfigError(f"tfdist.comm.{what}: {parameter} has shape {tuple(x.shape)}; its first dimension must be "
                          f"a multiple of the group size {group.size}.")


def parse_like(like: object, what: str) -> tuple[tf.DType, tf.TensorShape | None]:
    """(dtype, shape or None) of `like`: a dtype, a tf.TensorSpec (None dimensions match any size) or a tensor."""
    if like is None:
        raise ConfigError(f"tfdist.comm.{what}: say what arrives with like=: a dtype (tf.float32, 'int64'), a "
                          "tf.TensorSpec (e.g. tf.TensorSpec([None, 2], tf.float32)) or a tensor of that dtype.")
    try:
        if isinstance(like, (tf.DType, str, type, np.dtype)):
            dtype, shape = tf.as_dtype(like), None
        elif isinstance(like, tf.TensorSpec):
            dtype, shape = like.dtype, like.shape
        else:
            t = tf.convert_to_tensor(like)
            dtype, shape = t.dtype, t.shape
    except (TypeError, ValueError):
        raise ConfigError(f"tfdist.comm.{what}: like must be a dtype (tf.float32, 'int64'), a tf.TensorSpec or a "
                          f"tensor, got {like!r}.") from None
    check_numeric(dtype, "like", what)
    return dtype, shape
