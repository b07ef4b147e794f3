"""Local devices: logical CPUs for multi-replica runs without accelerators, and device-list checks."""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from tfdist.errors import ConfigError, InitOrderError

__all__ = ["virtual_cpus", "local_devices", "resolve_devices"]


def virtual_cpus(n: int) -> list[str]:
    """Splits the host CPU into `n` logical devices and returns their names.

    Call it first, before any TensorFlow op, model or strategy is created: TensorFlow fixes its
    device list when it initialises. Calling it again with the same `n` is harmless.

    Example:
        >>> import tfdist
        >>> tfdist.devices.virtual_cpus(4)
        ['/device:CPU:0', '/device:CPU:1', '/device:CPU:2', '/device:CPU:3']
        >>> strategy = tfdist.MirroredStrategy()  # 4 replicas on one CPU
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"virtual_cpus: n must be a whole number >= 1, got {n!r}.")
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if current is not None and len(current) == n:
        return _cpu_names(n)
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)
    except RuntimeError as err:
        have = len(tf.config.list_logical_devices("CPU"))
        raise InitOrderError(
            f"virtual_cpus({n}): TensorFlow is already initialised with {have} logical CPU(s), and "
            "its device list cannot change afterwards. Call tfdist.devices.virtual_cpus(n) at the "
            "top of the program (in a notebook: the first cell after a kernel restart), before any "
            "tensor, model or strategy is created."
        ) from err
    return _cpu_names(n)


def _cpu_names(n: int) -> list[str]:
    return [f"/device:CPU:{i}" for i in range(n)]


def local_devices() -> list[str]:
    """The devices a strategy uses by default: every local GPU, else every logical CPU."""
    gpus = tf.config.list_logical_devices("GPU")
    devices = gpus or tf.config.list_logical_devices("CPU")
    return [d.name for d in devices]


def resolve_devices(devices: Sequence[str] | None, *, parameter: str = "devices") -> list[str]:
    """Checks a user's device list against this machine and returns canonical names.

    Raises ConfigError naming `parameter` for an empty list, a malformed or absent device, or a
    duplicate, listing the devices that do exist.
    """
    if devices is None:
        return local_devices()
    if isinstance(devices, str) or not isinstance(devices, Sequence):
        raise ConfigError(f"{parameter} must be a list of device names such as ['/gpu:0', '/gpu:1'], got {devices!r}.")
    if not devices:
        raise ConfigError(f"{parameter} is empty; pass at least one device, or None for all local devices.")
    available = {_canonical(d.name): d.name for d in tf.config.list_logical_devices()}
    resolved: list[str] = []
    for name in devices:
        try:
            key = _canonical(name)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"{parameter}: {name!r} is not a device name ({err}). "
                              f"Use names like '/gpu:0' or '/cpu:1'.") from None
        if key not in available:
            hint = ("" if tf.config.list_logical_devices("GPU") else
                    " On a machine without accelerators, call tfdist.devices.virtual_cpus(n) first "
                    "to get n logical CPUs.")
            raise ConfigError(f"{parameter}: no device {name!r} on this machine; available: "
                              f"{sorted(available.values())}.{hint}")
        if available[key] in resolved:
            raise ConfigError(f"{parameter}: {name!r} is listed twice; each replica needs its own device.")
        resolved.append(available[key])
    return resolved


def _canonical(name: str) -> tuple[str, int]:
    spec = tf.DeviceSpec.from_string(name)
    if spec.device_type is None:
        raise ValueError("no device type")
    if spec.job not in (None, "localhost"):
        raise ValueError(f"job {spec.job!r} is not this process; remote devices need "
                         "tfdist.MultiWorkerMirroredStrategy")
    return spec.device_type.upper(), spec.device_index or 0
