"""Device names of a mesh that spans processes: "/job:worker/replica:0/task:1/device:CPU:0" (Keras-on-JAX lists
global devices the same way, `keras.distribution.list_devices()`; `tfdist.cluster.list_devices()` builds them)."""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from tfdist.errors import ConfigError

__all__ = ["canonical_task_devices", "local_name", "names_a_task", "task_of"]


def names_a_task(name: str) -> bool:
    """True for a device name with a job other than this process's 'localhost' (a device of some process)."""
    try:
        job = tf.DeviceSpec.from_string(str(name)).job
    except (ValueError, TypeError):
        return False
    return job not in (None, "localhost")


def canonical_task_devices(devices: Sequence[str], parameter: str = "devices") -> list[str]:
    """"/job:J/replica:0/task:T/device:KIND:I" for each name (checked, without touching TF's runtime): every name
    must give its job, task, device type and index, and none may repeat."""
    out: list[str] = []
    for name in devices:
        try:
            spec = tf.DeviceSpec.from_string(str(name))
        except (ValueError, TypeError) as err:
            raise ConfigError(f"{parameter}: {name!r} is not a device name ({err}).") from None
        kind = (spec.device_type or "").upper()
        if spec.job in (None, "localhost") or spec.task is None or kind not in ("CPU", "GPU"):
            raise ConfigError(f"{parameter}: {name!r} does not name a process's device; a mesh across processes "
                              "lists every device as '/job:worker/replica:0/task:T/device:CPU:I' (or GPU), e.g. "
                              "from tfdist.cluster.list_devices(), or only local names ('/cpu:0') for one process.")
        canonical = (f"/job:{spec.job}/replica:{spec.replica or 0}/task:{spec.task}"
                     f"/device:{kind}:{spec.device_index or 0}")
        if canonical in out:
            raise ConfigError(f"{parameter}: {name!r} is listed twice; each mesh position needs its own device.")
        out.append(canonical)
    return out


def task_of(device: str) -> tuple[str, int]:
    """(job, task index) of a canonical task-qualified device name."""
    spec = tf.DeviceSpec.from_string(device)
    return spec.job, int(spec.task)


def local_name(device: str) -> str:
    """The name inside its own process: '/device:CPU:1'."""
    spec = tf.DeviceSpec.from_string(device)
    return f"/device:{spec.device_type.upper()}:{spec.device_index or 0}"
