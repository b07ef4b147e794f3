"""Local devices: logical CPUs for multi-replica runs without accelerators, and the one device-list resolver."""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from tfdist.errors import ConfigError, InitOrderError, troubleshooting

__all__ = ["virtual_cpus", "local_devices", "resolve_devices", "process_devices", "kind_and_indices"]

_KINDS = ("GPU", "CPU")


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
        return _names("CPU", range(n))
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)
    except RuntimeError as err:
        have = len(tf.config.list_logical_devices("CPU"))
        raise InitOrderError(
            f"virtual_cpus({n}): TensorFlow is already initialised with {have} logical CPU(s), and "
            "its device list cannot change afterwards. Call tfdist.devices.virtual_cpus(n) at the "
            "top of the program (in a notebook: the first cell after a kernel restart), before any "
            "tensor, model or strategy is created." + troubleshooting("initordererror")
        ) from err
    return _names("CPU", range(n))


def local_devices() -> list[str]:
    """The devices a strategy uses by default: every local GPU, else every logical CPU."""
    counts = _available()
    kind = "GPU" if counts["GPU"] else "CPU"
    return _names(kind, range(counts[kind]))


def resolve_devices(devices: Sequence[str] | None, *, parameter: str = "devices") -> list[str]:
    """Checks a user's device list against this machine and returns canonical names (None: all local).

    Raises ConfigError naming `parameter` for an empty list, a malformed or absent device, or a
    duplicate, listing the devices that do exist.
    """
    if devices is None:
        return local_devices()
    return _check_names(devices, parameter, allow_count=False)


def process_devices(spec: int | Sequence[str] | None, *, parameter: str = "local_devices",
                    local_rank: int = 0) -> list[str]:
    """The devices one process of a multi-process job trains on, without initialising TensorFlow.

    `spec` is None (every GPU, else every configured logical CPU), a count M (GPUs
    local_rank*M .. local_rank*M + M-1, one process per GPU set as Horovod does; on a machine
    without GPUs, M logical CPUs) or a list of device names (checked against the machine).

    Example:
        >>> process_devices(2)          # no GPUs: the CPU split into 2 logical devices
        ['/device:CPU:0', '/device:CPU:1']
    """
    if spec is None:
        return local_devices()
    if isinstance(spec, int) and not isinstance(spec, bool):
        if spec < 1:
            raise ConfigError(f"{parameter} must be a whole number >= 1, got {spec}.")
        counts = _available()
        gpus = counts["GPU"]
        if gpus:
            first = local_rank * spec
            if first + spec > gpus:
                raise ConfigError(f"{parameter}={spec}: local rank {local_rank} wants GPUs {first}..{first + spec - 1} "
                                  f"but this machine has {gpus} GPU(s).")
            return _names("GPU", range(first, first + spec))
        if spec == 1 or (spec <= counts["CPU"] and _initialised()):
            return _names("CPU", range(spec))  # already there: the first `spec` logical CPUs
        return virtual_cpus(spec)
    return _check_names(spec, parameter, allow_count=True)


def kind_and_indices(names: Sequence[str]) -> tuple[str, tuple[int, ...]]:
    """('CPU' or 'GPU', device indices) of a checked list of local device names of one type."""
    specs = [tf.DeviceSpec.from_string(n) for n in names]
    return specs[0].device_type.upper(), tuple(s.device_index or 0 for s in specs)


def _check_names(devices, parameter: str, *, allow_count: bool) -> list[str]:
    if isinstance(devices, str) or not isinstance(devices, Sequence):
        what = "None, a count, or a list of names" if allow_count else "a list of device names"
        raise ConfigError(f"{parameter} must be {what} such as ['/gpu:0', '/gpu:1'] or ['/cpu:0', '/cpu:1'], "
                          f"got {devices!r}.")
    if not devices:
        raise ConfigError(f"{parameter} is empty; pass at least one device, or None for all local devices.")
    counts = _available()
    resolved: list[str] = []
    for name in devices:
        try:
            spec = tf.DeviceSpec.from_string(name)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"{parameter}: {name!r} is not a device name ({err}). "
                              "Use names like '/gpu:0' or '/cpu:1'.") from None
        if spec.job not in (None, "localhost"):
            raise ConfigError(f"{parameter}: {name!r} names job {spec.job!r}, not this process; remote devices "
                              "need tfdist.MultiWorkerMirroredStrategy.")
        kind = (spec.device_type or "").upper()
        if kind not in _KINDS:
            raise ConfigError(f"{parameter}: {name!r} is not a local device name; use e.g. '/cpu:1' or '/gpu:0'.")
        index = spec.device_index or 0
        if index >= counts[kind]:
            have = [n for k in _KINDS for n in _names(k, range(counts[k]))]
            hint = ("" if counts["GPU"] else " On a machine without accelerators, call "
                    "tfdist.devices.virtual_cpus(n) first to get n logical CPUs.")
            raise ConfigError(f"{parameter}: no device {name!r} on this machine; available: {have}.{hint}")
        canonical = _names(kind, [index])[0]
        if canonical in resolved:
            raise ConfigError(f"{parameter}: {name!r} is listed twice; each replica needs its own device.")
        resolved.append(canonical)
    kinds = {tf.DeviceSpec.from_string(n).device_type for n in resolved}
    if len(kinds) > 1:
        raise ConfigError(f"{parameter} mixes device types {sorted(kinds)}; use one type of device per process.")
    return resolved


def _available() -> dict[str, int]:
    """Logical devices per type, read from the device configuration (does not initialise TensorFlow)."""
    counts = {}
    for kind in _KINDS:
        n = 0
        for device in tf.config.list_physical_devices(kind):
            logical = tf.config.get_logical_device_configuration(device)
            n += len(logical) if logical else 1
        counts[kind] = n
    return counts


def _initialised() -> bool:
    from tfdist._compat import tf_runtime

    return tf_runtime.context_initialized()


def _names(kind: str, indices) -> list[str]:
    return [f"/device:{kind}:{i}" for i in indices]
