"""Every reach into TensorFlow and Keras private internals, in one place, behind a version check."""

from __future__ import annotations

import itertools
import warnings

import keras
import tensorflow as tf

# Versions this module was written and tested against. A TF or Keras upgrade should only have to
# revisit this file: every `tensorflow.python.*` / `keras.src.*` import in tfdist lives here.
TESTED_TF = ("2.21",)
TESTED_KERAS_MAJOR = 3


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


if _major_minor(tf.__version__) not in TESTED_TF:
    warnings.warn(
        f"tfdist was tested with TensorFlow {', '.join(TESTED_TF)}; found {tf.__version__}. "
        "Private TF internals used by tfdist (tfdist/compat.py) may have moved.",
        RuntimeWarning,
        stacklevel=2,
    )
if int(keras.__version__.split(".")[0]) != TESTED_KERAS_MAJOR:
    raise ImportError(
        f"tfdist needs Keras 3 (the default tf.keras of TF 2.16+); found keras {keras.__version__}. "
        "Install it with: pip install 'keras>=3.15'"
    )


# --- Collective keys -------------------------------------------------------------------------
# MirroredExtended numbers its collective groups from `container_strategy._collective_key_base`.
# Every stock MirroredStrategy starts at 0, so two strategies over different device sets in one
# process join the same group and fail ("joining a group with size 2, but that group has size 4").
# Giving each tfdist strategy its own base keeps them apart (TF's own tests do the same).
_KEY_STRIDE = 100_000
_key_bases = itertools.count(start=_KEY_STRIDE, step=_KEY_STRIDE)


def fresh_collective_key_base() -> int:
    """Returns a collective key base no other tfdist strategy in this process uses."""
    return next(_key_bases)


# --- Multi-worker collectives (tfdist.MultiWorkerMirroredStrategy) ---------------------------
from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2 as _coordination_pb2  # noqa: E402
from tensorflow.python.distribute import collective_all_reduce_strategy as _collective_strategy  # noqa: E402
from tensorflow.python.eager import context as _eager_context  # noqa: E402


def tf_context_initialized() -> bool:
    """True once TensorFlow has created its runtime (device list fixed, collectives no longer configurable)."""
    return bool(_eager_context.context()._initialized)


def configure_coordination(leader: str, jobs: dict[str, int], *, register_timeout_s: float,
                           heartbeat_timeout_s: float, shutdown_timeout_s: float) -> None:
    """Turns on TF's coordination service with our timeouts, before MWMS would with its defaults.

    MWMS configures the service itself only when none is configured, with TF's defaults: a peer that
    never starts is waited for indefinitely (registration timeout off), and a dead peer is noticed only
    after the default heartbeat timeout. `register_timeout_s` bounds the wait for all tasks at start-up;
    `heartbeat_timeout_s` is how long a silent task counts as alive; both errors name the task.
    """
    coordinated = [_coordination_pb2.CoordinatedJob(name=job, num_tasks=n) for job, n in jobs.items()]
    _eager_context.context().configure_coordination_service(
        service_type="standalone", service_leader=leader, enable_health_check=True,
        cluster_register_timeout_in_ms=int(register_timeout_s * 1000),
        heartbeat_timeout_in_ms=int(heartbeat_timeout_s * 1000),
        shutdown_barrier_timeout_in_ms=int(shutdown_timeout_s * 1000),
        coordinated_jobs=coordinated)


class CollectiveExtended(_collective_strategy.CollectiveAllReduceExtended):
    """MWMS's StrategyExtended with a chosen set of local devices per worker.

    Stock MWMS takes every GPU of a worker, or else one CPU, so N workers x M logical CPUs is out of
    reach. `local_device_type`/`local_indices` name the devices each worker contributes; the worker
    prefix (/job:worker/task:i) is added by TF. None keeps TF's choice.
    """

    def __init__(self, container_strategy, cluster_resolver, communication_options,
                 local_device_type: str | None = None, local_indices: tuple[int, ...] | None = None):
        self._tfdist_local = (local_device_type, local_indices)
        super().__init__(container_strategy, cluster_resolver=cluster_resolver,
                         communication_options=communication_options)

    def _initialize_local_devices(self, cluster_resolver, worker_device):
        kind, indices = self._tfdist_local
        if kind is None:
            return super()._initialize_local_devices(cluster_resolver, worker_device)
        return tuple(f"{worker_device}/device:{kind}:{i}" for i in indices), kind


def strategy_task(strategy) -> tuple[str | None, int | None, int]:
    """(task_type, task_id, number of workers) of a MultiWorkerMirroredStrategy; (None, None, 1) if local."""
    ext = strategy.extended
    return getattr(ext, "_task_type", None), getattr(ext, "_task_id", None), getattr(ext, "_num_workers", 1)


def set_initial_epoch(model: keras.Model, epoch: int) -> None:
    """Makes the next `fit` start at `epoch` (what keras.callbacks.BackupAndRestore does on restore)."""
    model._initial_epoch = epoch
