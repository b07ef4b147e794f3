"""Stage plans: which layer runs on which pipeline stage, checked against the model's data flow."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tfdist.errors import ConfigError

__all__ = ["LayerInfo", "StagePlan", "describe_model", "make_plan"]

BALANCE_BY = ("params", "flops", "time")


@dataclass
class LayerInfo:
    """One layer of a model as the planner sees it (costs per sample, float32 activations)."""

    name: str
    index: int                       # position in topological order
    parents: list[str]               # layers whose outputs this layer reads
    params: int                      # weights (trainable and not)
    flops: float                     # estimated forward FLOPs per sample
    activation_bytes: int            # bytes of this layer's outputs per sample
    input_shapes: list[tuple] = field(default_factory=list)
    seconds: float | None = None     # measured fwd+bwd seconds of one micro-batch (balance="time")


@dataclass
class StagePlan:
    """A placement: layer -> stage, stage -> device per data-parallel replica, and the costs.

    `str(plan)` is the table `LayerPlacementStrategy.placement_plan()` prints.
    """

    layers: list[LayerInfo]
    stage_of: dict[str, int]
    devices: list[list[str]]          # devices[replica][stage]
    balance: str
    micro_batches: int

    @property
    def num_stages(self) -> int:
        return len(self.devices[0])

    def stage_layers(self, stage: int) -> list[str]:
        return [info.name for info in self.layers if self.stage_of[info.name] == stage]

    def stage_totals(self) -> list[dict]:
        """Per stage: layers, params, FLOPs, and activation bytes sent to later stages (per sample)."""
        totals = [{"stage": k, "layers": 0, "params": 0, "flops": 0.0, "sent_bytes": 0,
                   "devices": [rep[k] for rep in self.devices]} for k in range(self.num_stages)]
        consumers: dict[str, set[int]] = {}
        for info in self.layers:
            for parent in info.parents:
                consumers.setdefault(parent, set()).add(self.stage_of[info.name])
        for info in self.layers:
            t = totals[self.stage_of[info.name]]
            t["layers"] += 1
            t["params"] += info.params
            t["flops"] += info.flops
            later = {s for s in consumers.get(info.name, ()) if s != self.stage_of[info.name]}
            t["sent_bytes"] += info.activation_bytes * len(later)
        return totals

    def as_dict(self) -> dict:
        return {
            "balance": self.balance, "micro_batches": self.micro_batches, "devices": self.devices,
            "layers": [{"name": i.name, "stage": self.stage_of[i.name], "params": i.params,
                        "flops": i.flops, "activation_bytes": i.activation_bytes, "seconds": i.seconds}
                       for i in self.layers],
            "stages": self.stage_totals(),
        }

    def __str__(self) -> str:
        multi = len(self.devices) > 1
        head = f"{'layer':24s} {'stage':>5s}  {'device':24s} {'params':>10s} {'MFLOPs':>9s} {'act. KB':>8s}"
        if any(i.seconds is not None for i in self.layers):
            head += f" {'ms':>7s}"
        rows = [head, "-" * len(head)]
        for info in self.layers:
            k = self.stage_of[info.name]
            device = _short(self.devices[0][k]) + (f" (+{len(self.devices) - 1})" if multi else "")
            row = (f"{info.name[:24]:24s} {k:5d}  {device:24s} {info.params:10,d} {info.flops / 1e6:9.3f} "
                   f"{info.activation_bytes / 1024:8.1f}")
            if info.seconds is not None:
                row += f" {info.seconds * 1e3:7.3f}"
            rows.append(row)
        rows.append("-" * len(head))
        for t in self.stage_totals():
            devs = ", ".join(_short(d) for d in t["devices"])
            timed = [i.seconds for i in self.layers if self.stage_of[i.name] == t["stage"] and i.seconds is not None]
            rows.append(f"stage {t['stage']} on {devs}: {t['layers']} layers, {t['params']:,d} params, "
                        f"{t['flops'] / 1e6:.3f} MFLOPs/sample, sends {t['sent_bytes'] / 1024:.1f} KB/sample"
                        + (f", {sum(timed) * 1e3:.3f} ms fwd+bwd" if timed else ""))
        rows.append(f"balance={self.balance}, micro_batches={self.micro_batches}, "
                    f"data_parallel={len(self.devices)} (per-sample costs; FLOPs are estimates"
                    + ("; ms: measured forward + training backward of one micro-batch)" if any(
                        i.seconds is not None for i in self.layers) else ")"))
        return "\n".join(rows)


def _short(device: str) -> str:
    from tfdist.pipeline.layer_call import canonical_device

    return canonical_device(device) or device


def _prod(shape: Sequence) -> int:
    return int(math.prod(d for d in shape if d is not None))


def _estimate_flops(layer, in_shapes: list[tuple], out_shapes: list[tuple]) -> float:
    out_elems = sum(_prod(s[1:]) for s in out_shapes)
    kernel = getattr(layer, "kernel", None)
    if kernel is not None and len(kernel.shape) >= 2 and kernel.shape[-1]:
        # Dense and convolutions alike: each output element is a dot product with
        # kernel.size / out_channels weights (a multiply and an add each).
        return 2.0 * _prod(kernel.shape) * out_elems / kernel.shape[-1]
    params = sum(_prod(w.shape) for w in getattr(layer, "weights", ()))
    if params:
        return 2.0 * params + out_elems
    return float(max(out_elems, sum(_prod(s[1:]) for s in in_shapes)))  # element-wise / pooling


def describe_model(model) -> list[LayerInfo]:
    """LayerInfo for every layer of a built Keras model, in topological order."""
    from tfdist._compat import keras_model

    infos = []
    for index, (layer, parents, in_shapes, out_shapes) in enumerate(keras_model.layer_graph(model)):
        dtype_bytes = 2 if "16" in str(getattr(layer, "compute_dtype", "float32")) else 4
        infos.append(LayerInfo(
            name=layer.name, index=index, parents=[p.name for p in parents],
            params=sum(_prod(w.shape) for w in getattr(layer, "weights", ())),  # an op (x + y) has none
            flops=_estimate_flops(layer, in_shapes, out_shapes),
            activation_bytes=sum(_prod(s[1:]) for s in out_shapes) * dtype_bytes,
            input_shapes=in_shapes,
        ))
    return infos


def make_plan(layers: list[LayerInfo], placement, devices: list[list[str]], *, balance: str = "params",
              micro_batches: int = 1) -> StagePlan:
    """Assigns every layer a stage from a placement spec, and checks it against the data flow.

    `placement` is one of:
    - "auto": contiguous stages (in topological order) balanced by `balance`;
    - a list of K-1 layer names: stage k starts at the k-th name (torchgpipe-style split points);
    - {layer_name: stage}: named layers go to that stage; a layer not named joins the stage of the
      layer before it in topological order (so naming each stage's first layer is enough);
    - {stage: [layer names]}: the same, grouped by stage.

    Raises ConfigError for a missing layer, a layer assigned twice, a stage index out of range,
    an empty stage (more stages than layers), or stages that go against the data flow (a layer
    on stage i reading from a later stage would need a cycle between stages).
    """
    stages = len(devices[0])
    names = [info.name for info in layers]
    index = {n: i for i, n in enumerate(names)}
    if stages > len(layers):
        raise ConfigError(f"{stages} stages but the model has only {len(layers)} layers ({names}); each "
                          f"stage needs at least one layer. Pass at most {len(layers)} devices per pipeline.")
    if isinstance(placement, str):
        if placement != "auto":
            raise ConfigError(f"placement must be 'auto', a list of split layer names, or a dict; "
                              f"got {placement!r}.")
        if balance not in BALANCE_BY:
            raise ConfigError(f"balance must be one of {list(BALANCE_BY)}, got {balance!r}.")
        from tfdist.pipeline.balance import block_partition

        costs = [_cost(info, balance) for info in layers]
        sizes = block_partition(costs, stages)
        stage_of, start = {}, 0
        for k, size in enumerate(sizes):
            for name in names[start:start + size]:
                stage_of[name] = k
            start += size
    elif isinstance(placement, Mapping):
        stage_of = _from_mapping(placement, names, index, stages)
    elif isinstance(placement, Sequence):
        stage_of = _from_splits(list(placement), names, index, stages)
    else:
        raise ConfigError(f"placement must be 'auto', a list of split layer names, or a dict; got {placement!r}.")
    _check_stages(layers, stage_of, stages)
    return StagePlan(layers, stage_of, devices, balance if placement == "auto" else "manual", micro_batches)


def _cost(info: LayerInfo, balance: str) -> float:
    if balance == "params":
        return float(info.params)
    if balance == "flops":
        return info.flops
    return info.seconds or 0.0


def _missing(name, names) -> ConfigError:
    return ConfigError(f"placement names layer {name!r}, but the model has no such layer; its layers are {names}.")


def _from_splits(splits: list, names: list[str], index: dict, stages: int) -> dict[str, int]:
    if len(splits) != stages - 1:
        raise ConfigError(f"placement as split points needs {stages - 1} layer names for {stages} stages "
                          f"(stage k starts at the k-th name); got {len(splits)}: {splits}.")
    for name in splits:
        if name not in index:
            raise _missing(name, names)
        if splits.count(name) > 1:
            raise ConfigError(f"placement lists layer {name!r} twice; each split point starts one stage.")
    starts = [0] + [index[n] for n in splits]
    if starts[1:] and starts[1] == 0:
        raise ConfigError(f"split point {splits[0]!r} is the first layer, which would leave stage 0 empty.")
    if starts != sorted(starts):
        raise ConfigError(f"split points {splits} are not in the model's layer order {names}; stage k must "
                          "start after stage k-1.")
    stage_of, k = {}, 0
    for i, name in enumerate(names):
        while k + 1 < len(starts) and i >= starts[k + 1]:
            k += 1
        stage_of[name] = k
    return stage_of


def _from_mapping(placement: Mapping, names: list[str], index: dict, stages: int) -> dict[str, int]:
    explicit: dict[str, int] = {}
    grouped = all(isinstance(k, int) and not isinstance(k, bool) for k in placement)
    items = ([(name, stage) for stage, group in placement.items() for name in
              ([group] if isinstance(group, str) else list(group))] if grouped else list(placement.items()))
    for name, stage in items:
        if name not in index:
            raise _missing(name, names)
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < stages:
            raise ConfigError(f"placement puts layer {name!r} on stage {stage!r}; stages are 0..{stages - 1} "
                              f"(one per device of a pipeline).")
        if name in explicit:
            raise ConfigError(f"placement assigns layer {name!r} twice (stages {explicit[name]} and {stage}); "
                              "each layer runs on exactly one stage.")
        explicit[name] = stage
    stage_of, current = {}, 0
    for name in names:
        current = explicit.get(name, current)
        stage_of[name] = current
    return stage_of


def _check_stages(layers: list[LayerInfo], stage_of: dict[str, int], stages: int) -> None:
    empty = [k for k in range(stages) if k not in stage_of.values()]
    if empty:
        raise ConfigError(f"stage(s) {empty} have no layers; every device of the pipeline needs at least "
                          "one layer. Use fewer devices or move layers there.")
    backward = [(p, info.name) for info in layers for p in info.parents if stage_of[p] > stage_of[info.name]]
    if not backward:
        return
    producer, consumer = backward[0]
    hi, lo = stage_of[producer], stage_of[consumer]
    # Is there also a path lo -> ... -> hi? Then the stages would form a cycle.
    edges = {(stage_of[p], stage_of[i.name]) for i in layers for p in i.parents if stage_of[p] != stage_of[i.name]}
    reach, frontier = {lo}, [lo]
    while frontier:
        s = frontier.pop()
        for a, b in edges:
            if a == s and b not in reach:
                reach.add(b)
                frontier.append(b)
    why = (f"stages {lo} and {hi} would need a cycle (stage {lo} feeds stage {hi} and stage {hi} feeds "
           f"stage {lo})" if hi in reach else "stages must be numbered in data-flow order")
    raise ConfigError(f"layer {consumer!r} (stage {lo}) reads the output of {producer!r} (stage {hi}): {why}. "
                      "A layer's stage must be >= the stages of the layers it reads from.")
