"""Worker faults: name the lost task in one clear line instead of a deep TF traceback; never hang at start-up."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from collections.abc import Iterator

from tfdist.comm.tf_config import ClusterConfig
from tfdist.errors import TfdistError, troubleshooting

__all__ = ["WorkerLostError", "add_lost_peer_namer", "install_excepthook", "lost_worker_error", "startup_watchdog"]

_TASK = re.compile(r"/job:(\w+)/replica:\d+/task:(\d+)")
_ADDRESS = re.compile(r"(?:ipv4:|ipv6:|//)?\[?([\w.:-]+?)\]?:(\d{2,5})\b")
# Phrases of TF errors that mean "a peer is gone", as opposed to a bug in the user's model.
_PEER_GONE = ("Collective ops is aborted", "Connection reset", "failed to connect", "Socket closed",
              "heartbeat", "Deadline Exceeded", "DEADLINE_EXCEEDED", "timed out", "unavailable", "UNAVAILABLE")
# What the error of a task whose heartbeat to the coordination leader timed out contains.
_LEADER_HEARTBEAT = "CoordinationService/Heartbeat"


class WorkerLostError(TfdistError, RuntimeError):
    """Another worker of the job died or stopped answering; this worker cannot continue."""


def lost_worker_error(err: BaseException, config: ClusterConfig | None) -> WorkerLostError | None:
    """A WorkerLostError naming the lost task if `err` is TF's way of saying a peer is gone, else None.

    Example:
        >>> try:
        ...     model.fit(...)
        ... except tf.errors.OpError as err:
        ...     raise lost_worker_error(err, strategy.cluster_config) or err
    """
    import tensorflow as tf

    if config is None or not isinstance(err, tf.errors.OpError):
        return None
    text = getattr(err, "message", str(err))
    if not any(p.lower() in text.lower() for p in _PEER_GONE):
        return None
    lost = _lost_task(text, config)
    cause = next((p for p in _PEER_GONE if p.lower() in text.lower()), "collective failed")
    where = f"lost {lost}" if lost else "lost contact with another worker"
    return WorkerLostError(
        f"worker {config.task_name} {where} ({cause}; {type(err).__name__}). The job cannot continue: restart "
        "all workers (with tfdist.training.BackupAndRestore, training resumes from the last finished epoch)."
        + troubleshooting("a-worker-was-lost"))


def _lost_task(text: str, config: ClusterConfig) -> str | None:
    own = config.task_name
    for job, index in _TASK.findall(text):
        name = f"/job:{job}/replica:0/task:{index}"
        if name != own and job in config.cluster and int(index) < len(config.cluster[job]):
            return f"{name} ({config.cluster[job][int(index)]})"
    ports = {addr.rpartition(":")[2]: (job, i, addr) for job, i, addr in config.peers()}
    for _, port in _ADDRESS.findall(text):
        if port in ports:
            job, i, addr = ports[port]
            return f"/job:{job}/replica:0/task:{i} ({addr})"
    if _LEADER_HEARTBEAT in text:
        # Every task heartbeats to the coordination leader only: this task's heartbeat RPC timing out
        # ("Deadline Exceeded ... RPC: /tensorflow.CoordinationService/Heartbeat", no task named) means
        # the leader is silent (stopped, hung or unreachable), e.g. worker 0 stopped with SIGSTOP.
        job = "chief" if "chief" in config.cluster else "worker"
        if (job, 0) != (config.task_type, config.task_index):
            return f"/job:{job}/replica:0/task:0 ({config.cluster[job][0]}, the coordination leader)"
    return None


# The hook this process installed, and the cluster it names: installed once, however many
# strategies are created; a later call only changes which cluster the hook names.
_HOOK: dict = {"installed": False, "config": None, "namers": []}
_HOOK_LOCK = threading.Lock()


def install_excepthook(config: ClusterConfig | None) -> None:
    """Makes an uncaught "peer is gone" error print one clear line naming the lost task (exit code 1).

    Any other uncaught exception goes to the hook that was there before. Installed once per process;
    calling it again (every MultiWorkerMirroredStrategy does) only replaces `config`.
    """
    with _HOOK_LOCK:
        _HOOK["config"] = config
    _install()


def add_lost_peer_namer(namer) -> None:
    """Adds `namer(exception) -> WorkerLostError | None` to the uncaught-exception hook (e.g. Horovod's, which
    probes its peers); once per namer."""
    with _HOOK_LOCK:
        if namer not in _HOOK["namers"]:
            _HOOK["namers"].append(namer)
    _install()


def _install() -> None:
    with _HOOK_LOCK:
        if _HOOK["installed"]:
            return
        previous = sys.excepthook

        def hook(exc_type, exc, tb):
            lost = None
            if exc is not None:
                lost = lost_worker_error(exc, _HOOK["config"])
                for namer in _HOOK["namers"]:
                    lost = lost or namer(exc)
            if lost is None:
                return previous(exc_type, exc, tb)
            print(f"tfdist: error: {lost}", file=sys.stderr, flush=True)

        sys.excepthook = hook
        _HOOK["installed"] = True


@contextlib.contextmanager
def startup_watchdog(timeout_s: float, describe) -> Iterator[None]:
    """Ends the process with a clear message if the block has not finished after `timeout_s`.

    Last resort for waits inside TensorFlow's C++ runtime that no Python exception can interrupt
    (the coordination leader waits for missing peers without a deadline): `describe()` returns the
    message, printed to stderr before exiting with code 1.
    """
    done = threading.Event()

    def watch():
        if not done.wait(timeout_s):
            print(f"tfdist: error: {describe()}", file=sys.stderr, flush=True)
            os._exit(1)

    threading.Thread(target=watch, daemon=True, name="tfdist-startup-watchdog").start()
    try:
        yield
    finally:
        done.set()
