"""The process runtime: how a process joins a TF job, written once for every path that does.

`tfdist.comm.init(backend="tf")`, `tfdist.MultiWorkerMirroredStrategy` and a `tfdist.ModelParallelStrategy` whose
mesh spans processes all join the same way (`join_tf_job`):

1. TensorFlow must not have started yet: collective ops are configured at program start (InitOrderError).
2. TF's coordination service gets one timeout policy: registration and shutdown bounded by `timeout_s`, a peer
   silent for `heartbeat_s` (default min(timeout_s, 20 s)) counts as dead.
3. The coordination leader would wait for absent peers without a deadline, so it first waits for their ports
   itself and names the silent ones after `timeout_s`.
4. The server starts under a watchdog (TF's C++ waits cannot be interrupted from Python), and a failure to form
   the cluster is a ConfigError naming the peers that are not answering.
5. An uncaught "peer is gone" error later names the lost task in one line (`faults.install_excepthook`).

Horovod is joined through `tfdist.comm.horovod.init_horovod`, once per process.

Example (on every process of a 2-worker TF_CONFIG):
    >>> server = start_server(parse_tf_config(os.environ["TF_CONFIG"]), timeout_s=60)
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TypeVar

import tensorflow as tf

from tfdist._compat import distribute as tf_distribute
from tfdist._compat import tf_runtime
from tfdist.comm.faults import install_excepthook, startup_watchdog
from tfdist.comm.peers import startup_error, wait_for_peers
from tfdist.comm.tf_config import MULTI_WORKER_JOBS, ClusterConfig
from tfdist.errors import InitOrderError, troubleshooting

__all__ = ["DEFAULT_HEARTBEAT_S", "check_tf_not_started", "join_tf_job", "start_server"]

DEFAULT_HEARTBEAT_S = 20.0
T = TypeVar("T")
# The job this process joined (at most one: TensorFlow configures collectives and starts its server once).
_joined: list[ClusterConfig | None] = []


def check_tf_not_started(who: str, fix: str = "Call it first thing in the script.") -> None:
    """InitOrderError unless TensorFlow is still unstarted. `who` says what must come first and how, e.g.
    "tfdist.MultiWorkerMirroredStrategy must be created"."""
    if tf_runtime.context_initialized():
        raise InitOrderError(
            f"{who} before TensorFlow initialises (before any tensor, model, dataset or "
            f"tf.config.list_logical_devices() call): collective ops can only be configured at program start. {fix}"
            + troubleshooting("initordererror"))


def join_tf_job(config: ClusterConfig | None, start: Callable[[], T], *, timeout_s: float, who: str,
                heartbeat_s: float | None = None, fix: str = "Call it first thing in the script.") -> T:
    """Joins this process to the TF job `config` (None: a single local worker, nothing to join) and returns
    `start()`, which creates the gRPC server and collectives (a strategy's own extended class, or a bare server).

    Every process of the job calls it, first thing; `who` and `fix` name the caller in the InitOrderError. Once
    joined, a process may create further strategies over the same job (a notebook cell run again, several
    configurations in one script): `start()` then runs on the server already there, in the same order on every
    process, and the first join's heartbeat stays. Another job is refused: TensorFlow starts one server per process.
    """
    if config is not None and config.num_workers <= 1:
        config = None  # a single local worker, however it was described
    if _joined:
        if _joined[0] != config:
            raise InitOrderError(
                f"{who} over {_describe(config)}, but this process already joined {_describe(_joined[0])}: "
                "TensorFlow runs one cluster per process. Create the strategies of one script over one job "
                "(the same TF_CONFIG)." + troubleshooting("initordererror"))
        with _quiet_reenable():
            return start()
    check_tf_not_started(who, fix)
    if config is None:
        started = start()
        _joined.append(config)
        return started
    heartbeat_s = min(timeout_s, DEFAULT_HEARTBEAT_S) if heartbeat_s is None else float(heartbeat_s)
    leader = "chief" if "chief" in config.cluster else "worker"
    tf_runtime.configure_coordination(
        f"/job:{leader}/replica:0/task:0",
        {job: len(config.cluster[job]) for job in MULTI_WORKER_JOBS if job in config.cluster},
        register_timeout_s=timeout_s, heartbeat_timeout_s=heartbeat_s, shutdown_timeout_s=timeout_s)
    if config.is_chief:  # the coordination leader; the others are bounded by TF's register timeout
        wait_for_peers(config, timeout_s)
    with startup_watchdog(timeout_s + 15.0, lambda: str(startup_error(config, timeout_s, None))):
        try:
            started = start()
        except (tf.errors.OpError, RuntimeError) as err:
            raise startup_error(config, timeout_s, err) from None
    install_excepthook(config)
    _joined.append(config)
    return started


@contextlib.contextmanager
def _quiet_reenable():
    """Drops TensorFlow's warning that collectives enabled after start-up may break earlier tensors: it is about a
    process joining a cluster late; here the cluster and the server are the ones already running."""
    absl = logging.getLogger("absl")

    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Enabling collective ops after program startup")

    absl.addFilter(keep)
    try:
        yield
    finally:
        absl.removeFilter(keep)


def _describe(config: ClusterConfig | None) -> str:
    if config is None:
        return "a single local worker"
    addresses = ", ".join(a for job in MULTI_WORKER_JOBS for a in config.cluster.get(job, []))
    return f"a job of {config.num_workers} workers ({addresses}) as {config.task_type} {config.task_index}"


def start_server(config: ClusterConfig, timeout_s: float, *, who: str = "tfdist.comm.init(backend='tf') must run",
                 fix: str = "Call it first thing in the script.") -> tf.distribute.Strategy:
    """Joins the job and starts a bare collective server for `config`'s task (collective keys in tfdist.comm's
    range); returns the object that keeps the server alive."""
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(config.cluster), task_type=config.task_type, task_id=config.task_index, rpc_layer="grpc")
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout_s)
    return join_tf_job(config, lambda: tf_distribute.collective_server(resolver, options), timeout_s=timeout_s,
                       who=who, fix=fix)
