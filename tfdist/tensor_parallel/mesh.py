"""tfdist.DeviceMesh: devices arranged on named axes, as `keras.distribution.DeviceMesh`."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from tfdist.errors import ConfigError

__all__ = ["DeviceMesh", "as_device_mesh"]


class DeviceMesh:
    """A grid of devices with one name per axis (Keras' `keras.distribution.DeviceMesh` vocabulary).

    The axis named like the strategy's `batch_dim_name` ("batch") is data parallelism (its rows are
    replicas); the other axis (conventionally "model") splits variables. A third axis (`stage_dim_name` of
    `ModelParallelStrategy`, "stage") makes pipeline stages whose layers run on their own model-axis group.
    Same constructor and semantics as Keras: `devices` (default: every local device) is reshaped row-major to
    `shape`.

    Args:
        shape: devices per axis, e.g. `(2, 2)`; its product must equal the number of devices.
        axis_names: one name per axis, e.g. `("batch", "model")`.
        devices: device names (GPUs or logical CPUs), or None for all local devices. A mesh across processes
            names every process's devices, '/job:worker/replica:0/task:T/device:CPU:I', e.g. from
            `tfdist.cluster.list_devices()` (see tfdist.ModelParallelStrategy).

    Example:
        >>> import tfdist
        >>> tfdist.devices.virtual_cpus(4)
        >>> mesh = tfdist.DeviceMesh((2, 2), ("batch", "model"), ["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"])
        >>> mesh.devices[1, 0]              # row 1 ("batch" index 1), "model" index 0
        '/device:CPU:2'
        >>> mesh.axis_size("model")
        2
    """

    def __init__(self, shape: Sequence[int], axis_names: Sequence[str], devices: Sequence[str] | None = None):
        if not shape or not axis_names:
            raise ConfigError(f"DeviceMesh: shape and axis_names cannot be empty; got shape={shape!r}, "
                              f"axis_names={axis_names!r}.")
        shape = tuple(shape)
        axis_names = tuple(axis_names)
        if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1 for s in shape):
            raise ConfigError(f"DeviceMesh: shape must hold whole numbers >= 1, got {shape!r}.")
        if len(shape) != len(axis_names):
            raise ConfigError(f"DeviceMesh: shape {shape} and axis_names {axis_names} must have the same length.")
        if len(set(axis_names)) != len(axis_names) or not all(isinstance(a, str) and a for a in axis_names):
            raise ConfigError(f"DeviceMesh: axis_names must be distinct non-empty strings, got {axis_names!r}.")
        if len(shape) > 3:
            raise ConfigError(f"DeviceMesh: meshes of rank {len(shape)} are not supported (a data axis, a pipeline "
                              "stage axis and a model axis at most); pass shape=(batch, stage, model).")
        from tfdist.devices import resolve_devices
        from tfdist.tensor_parallel.mesh_devices import canonical_task_devices, names_a_task

        flat = list(devices.flatten()) if isinstance(devices, np.ndarray) else devices
        if flat is not None and any(names_a_task(d) for d in flat):  # a mesh across processes (checked later)
            resolved = canonical_task_devices([str(d) for d in flat], parameter="devices")
        else:
            resolved = resolve_devices(None if flat is None else [str(d) for d in flat], parameter="devices")
        if math.prod(shape) != len(resolved):
            raise ConfigError(f"DeviceMesh: shape {shape} holds {math.prod(shape)} devices but {len(resolved)} "
                              f"were given ({resolved}); pass that many devices or a shape whose product is "
                              f"{len(resolved)}.")
        self._shape = tuple(int(s) for s in shape)
        self._axis_names = axis_names
        self._devices = np.array(resolved, dtype=object).reshape(self._shape)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def axis_names(self) -> tuple[str, ...]:
        return self._axis_names

    @property
    def devices(self) -> np.ndarray:
        """Device names as an array of `shape` (row-major)."""
        return self._devices

    def axis_size(self, name: str) -> int:
        """Devices along axis `name` (1 if the mesh has no such axis)."""
        return self._shape[self._axis_names.index(name)] if name in self._axis_names else 1

    def grid(self, batch_dim_name: str) -> list[list[str]]:
        """devices[row][k]: one row per index of `batch_dim_name`, k along the other (model) axis. A rank-3 mesh
        lists each row's devices in the order of the other two axes (see `stage_groups`)."""
        devices = self._devices
        if len(self._shape) == 3:
            if batch_dim_name not in self._axis_names:
                raise ConfigError(f"batch_dim_name={batch_dim_name!r} is not an axis of the mesh "
                                  f"{self._axis_names}; name one of them.")
            rows = np.moveaxis(devices, self._axis_names.index(batch_dim_name), 0)
            return [list(row) for row in rows.reshape(rows.shape[0], -1)]
        if len(self._shape) == 1:
            flat = list(devices)
            return [[d] for d in flat] if self._axis_names[0] == batch_dim_name else [flat]
        if self._axis_names[1] == batch_dim_name:
            devices = devices.T
        elif self._axis_names[0] != batch_dim_name:
            raise ConfigError(f"batch_dim_name={batch_dim_name!r} is not an axis of the mesh {self._axis_names}; "
                              "name one of them, e.g. DeviceMesh((2, 2), ('batch', 'model')).")
        return [list(row) for row in devices]

    def stage_groups(self, batch_dim_name: str, stage_dim_name: str) -> list[list[list[str]]]:
        """devices[row][stage][k] of a rank-3 mesh: row along `batch_dim_name`, stage along `stage_dim_name`,
        k along the remaining (model) axis. Each [row][stage] list is one tensor-parallel group.

        Example:
            >>> mesh = tfdist.DeviceMesh((2, 2, 2), ("batch", "stage", "model"), [f"/cpu:{i}" for i in range(8)])
            >>> mesh.stage_groups("batch", "stage")[1][0]     # row 1, stage 0: its model-axis group
            ['/device:CPU:4', '/device:CPU:5']
        """
        if len(self._shape) != 3:
            raise ConfigError(f"stage_groups needs a rank-3 mesh (batch, stage, model), this one has axes "
                              f"{self._axis_names}.")
        for parameter, name in (("batch_dim_name", batch_dim_name), ("stage_dim_name", stage_dim_name)):
            if name not in self._axis_names:
                raise ConfigError(f"{parameter}={name!r} is not an axis of the mesh {self._axis_names}; name one "
                                  "of them, e.g. DeviceMesh((2, 2, 2), ('batch', 'stage', 'model')).")
        if batch_dim_name == stage_dim_name:
            raise ConfigError(f"batch_dim_name and stage_dim_name are both {batch_dim_name!r}; name two different "
                              f"axes of {self._axis_names}.")
        model = next(i for i, a in enumerate(self._axis_names) if a not in (batch_dim_name, stage_dim_name))
        order = (self._axis_names.index(batch_dim_name), self._axis_names.index(stage_dim_name), model)
        devices = np.transpose(self._devices, order)
        return [[list(group) for group in row] for row in devices]

    def __repr__(self) -> str:
        return f"<DeviceMesh shape={self._shape}, axis_names={self._axis_names}>"


def as_device_mesh(mesh) -> DeviceMesh:
    """A tfdist DeviceMesh from itself or a `keras.distribution.DeviceMesh` (same shape, names, devices)."""
    if isinstance(mesh, DeviceMesh):
        return mesh
    if all(hasattr(mesh, a) for a in ("shape", "axis_names", "devices")):
        return DeviceMesh(mesh.shape, mesh.axis_names, [str(d) for d in np.asarray(mesh.devices).flatten()])
    raise ConfigError(f"expected a tfdist.DeviceMesh or keras.distribution.DeviceMesh, got {type(mesh).__name__}.")
