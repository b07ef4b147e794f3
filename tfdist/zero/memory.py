"""Per-replica memory of data-parallel training: measured from variable placement, and the ZeRO formulas."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import tensorflow as tf

from tfdist.errors import ConfigError
from tfdist.zero.attach import engine_of
from tfdist.zero.fsdp.param import FsdpParam
from tfdist.zero.slot_checkpoint import LogicalSlot

__all__ = ["zero_formula", "MemoryReport", "ReplicaMemory", "memory_report"]


def zero_formula(num_params: int, replicas: int, stage: int, *, state_bytes: int = 8, param_bytes: int = 4,
                 grad_bytes: int = 4) -> dict[str, float]:
    """Bytes per replica for `num_params` (Ψ) parameters: params, gradients, optimizer state, total.

    Defaults are fp32 Keras variables with Adam (state 8 bytes per parameter): DP = 16Ψ,
    ZeRO-1 = 8Ψ + 8Ψ/N, ZeRO-2 = 4Ψ + 12Ψ/N, ZeRO-3 = 16Ψ/N (arXiv 1910.02054, with K = state bytes);
    stage 3 needs the gathered parameters of the units in flight on top (`MemoryReport.gathered_units`).

    Example:
        >>> zero_formula(1_000_000, 4, 2)["total"]
        7000000.0
    """
    n = replicas
    params = float(param_bytes * num_params) / (n if stage >= 3 else 1)
    grads = float(grad_bytes * num_params) / (n if stage >= 2 else 1)
    state = float(state_bytes * num_params) / (n if stage >= 1 else 1)
    return {"params": params, "gradients": grads, "optimizer_state": state, "total": params + grads + state}


@dataclass
class ReplicaMemory:
    """Bytes one replica's device holds (measured)."""

    device: str
    params: int = 0
    gradients: int | None = None
    optimizer_state: int = 0
    shard_buffer: int = 0  # ZeRO: the owner's parameter shard copy (4Ψ/N during a step only; 0 between steps)
    #: the same bytes by dtype: {"params": {"float32": ...}, "optimizer_state": {...}, ...}
    dtypes: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.params + (self.gradients or 0) + self.optimizer_state + self.shard_buffer


@dataclass
class MemoryReport:
    """What `strategy.memory_report(model)` returns: measured rows per replica and the formula."""

    stage: int
    replicas: int
    num_params: int
    state_bytes_per_param: float
    rows: list[ReplicaMemory] = field(default_factory=list)
    formula: dict[str, float] = field(default_factory=dict)
    gradients_source: str = ""
    #: stage 3: bytes of the two largest units' gathered parameters (held during their forward/backward)
    gathered_units: int = 0

    def max_over_replicas(self, what: str) -> int:
        return max(getattr(r, what) or 0 for r in self.rows)

    def to_dict(self) -> dict:
        d = asdict(self)
        for r, row in zip(d["rows"], self.rows):
            r["total"] = row.total
        return d

    def __str__(self) -> str:
        mb = lambda b: "   n/a" if b is None else f"{b / 2**20:9.3f}"  # noqa: E731
        lines = [f"ZeRO stage {self.stage}, {self.replicas} replicas, {self.num_params:,} parameters, "
                 f"optimizer state {self.state_bytes_per_param:g} B/param",
                 f"{'replica device':44s} {'params':>9s} {'grads':>9s} {'opt state':>9s} {'shard buf':>9s}  MiB"]
        for r in self.rows:
            lines.append(f"{r.device:44s} {mb(r.params)} {mb(r.gradients)} {mb(r.optimizer_state)} {mb(r.shard_buffer)}")
        f = self.formula
        lines.append(f"{'formula (per replica)':44s} {mb(f['params'])} {mb(f['gradients'])} "
                     f"{mb(f['optimizer_state'])} {'':9s}")
        if self.rows:
            by_dtype = "; ".join(f"{what} " + ", ".join(f"{d} {mb(b).strip()}" for d, b in sorted(per.items()))
                                 for what, per in self.rows[0].dtypes.items())
            lines.append(f"by dtype ({self.rows[0].device}, MiB): {by_dtype}")
        lines.append(f"gradients: {self.gradients_source}")
        if self.stage >= 3:
            lines.append(f"stage 3: + {self.gathered_units / 2**20:.3f} MiB of gathered parameters "
                         "(the two largest units) while they run")
        return "\n".join(lines)


def _nbytes(v) -> int:
    return int(np.prod(v.shape, dtype=np.int64)) * tf.as_dtype(v.dtype).size


def _canon(device: str) -> str:
    return tf.DeviceSpec.from_string(device).to_string()


def _components(strategy, variable) -> list:
    value = getattr(variable, "value", variable)
    if isinstance(value, FsdpParam):  # stage 3: one piece per replica
        return list(value.components)
    if isinstance(value, tf.distribute.DistributedValues):
        return list(strategy.experimental_local_results(value))
    return [value]


def memory_report(strategy, model) -> MemoryReport:
    """Measures per-replica bytes of `model`'s parameters, gradients and optimizer state under `strategy`."""
    optimizer = getattr(model, "optimizer", None)
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # LossScaleOptimizer
    if optimizer is None or not optimizer.built:
        raise ConfigError("memory_report(model): the model's optimizer is not built yet; call it after fit() "
                          "(or after model.optimizer.build(model.trainable_variables)).")
    devices = [_canon(d) for d in strategy.extended.worker_devices]
    rows = {d: ReplicaMemory(device=d) for d in devices}

    def add(device: str, what: str, nbytes: int, dtype) -> None:
        d = _canon(device)
        row = rows.setdefault(d, ReplicaMemory(device=d))
        setattr(row, what, (getattr(row, what) or 0) + nbytes)
        per = row.dtypes.setdefault(what, {})
        per[tf.as_dtype(dtype).name] = per.get(tf.as_dtype(dtype).name, 0) + nbytes

    variables = list(model.trainable_variables)
    for v in variables:
        for c in _components(strategy, v):
            add(c.device, "params", _nbytes(c), c.dtype)
    num_params = sum(int(np.prod(v.shape, dtype=np.int64)) for v in variables)
    param_bytes = sum(_nbytes(v) for v in variables) / max(1, num_params)  # 4 for float32 (mixed policies too)
    engine = engine_of(optimizer)
    stage = engine.stage if engine is not None else 0
    if engine is None:
        state_vars = optimizer.variables
        for v in state_vars:
            for c in _components(strategy, v):
                add(c.device, "optimizer_state", _nbytes(c), c.dtype)
        full = sum(_nbytes(v) for v in state_vars if len(v.shape))  # slots (not the scalars)
        for v in variables:
            for c in _components(strategy, v):
                add(c.device, "gradients", _nbytes(c), c.dtype)
        source = "stage 0: each replica holds the full all-reduced gradient (the variables' shapes)"
    else:
        for v in engine.inner.variables:
            add(v.value.device, "optimizer_state", _nbytes(v), v.dtype)
        for v in optimizer.variables:  # iterations, learning rate: mirrored scalars of the user's optimizer
            if not isinstance(v, LogicalSlot):
                for c in _components(strategy, v):
                    add(c.device, "optimizer_state", _nbytes(c), c.dtype)
        for s in engine.shard_params:  # emptied after each step's all-gather: 0 between steps (none at stage 3)
            add(s.value.device, "shard_buffer", int(tf.size(s.value)) * tf.as_dtype(s.dtype).size, s.dtype)
        full = sum(_nbytes(v) for vs in engine.state.slots.values() for v in vs)  # this process's shards
        full = full * engine.layout.num_shards // len(engine.comm.shard_ids)  # all processes' shards
        full = full * num_params // max(1, engine.layout.padded)
        if engine.kept_gradient_bytes is not None:
            for device, nbytes in zip(engine.comm.devices, engine.kept_gradient_bytes):
                add(device, "gradients", nbytes, engine.dtype)
            source = ("measured from the traced step: " +
                      ("each replica keeps only its reduce-scattered shard" if engine.reduce_scatters else
                       "the full all-reduced gradient per replica"))
        else:
            source = "not measured yet (run at least one training step)"
    state_bytes = full / max(1, num_params)  # a float: a mixed-dtype model's slots average between the dtypes
    replicas = strategy.num_replicas_in_sync  # all processes' replicas (the formula's N)
    report = MemoryReport(stage=stage, replicas=replicas, num_params=num_params, state_bytes_per_param=state_bytes,
                          rows=list(rows.values()), gradients_source=source)
    report.formula = zero_formula(num_params, replicas, stage, state_bytes=state_bytes, param_bytes=param_bytes,
                                  grad_bytes=param_bytes)
    units = sorted((u.gathered_bytes for u in getattr(engine, "units", ())), reverse=True)
    report.gathered_units = sum(units[:2])
    return report
