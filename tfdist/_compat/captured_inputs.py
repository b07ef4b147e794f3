"""Tensors a `tf.custom_gradient` block reads by closure but must still differentiate.

`tf.custom_gradient` returns gradients for its explicit inputs and the variables read inside only: a tensor
the block captures (e.g. a weight all-gathered by ZeRO stage 3 and bound to a Keras variable through a
`keras.StatelessScope`) gets no gradient from it. A caller that binds such tensors pushes them here while the
blocks are built (`differentiable_captures`), and a block that places ops itself (tensor parallelism's
`on_device`) passes `captured_inputs()` as extra inputs, so their gradients flow out of it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import tensorflow as tf

__all__ = ["captured_inputs", "differentiable_captures"]

_local = threading.local()  # each replica builds its step in its own thread


def _stack() -> list:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


@contextlib.contextmanager
def differentiable_captures(tensors: Sequence[tf.Tensor]) -> Iterator[None]:
    """While inside, `captured_inputs()` returns `tensors` (in this thread).

    Example:
        >>> with differentiable_captures([w]):
        ...     assert captured_inputs() == [w]
    """
    _stack().append([t for t in tensors if tf.is_tensor(t)])
    try:
        yield
    finally:
        _stack().pop()


def captured_inputs() -> list[tf.Tensor]:
    """The tensors of the innermost `differentiable_captures` (floating ones only), or []."""
    stack = _stack()
    return [t for t in stack[-1] if t.dtype.is_floating] if stack else []
