"""Forming a multi-worker cluster: wait for the peers named in TF_CONFIG, or say which ones never came."""

from __future__ import annotations

import re
import socket
import time

from tfdist.comm.tf_config import ClusterConfig, parse_tf_config, tf_config_from_env
from tfdist.errors import ConfigError, troubleshooting

__all__ = ["cluster_config_of", "port_open", "silent_after", "startup_error", "wait_for_peers"]

# What TF says when this task's gRPC server cannot bind its port.
_PORT_TAKEN = ("Could not start gRPC server", "ddress already in use")


def cluster_config_of(resolver) -> ClusterConfig | None:
    """The checked cluster of a `tf.distribute.cluster_resolver.ClusterResolver`, or of TF_CONFIG when
    `resolver` is None; None for a single local worker."""
    if resolver is None:
        return tf_config_from_env()
    spec = resolver.cluster_spec().as_dict()
    if not spec:
        return None
    return parse_tf_config({"cluster": spec, "task": {"type": resolver.task_type, "index": resolver.task_id}})


def wait_for_peers(config: ClusterConfig, timeout_s: float) -> None:
    """Waits until every peer's port accepts connections; ConfigError naming the silent ones after `timeout_s`.

    Every worker starts its gRPC server before registering with the coordination leader, so a peer
    whose port stays closed for `timeout_s` never started: say so before TF's runtime waits.
    """
    pending = silent_after([addr for _, _, addr in config.peers()], timeout_s)
    if pending:
        raise startup_error(config, timeout_s, None, missing=pending)


def startup_error(config: ClusterConfig, timeout_s: float, err: Exception | None,
                  missing: list[str] | None = None) -> ConfigError:
    """The error of a cluster that did not form: which peers are not answering, and what to do."""
    if missing is None:
        missing = [addr for _, _, addr in config.peers() if not port_open(addr)]
    names = {addr: f"/job:{job}/replica:0/task:{i} at {addr}" for job, i, addr in config.peers()}
    who = f"; not answering: {', '.join(names[a] for a in missing)}" if missing else ""
    said = _first_line(err) if err else ""
    # TF binds every interface at the task's port: failing to start its server means that port is taken.
    port_taken = any(phrase in said for phrase in _PORT_TAKEN)
    return ConfigError(
        f"worker {config.task_name} ({config.address()}) could not form the cluster of "
        f"{config.num_workers} workers within timeout_s={timeout_s:g} s{who}. Start every worker "
        f"listed in TF_CONFIG (e.g. with `tfdist launch -n {config.num_workers} -- ...`), check the "
        f"addresses, or raise timeout_s."
        + (f" This worker's own port ({config.address()}) is probably in use by another process." if port_taken else "")
        + troubleshooting("port-already-in-use" if port_taken else "a-peer-never-starts")
        + (f" TensorFlow said: {said}" if err else ""))


def _first_line(err: Exception) -> str:
    text = getattr(err, "message", None) or str(err)
    return re.sub(r"\s+", " ", text.strip())[:400]


def port_open(address: str, timeout_s: float = 0.5) -> bool:
    """True when something accepts TCP connections at 'host:port'."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


def silent_after(addresses: list, timeout_s: float, address_of=lambda a: a) -> list:
    """Polls until every address accepts connections or `timeout_s` passes; returns the ones still silent.

    `address_of(item)` gives the 'host:port' of each item (the items themselves by default)."""
    deadline = time.monotonic() + timeout_s
    pending = list(addresses)
    while pending and time.monotonic() < deadline:
        pending = [item for item in pending if not port_open(address_of(item))]
        if pending:
            time.sleep(0.2)
    return pending
