"""A time bound on eager collectives that fails them cleanly.

A collective whose peer does not take part must fail after `timeout_s`, not hang. TensorFlow's own bound, an op's
`timeout_seconds`, can kill the process instead of raising when it fires while the peer is alive (TF 2.21: the op
completes at once, and its cancelled receive later touches the op's freed cancellation manager; see
docs/design.md, "Multi-worker"). So an eager collective is created without TF's timeout (`op_timeout`) and
run under `bounded`, whose timer aborts this process's collectives: the same DeadlineExceededError, raised after
the pending receive has let go. Inside a tf.function there is no Python around each op, so traced ops keep TF's
own `timeout_seconds`.

Example:
    >>> bounded(60.0, lambda: tf.raw_ops.CollectiveReduceV2(..., timeout_seconds=op_timeout(60.0)))
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import tensorflow as tf

from tfdist._compat import distribute as tf_distribute
from tfdist._compat import tf_runtime

__all__ = ["bounded", "launched", "op_timeout"]

T = TypeVar("T")


def op_timeout(timeout_s: float | None) -> float | None:
    """The `timeout_seconds` for a collective op created now: none when eager (`bounded` keeps the bound),
    `timeout_s` while a tf.function is traced."""
    if timeout_s is None:
        return None
    return 0.0 if tf.executing_eagerly() else float(timeout_s)


def bounded(timeout_s: float | None, run: Callable[[], T]) -> T:
    """`run()`; if it has not returned after `timeout_s` seconds, every collective of this process is aborted and
    a DeadlineExceededError raised (also when `run` finished just as the timer fired: collectives are unusable
    after an abort, so the caller hears it now). Outside eager execution, or with no bound, just `run()`."""
    if not timeout_s or not tf.executing_eagerly():
        return run()
    lock = threading.Lock()
    state = {"finished": False, "aborted": False}
    message = f"tfdist: a collective waited longer than timeout_s={timeout_s:g} for its peers"

    def expire() -> None:
        with lock:
            if state["finished"]:
                return
            state["aborted"] = True
        tf_runtime.abort_collectives(message)

    timer = threading.Timer(float(timeout_s), expire)
    timer.daemon = True
    timer.start()
    try:
        result = run()
    finally:
        with lock:
            state["finished"] = True
        timer.cancel()
    if state["aborted"]:
        raise tf.errors.DeadlineExceededError(None, None, message)
    return result


def launched(collective: Callable[..., T], launcher, tensor: tf.Tensor) -> T:
    """`collective(launcher, tensor, timeout_s=...)`, one of `_compat.distribute`'s `launcher_*` ops, under the
    launcher's own timeout: bounded as above when eager, TF's `timeout_seconds` when traced.

    Example:
        >>> launched(launcher_all_gather, launcher, tf.constant([[1, 2]]))
    """
    timeout_s = tf_distribute.launcher_timeout(launcher)
    return bounded(timeout_s, lambda: collective(launcher, tensor, timeout_s=op_timeout(timeout_s)))
