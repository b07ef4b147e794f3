"""Per-device memory of tensor-parallel training: the bytes each mesh device holds for a model whose variables a
LayoutMap split, read from the devices the variables' copies live on, next to one replicated device."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import tensorflow as tf

__all__ = ["DeviceMemory", "SplitMemoryReport", "split_memory_report"]


def _nbytes(v) -> int:
    return int(np.prod(v.shape, dtype=np.int64)) * tf.as_dtype(v.dtype).size


def _canon(device: str) -> str:
    return tf.DeviceSpec.from_string(device).to_string()


@dataclass
class DeviceMemory:
    """Bytes one mesh device holds: weights, their gradients (the trainable weights' shapes, on the same device)
    and optimizer state (slots next to their variables, plus the optimizer's scalars)."""

    device: str
    params: int = 0
    gradients: int = 0
    optimizer_state: int = 0

    @property
    def total(self) -> int:
        return self.params + self.gradients + self.optimizer_state


@dataclass
class SplitMemoryReport:
    """What `ModelParallelStrategy.memory_report(model)` returns: measured bytes per mesh device next to what one
    device holds with every variable replicated (`replicated`)."""

    mesh_shape: tuple
    model_axis_size: int
    num_params: int
    rows: list[DeviceMemory] = field(default_factory=list)
    replicated: DeviceMemory = field(default_factory=lambda: DeviceMemory("replicated"))
    optimizer_built: bool = False
    #: ZeRO over the batch axis: 1 cuts each device's optimizer state into one piece per row, 2 its gradients too,
    #: 3 its parameters too
    zero_stage: int = 0

    def largest(self, what: str = "total") -> int:
        return max(getattr(r, what) for r in self.rows)

    def ratio(self, what: str = "total") -> float:
        """The largest device's bytes ÷ replicated (the ideal split is 1/T)."""
        return self.largest(what) / max(1, getattr(self.replicated, what))

    def to_dict(self) -> dict:
        d = asdict(self)
        for r, row in zip(d["rows"], self.rows):
            r["total"] = row.total
        d["replicated"]["total"] = self.replicated.total
        d["ratio"] = {w: self.ratio(w) for w in ("params", "gradients", "optimizer_state", "total")}
        return d

    def __str__(self) -> str:
        mb = lambda b: f"{b:>13,}"  # noqa: E731
        t = self.model_axis_size
        lines = [f"tensor parallel: mesh {self.mesh_shape}, model axis {t}, {self.num_params:,} parameters"
                 + ("" if self.optimizer_built else " (optimizer not built: no optimizer state counted)"),
                 f"{'device':36s} {'params':>13s} {'grads':>13s} {'opt state':>13s} {'total':>13s}  bytes"]
        for r in [*self.rows, self.replicated]:
            lines.append(f"{r.device:36s} {mb(r.params)} {mb(r.gradients)} {mb(r.optimizer_state)} {mb(r.total)}")
        lines.append(f"largest device / replicated: {self.ratio():.4f} (ideal 1/T = {1 / t:.4f}; replicated layers "
                     "and scalars sit on each row's first device)")
        if self.zero_stage:
            rows = len(self.rows) // t  # mesh rows (the batch axis)
            held = {1: "optimizer state", 2: "optimizer state and summed gradients"}.get(
                self.zero_stage, "parameters, gradients and optimizer state")
            lines.append(f"ZeRO stage {self.zero_stage} over the batch axis: each device holds 1/{rows} of its "
                         f"variables' {held}"
                         + f" (ideal {'total' if self.zero_stage == 3 else 'optimizer state'} ratio "
                           f"1/(T x {rows}) = {1 / (t * rows):.4f})")
        return "\n".join(lines)


def _device_key(device: str) -> tuple:
    # "/device:CPU:1" and "/job:localhost/replica:0/task:0/device:CPU:1" name one local device
    spec = tf.DeviceSpec.from_string(device)
    return spec.device_type, spec.device_index


def _placed(variable) -> list:
    """The tf variables holding `variable`, one per device it is mirrored on."""
    value = getattr(variable, "value", variable)
    if isinstance(value, tf.distribute.DistributedValues):
        return list(value.values)
    pieces = getattr(value, "components", None)  # ZeRO stage 3: one piece per row, nothing whole
    return list(pieces) if isinstance(pieces, list) else [value]


def split_memory_report(model, grid: list[list[str]], sharded_state: tuple[list, list] | None = None,
                        kept_gradients: dict[str, int] | None = None) -> SplitMemoryReport:
    """Per-device bytes of a model whose variables a LayoutMap split over the devices of `grid` (rows: the
    "batch" axis, columns: the "model" axis), read from the devices each variable's copies live on.

    With ZeRO over the batch axis, `sharded_state` is (the optimizer's logical slot views, the shard variables
    that hold them): the views count whole in `replicated` only, the shard variables on their devices; and
    `kept_gradients` (stage 2) the bytes of summed gradient each device keeps, in place of full gradients.

    Example:
        >>> report = split_memory_report(model, [["/device:CPU:0", "/device:CPU:1"]])   # a split Transformer block
        >>> [r.params for r in report.rows], report.replicated.params
        ([1584640, 1576448], 3161088)
        >>> round(report.ratio("params"), 4)   # the largest device's weights ÷ replicated
        0.5013
    """
    names = [_canon(d) for row in grid for d in row]
    rows = {_device_key(d): DeviceMemory(device=d) for d in names}
    replicated = DeviceMemory(device="replicated (every variable whole)")

    def add(variable, what: str) -> None:
        # shards of one variable add up to its logical size; a mirrored variable counts once in `replicated`
        setattr(replicated, what, getattr(replicated, what) + _nbytes(variable))
        for part in _placed(variable):
            row = rows.get(_device_key(part.device))
            if row is not None:
                setattr(row, what, getattr(row, what) + _nbytes(part))

    for v in model.weights:
        add(v, "params")
    for v in model.trainable_weights:
        add(v, "gradients")
    if kept_gradients is not None:
        for row in rows.values():
            row.gradients = 0
        for device, nbytes in kept_gradients.items():
            row = rows.get(_device_key(device))
            if row is not None:
                row.gradients += nbytes
    optimizer = getattr(model, "optimizer", None)
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    built = bool(optimizer is not None and optimizer.built)
    logical, shards = sharded_state if sharded_state is not None else ([], [])
    views = {id(v) for v in logical}
    if built:
        for v in optimizer.variables:
            if id(v) in views:  # held by the shard variables below; whole in a replicated device
                replicated.optimizer_state += _nbytes(v)
            else:
                add(v, "optimizer_state")
        for v in shards:
            for part in _placed(v):
                row = rows.get(_device_key(part.device))
                if row is not None:
                    row.optimizer_state += _nbytes(part)
    num_params = sum(int(np.prod(v.shape, dtype=np.int64)) for v in model.weights)
    return SplitMemoryReport(mesh_shape=(len(grid), len(grid[0])), model_axis_size=len(grid[0]),
                             num_params=num_params, rows=list(rows.values()), replicated=replicated,
                             optimizer_built=built)
