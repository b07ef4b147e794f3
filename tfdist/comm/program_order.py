"""Collectives inside a tf.function: run in program order, and run even when nobody reads them."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import tensorflow as tf

__all__ = ["ProgramOrder"]


class ProgramOrder:
    """Creates each collective of a function graph with a control dependency on the previous one of
    that graph, and with a stateful op that depends on it.

    - Order: TF's broadcast ops are exempt from tf.function's automatic ordering of stateful ops, and
      Horovod's ops are not stateful at all; unordered collectives can deadlock (two processes each
      waiting in a different one) or pair up differently across processes.
    - Liveness: a collective whose result is unused (a send, a barrier) would be pruned by tf.function
      and Grappler, leaving its peers waiting. The keeper is an `Assert` (stateful, so tf.function runs
      it) that reads the collective's first element. It must read data: Grappler turns a stateless op
      (Horovod's) that is only a control input into a NoOp, which skips the collective on that process
      and hangs or misorders the others. One element keeps the copy to the host small on GPUs.

    Eager calls run in program order anyway; then `order(make)` is just `make()`.

    Example:
        >>> order = ProgramOrder()
        >>> @tf.function
        ... def step(x):
        ...     a = order(lambda: hvd.allreduce(x, name="a"))     # runs first on every process
        ...     order(lambda: hvd.broadcast(x, 0, name="b"))      # runs, though unused
        ...     return a
    """

    def __init__(self) -> None:
        self._last: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> last collective

    def __call__(self, make: Callable[[], tf.Tensor]) -> tf.Tensor:
        if tf.executing_eagerly():
            return make()
        graph = tf.compat.v1.get_default_graph()
        last = self._last.get(graph)
        with tf.control_dependencies([last] if last is not None else []):
            out = make()
        tf.raw_ops.Assert(condition=tf.constant(True), data=[tf.reshape(out, [-1])[:1]], summarize=1)
        self._last[graph] = out
        return out
