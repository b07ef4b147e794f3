"""Local devices: logical CPUs for multi-replica runs without accelerators, the one device-list resolver, and the
one rule that gives each process of a machine its own GPUs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tfdist.errors import ConfigError, InitOrderError, troubleshooting

__all__ = ["LocalProcess", "gpu_share", "kind_and_indices", "local_devices", "process_devices", "resolve_devices",
           "virtual_cpus"]

_KINDS = ("GPU", "CPU")


class _TensorFlow:
    """TensorFlow, imported at first use: the launcher reads `LocalProcess` and `gpu_share` without starting it."""

    def __getattr__(self, name: str):
        import tensorflow

        return getattr(tensorflow, name)


tf = _TensorFlow()


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


@dataclass(frozen=True)
class LocalProcess:
    """Where a process of a multi-process job sits on its machine (what its launcher said).

    Attributes:
        local_rank: its index among the job's processes on this machine.
        local_size: how many of the job's processes run on this machine (None: the launcher did not say).
        own_devices: True when the launcher or the scheduler already narrowed the GPUs this process sees to its own
            (`tfdist launch` on a GPU machine, SLURM `--gpus-per-task`): every visible GPU is then this process's.
    """

    local_rank: int = 0
    local_size: int | None = 1
    own_devices: bool = False


def gpu_share(count: int | None, visible: int, local: LocalProcess = LocalProcess(), *,
              parameter: str = "local_devices") -> range:
    """The GPUs (indices among the `visible` ones) one process trains on: the one rule of every multi-process path.

    Each process of a machine takes its own GPUs, as Horovod and torchrun do: with `own_devices` every visible GPU
    is its own (the launcher or scheduler chose them); otherwise the machine's processes see the same GPUs and
    local rank r takes GPUs r*M .. r*M+M-1. `count` None means an even share: every visible GPU divided by the
    machine's processes. Raises ConfigError when the share does not exist or would overlap another process's.

    Example:
        >>> gpu_share(2, 4, LocalProcess(local_rank=1, local_size=2))   # 2 processes x 2 GPUs on a 4-GPU node
        range(2, 4)
        >>> gpu_share(1, 1, LocalProcess(local_rank=3, local_size=4, own_devices=True))  # srun --gpus-per-task=1
        range(0, 1)
    """
    rank, size = local.local_rank, local.local_size
    fix = (f"Give each process its own GPUs: `tfdist launch --devices-per-worker M` (M x processes <= {visible}), "
           "or a scheduler that binds GPUs per task (SLURM --gpus-per-task), or set CUDA_VISIBLE_DEVICES per process.")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise ConfigError(f"{parameter} must be a whole number >= 1, got {count!r}.")
    if local.own_devices or (size == 1 and rank == 0):
        want = visible if count is None else count
        if want > visible:
            raise ConfigError(f"{parameter}={count}: this process sees {visible} GPU(s). {fix}")
        return range(want)
    if count is None:
        if size is None or size > visible or visible % size:
            raise ConfigError(f"{parameter}=None shares the {visible} visible GPU(s) evenly among this machine's "
                              f"processes, but {'their number is unknown' if size is None else f'there are {size}'}. "
                              f"Pass {parameter}=M. {fix}")
        count = visible // size
    first = rank * count
    if first + count > visible or (size is not None and size * count > visible):
        processes = f"{size} processes" if size is not None else f"local rank {rank}"
        raise ConfigError(f"{parameter}={count}: {processes} on this machine want {count} GPU(s) each, and local "
                          f"rank {rank} would take GPUs {first}..{first + count - 1}, but the machine shows {visible} "
                          f"GPU(s) to every process: their devices would overlap or not exist. {fix}")
    return range(first, first + count)


def process_devices(spec: int | Sequence[str] | None, *, parameter: str = "local_devices",
                    local: LocalProcess | None = None) -> list[str]:
    """The devices one process of a multi-process job trains on, chosen before TensorFlow initialises.

    `spec` is None (every GPU, else every configured logical CPU), a count M (the first M GPUs, else M logical
    CPUs) or a list of device names (checked against the machine, used as given). With `local` (its place on the
    machine, given by the multi-process strategies) its share of the GPUs (`gpu_share`) instead, and that share
    becomes the only GPUs TensorFlow shows it, so every process names its own '/device:GPU:0' .. 'GPU:M-1', as a
    mesh across processes lists them.

    Example:
        >>> process_devices(2)          # no GPUs: the CPU split into 2 logical devices
        ['/device:CPU:0', '/device:CPU:1']
    """
    if spec is not None and not (isinstance(spec, int) and not isinstance(spec, bool)):
        return _check_names(spec, parameter, allow_count=True)
    if isinstance(spec, int) and spec < 1:
        raise ConfigError(f"{parameter} must be a whole number >= 1, got {spec}.")
    gpus = tf.config.get_visible_devices("GPU")  # what this process was already shown (all, unless narrowed)
    if local is not None and gpus and not any(tf.config.get_logical_device_configuration(g) for g in gpus):
        if len(gpus) < len(tf.config.list_physical_devices("GPU")):  # the user chose this process's GPUs
            local = LocalProcess(local.local_rank, local.local_size, own_devices=True)
        share = gpu_share(spec, len(gpus), local, parameter=parameter)
        _show_only([gpus[i] for i in share], parameter)
        return _names("GPU", range(len(share)))
    if spec is None:
        return local_devices()
    counts = _available()
    if counts["GPU"]:  # one process (or logical GPUs the user configured): the first `spec` GPUs
        if spec > counts["GPU"]:
            raise ConfigError(f"{parameter}={spec}: this process sees {counts['GPU']} GPU(s).")
        return _names("GPU", range(spec))
    if spec == 1 or (spec <= counts["CPU"] and _initialised()):
        return _names("CPU", range(spec))  # already there: the first `spec` logical CPUs
    return virtual_cpus(spec)


def mesh_process_devices(names: Sequence[str], count: int, local: LocalProcess | None = None) -> list[str]:
    """This process's devices of a mesh across processes (`names`: its local names), set up before TF initialises:
    `count` logical CPUs, or its share of the GPUs when the mesh names GPUs 0..count-1 (as
    `tfdist.cluster.list_devices` does), else the GPUs as named."""
    specs = [tf.DeviceSpec.from_string(n) for n in names]
    if (specs[0].device_type or "").upper() == "CPU":
        return process_devices(count, parameter="mesh devices", local=local)
    if sorted(s.device_index or 0 for s in specs) == list(range(count)):
        return process_devices(count, parameter="mesh devices", local=local)
    return process_devices(list(names), parameter="mesh devices")


def _show_only(gpus: list, parameter: str) -> None:
    """Makes `gpus` the only GPUs TensorFlow shows this process (renumbered from 0); before TF initialises."""
    if tf.config.get_visible_devices("GPU") == gpus:
        return
    try:
        tf.config.set_visible_devices(gpus, "GPU")
    except RuntimeError as err:
        raise InitOrderError(
            f"{parameter}: this process's GPUs ({[g.name for g in gpus]}) must be chosen before TensorFlow "
            "initialises, and it already has. Create the strategy first thing in the script, before any tensor or "
            "model." + troubleshooting("initordererror")) from err


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
    """Logical devices per type, read from the device configuration (does not initialise TensorFlow): those of
    the physical devices TF shows this process (all, unless `tf.config.set_visible_devices` narrowed them)."""
    counts = {}
    for kind in _KINDS:
        n = 0
        for device in tf.config.get_visible_devices(kind):
            logical = tf.config.get_logical_device_configuration(device)
            n += len(logical) if logical else 1
        counts[kind] = n
    return counts


def _initialised() -> bool:
    from tfdist._compat import tf_runtime

    return tf_runtime.context_initialized()


def _names(kind: str, indices) -> list[str]:
    return [f"/device:{kind}:{i}" for i in indices]
