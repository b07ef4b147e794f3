"""Starting TF's collectives between the processes of a TF_CONFIG cluster, with a deadline.

A stock MultiWorkerMirroredStrategy over the cluster starts this process's gRPC server and enables
collective ops (public API; `_compat.distribute.collective_server` gives its own groups keys in
tfdist.comm's range). TF's coordination service is configured first with `timeout_s`, and the first
task waits for the others' ports, so a peer that never comes is an error, not an endless wait.

Example (on every process of a 2-worker TF_CONFIG):
    >>> server = start_server(parse_tf_config(os.environ["TF_CONFIG"]), timeout_s=60)
"""

from __future__ import annotations

import socket
import time

import tensorflow as tf

from tfdist._compat import distribute as tf_distribute
from tfdist._compat import tf_runtime
from tfdist.comm.tf_config import ClusterConfig
from tfdist.errors import ConfigError, InitOrderError

__all__ = ["start_server"]


def start_server(config: ClusterConfig, timeout_s: float) -> tf.distribute.Strategy:
    """Starts the server of `config`'s task and joins the cluster (every task calls it); returns the
    object that keeps the server alive."""
    if tf_runtime.context_initialized():
        raise InitOrderError(
            "tfdist.comm.init(backend='tf') must run before TensorFlow initialises (before any tensor, "
            "model or dataset): collective ops are configured at program start. Call it first thing.")
    cluster = config.cluster
    leader = "chief" if "chief" in cluster else "worker"
    tf_runtime.configure_coordination(
        f"/job:{leader}/replica:0/task:0", {job: len(tasks) for job, tasks in cluster.items()},
        register_timeout_s=timeout_s, heartbeat_timeout_s=min(timeout_s, 30.0), shutdown_timeout_s=timeout_s)
    if config.rank == 0:  # the coordination leader would wait for absent peers without a deadline
        _wait_for_ports([address for _, _, address in config.peers()], timeout_s)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type=config.task_type, task_id=config.task_index, rpc_layer="grpc")
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout_s)
    return tf_distribute.collective_server(resolver, options)


def _wait_for_ports(addresses: list[str], timeout_s: float) -> None:
    """Waits until every address accepts TCP connections; ConfigError naming the silent ones after timeout_s."""
    deadline = time.monotonic() + timeout_s
    pending = list(addresses)
    while pending:
        pending = [a for a in pending if not _port_open(a)]
        if pending and time.monotonic() > deadline:
            raise ConfigError(f"tfdist.comm.init: within timeout_s={timeout_s:g} s no process answered at "
                              f"{', '.join(pending)}. Start every process of the cluster (e.g. `tfdist launch -n "
                              f"{len(addresses) + 1} -- python script.py`), check TF_CONFIG, or raise timeout_s.")
        if pending:
            time.sleep(0.2)


def _port_open(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=0.5):
            return True
    except OSError:
        return False
