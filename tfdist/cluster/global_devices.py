"""Every device of a multi-process job, named by process: the device list of a mesh that spans processes."""

from __future__ import annotations

import os
from collections.abc import Mapping

from tfdist.comm.launch_env import LOCAL_DEVICES_ENV, launcher_of, local_device_count
from tfdist.comm.tf_config import MULTI_WORKER_JOBS, tf_config_from_env
from tfdist.errors import ConfigError

__all__ = ["list_devices"]


def list_devices(device_type: str = "CPU", devices_per_process: int | None = None,
                 environ: Mapping[str, str] | None = None) -> list[str]:
    """The devices of every process of this job, as `keras.distribution.list_devices()` gives them on JAX:
    process by process (the chief first, then workers in TF_CONFIG order), local devices in order, each named
    '/job:worker/replica:0/task:T/device:CPU:I'. Reads TF_CONFIG and TFDIST_LOCAL_DEVICES (what `tfdist launch -n N
    --devices-per-worker M` sets) without starting TensorFlow; a process without TF_CONFIG gets its own local
    names ('/device:CPU:0', ...) (so does a cluster of one), so one script runs alone or launched. Under a
    Horovod/MPI launcher of N > 1 processes (horovodrun, mpirun, `tfdist launch --backend horovod`) without
    TF_CONFIG, process T is Horovod rank T: the same names, for `ModelParallelStrategy(backend="horovod")`.

    Args:
        device_type: 'CPU' (logical CPUs) or 'GPU'.
        devices_per_process: M; None reads TFDIST_LOCAL_DEVICES.

    Example (each of 2 processes started by `tfdist launch -n 2 --devices-per-worker 2`):
        >>> tfdist.cluster.list_devices()
        ['/job:worker/replica:0/task:0/device:CPU:0', '/job:worker/replica:0/task:0/device:CPU:1',
         '/job:worker/replica:0/task:1/device:CPU:0', '/job:worker/replica:0/task:1/device:CPU:1']
        >>> mesh = tfdist.DeviceMesh((2, 2), ("batch", "model"), tfdist.cluster.list_devices())
    """
    env = os.environ if environ is None else environ
    kind = str(device_type).upper()
    if kind not in ("CPU", "GPU"):
        raise ConfigError(f"list_devices: device_type must be 'CPU' or 'GPU', got {device_type!r}.")
    count = local_device_count(env) if devices_per_process is None else devices_per_process
    if count is None:
        raise ConfigError(f"list_devices: how many devices each process has is unknown: {LOCAL_DEVICES_ENV} is not "
                          "set. Start the processes with `tfdist launch -n N --devices-per-worker M`, or pass "
                          "devices_per_process=M.")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError(f"list_devices: devices_per_process must be a whole number >= 1, got {count!r}.")
    config = tf_config_from_env(env)
    if config is None or config.num_workers == 1:
        ranks = _horovod_size(env) if config is None else 1
        if ranks > 1:  # a Horovod/MPI job: process r is Horovod rank r (ModelParallelStrategy(backend="horovod"))
            return [f"/job:worker/replica:0/task:{t}/device:{kind}:{i}" for t in range(ranks) for i in range(count)]
        return [f"/device:{kind}:{i}" for i in range(count)]
    return [f"/job:{job}/replica:0/task:{t}/device:{kind}:{i}" for job in MULTI_WORKER_JOBS
            for t in range(len(config.cluster.get(job, []))) for i in range(count)]


def _horovod_size(env: Mapping[str, str]) -> int:
    """Processes of the Horovod/MPI job that started this process (its launcher's size variable), else 1."""
    launcher = launcher_of(env, mpi_world=True)
    raw = env.get(launcher.size_var, "").strip() if launcher is not None and launcher.size_var else ""
    return int(raw) if raw.isdigit() else 1
