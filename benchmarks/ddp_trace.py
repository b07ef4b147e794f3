"""Reading overlap of gradient all-reduce and backward from TF's profiler trace (tests/test_buckets.py, `tfdist bench ddp`).

In one profiled training step, per replica device: when the backward's ops ran (ops TF named
`.../gradient_tape/...`), when the step's collectives ran (CollectiveReduceV2 kernels, Horovod's all-reduce
ops), and how much of the collectives' time fell before the device's backward had finished. Ops are mapped
to devices by TF's own placement (`tfdist._compat.tf_runtime.executed_partition_devices`).
"""

from __future__ import annotations

import dataclasses
import glob
import tempfile
from collections.abc import Callable

import keras
import tensorflow as tf

__all__ = ["DeviceOverlap", "collective_kind", "free_to_overlap", "overlap_by_step", "profile", "read_space"]

_COLLECTIVE_TYPES = ("CollectiveReduceV2", "HorovodAllreduce", "HorovodGroupedAllreduce", "HorovodAllgather")


@dataclasses.dataclass
class DeviceOverlap:
    """One device's step: intervals in ms from the step's first backward op."""

    device: str
    backward: list[tuple[float, float]]
    collectives: list[tuple[float, float]]

    @property
    def backward_end(self) -> float:
        return max(b for _, b in self.backward)

    @property
    def first_collective_start(self) -> float:
        return min(a for a, _ in self.collectives)

    @property
    def comm_ms(self) -> float:
        """Time in which at least one of the device's collectives ran."""
        return _union(self.collectives)

    @property
    def hidden_ms(self) -> float:
        """Collective time that overlapped the device's backward ops."""
        clipped = []
        for a, b in self.collectives:
            for c, d in self.backward:
                lo, hi = max(a, c), min(b, d)
                if hi > lo:
                    clipped.append((lo, hi))
        return _union(clipped)

    @property
    def overlaps(self) -> bool:
        """True if a collective started before the device's backward ended."""
        return self.first_collective_start < self.backward_end


def collective_kind(op_type: str) -> bool:
    return op_type in _COLLECTIVE_TYPES


def profile(fit: Callable[[list], object], *, first_step: int = 1, steps: int | None = None) -> object:
    """Runs `fit(callbacks)` (a Keras `fit` that passes `callbacks` on) with TF's profiler recording training steps
    `first_step` .. `first_step + steps - 1` of its first epoch, and returns the trace (an XSpace).

    `steps` defaults to the rest of the epoch (Keras' own step count; give it when the data's length is unknown).
    The window leaves out the first step (it waits for a new iterator) and the metric reads after the last.

    Across processes (TF collectives), profile task 0 only: on the other tasks TF resolves every collective's
    parameters by an RPC to task 0, an event that starts on one thread and ends on another, and TF 2.21's profiler
    then crashes the process when it stops in about half of the runs (docs/design.md, "Reading overlap")."""
    window = _StepWindow(first_step, steps)
    try:
        fit([window])
    finally:
        window.stop()
    if window.logdir is None:
        raise ValueError(f"profile: the fit ran fewer than first_step={first_step} + 1 training steps; nothing was "
                         "profiled. Give it more data or a smaller first_step.")
    return read_space(max(glob.glob(f"{window.logdir}/**/*.xplane.pb", recursive=True)))


class _StepWindow(keras.callbacks.Callback):
    """Starts TF's profiler before training step `first_step` and stops it after the window's last step."""

    def __init__(self, first_step: int, steps: int | None):
        super().__init__()
        if first_step < 0 or (steps is not None and steps < 1):
            raise ValueError(f"profile: first_step must be >= 0 and steps >= 1; got first_step={first_step}, "
                             f"steps={steps}.")
        self.first_step, self.steps = first_step, steps
        self.logdir: str | None = None
        self.last_step = -1
        self._running = False

    def on_train_batch_begin(self, batch, logs=None):
        if self.logdir is not None or batch != self.first_step:
            return
        steps = self.steps
        if steps is None:
            epoch_steps = (self.params or {}).get("steps")
            if epoch_steps is None:
                raise ValueError("profile: Keras does not know how many steps this epoch has; pass steps=.")
            steps = epoch_steps - self.first_step
        self.last_step = self.first_step + steps - 1
        self.logdir = tempfile.mkdtemp(prefix="tfdist-ddp-trace-")
        tf.profiler.experimental.start(self.logdir)
        self._running = True

    def on_train_batch_end(self, batch, logs=None):
        if batch >= self.last_step:
            self.stop()

    def stop(self) -> None:
        if self._running:
            self._running = False
            tf.profiler.experimental.stop()


def read_space(path: str):
    from tfdist._compat.tf_runtime import xspace_proto

    space = xspace_proto()()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    return space


def _events(space):
    for plane in space.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        for line in plane.lines:
            for event in line.events:
                start = line.timestamp_ns / 1e6 + event.offset_ps / 1e9
                yield plane.event_metadata[event.metadata_id].name, start, start + event.duration_ps / 1e9


def _windows(space) -> list[tuple[float, float]]:
    """(start, end) of each execution of Keras' compiled train step (or of any tf.function call)."""
    calls = [(a, b) for name, a, b in _events(space)
             if name.startswith("EagerLocalExecute: __inference_") and "step_on_" in name]
    if not calls:
        calls = [(a, b) for name, a, b in _events(space) if name.startswith("EagerLocalExecute: __inference_")]
    return sorted(calls)


def overlap_by_step(space, device_of: dict[str, set[str]], scope: str | None = None) -> list[dict[str, DeviceOverlap]]:
    """Per profiled step, per device: its backward ops and collectives (ms from the step's first backward op).

    `scope`: count only collectives under this name scope (the optimizer's name, e.g. `model.optimizer.name`: Keras
    all-reduces the gradients inside it). A step has other collectives too: across processes, the distributed
    iterator's all-reduce that agrees whether every worker has data, which may well run during the backward."""
    ops = []
    for name, a, b in _events(space):
        if ":" not in name:
            continue
        node, op_type = name.split(":", 1)
        devices = device_of.get(node)
        if not devices or len(devices) != 1:
            continue
        if collective_kind(op_type):
            kind = "collective" if scope is None or f"/{scope}/" in f"/{node}/" else None
        else:
            kind = "backward" if "gradient_tape/" in node else None
        if kind:
            ops.append((kind, next(iter(devices)), a, b))
    steps = []
    for lo, hi in _windows(space) or [(float("-inf"), float("inf"))]:
        inside = [o for o in ops if lo <= o[2] <= hi]
        backward = [o for o in inside if o[0] == "backward"]
        if not backward:
            continue
        t0 = min(o[2] for o in backward)
        per = {}
        for device in sorted({o[1] for o in inside}):
            bw = [(a - t0, b - t0) for k, d, a, b in inside if k == "backward" and d == device]
            co = [(a - t0, b - t0) for k, d, a, b in inside if k == "collective" and d == device]
            if bw and co:
                per[device] = DeviceOverlap(device, bw, co)
        if per:
            steps.append(per)
    return steps


def free_to_overlap(partitions: list, scope: str) -> dict[str, bool]:
    """Per device, from the graphs TF executed (tf_runtime.executed_partition_graphs): whether one of its gradient
    collectives (under name scope `scope`) is free to run during its backward, i.e. some backward op is neither
    an input of that collective (directly or through others) nor fed by it. With one pack of all gradients no
    collective is; with buckets the first bucket's is. Unlike a profile, this does not depend on how the
    threads happened to be scheduled."""
    found: dict[str, bool] = {}
    for partition in partitions:
        inputs = {node.name: [i.lstrip("^").split(":")[0] for i in node.input] for node in partition.node}
        consumers: dict[str, list[str]] = {}
        for name, sources in inputs.items():
            for source in sources:
                consumers.setdefault(source, []).append(name)
        ops = {node.name: node.op for node in partition.node}
        backward = {name for name in inputs if "gradient_tape/" in name}
        collectives = [name for name in inputs if collective_kind(ops[name]) and f"/{scope}/" in f"/{name}/"]
        if not backward or not collectives:
            continue
        device = partition.node[0].device
        free = any(backward - _reachable(c, inputs) - _reachable(c, consumers) for c in collectives)
        found[device] = found.get(device, False) or free
    return found


def _reachable(start: str, edges: dict[str, list[str]]) -> set[str]:
    """Every node reachable from `start` along `edges` (its inputs: what it depends on; its consumers: what
    depends on it), through data and control edges."""
    seen, stack = set(), list(edges.get(start, ()))
    while stack:
        name = stack.pop()
        if name not in seen:
            seen.add(name)
            stack.extend(edges.get(name, ()))
    return seen


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total
