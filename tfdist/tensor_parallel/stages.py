"""Data x tensor x pipeline: pipeline stages whose layers run on the stage's model-axis group of devices.

A rank-3 mesh (batch, stage, model) gives each data-parallel row S stages of T devices. A stage plan (the one
`LayerPlacementStrategy` makes: "auto" balancing, split points, or a dict) assigns each top-level layer a stage;
then, per row r and stage s, with group = devices[r][s] and home = group[0]:

- every variable of the stage's layers is first moved to the home device (`migrate.move_model_variables`, with
  the homes as the pipeline's devices), then the LayoutMap splits some of them over the group
  (`tensor_parallel_shard.shard_model` with per-layer groups): shard k on group[k];
- replicated layers (and layers that contain split sublayers, like a MultiHeadAttention whose projections are
  split) run on home with forward and backward there (`layer_call.place_layer_call`, as pipeline stages do),
  GPipe micro-batches included; the replicated ones also join their device's stream (`StageStreams`);
- top-level split layers (column/row Dense and Conv, Embedding) and per-feature layers between them keep their
  own explicit placement (each shard on its device, sums on home) and are only scoped to home, so a column
  layer's shards still reach the following row layer without a gather.

An activation crosses from stage s to s+1 once per boundary: copied from home(s) to home(s+1), or, when stage
s+1 starts with a column-parallel layer, to each device of its group (Megatron's f).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import keras
import tensorflow as tf

from tfdist._compat import keras_model
from tfdist.errors import ConfigError
from tfdist.pipeline.layer_call import place_layer_call
from tfdist.pipeline.microbatches import pipeline_model_call
from tfdist.pipeline.migrate import move_model_variables
from tfdist.pipeline.plan import BALANCE_BY, StagePlan, describe_model, make_plan
from tfdist.pipeline.streams import StageStreams
from tfdist.tensor_parallel.layout_map import LayoutMap
from tfdist.tensor_parallel.shard import ShardPlan, places_itself, shard_model

__all__ = ["StageOptions", "StagedShardPlan", "check_stage_placement", "shard_stages"]


@dataclasses.dataclass
class StageOptions:
    """ModelParallelStrategy's pipeline options, checked: `groups` is devices[row][stage][k] on a rank-3 mesh and
    None on a rank-2 one (then `placement` is None, `micro_batches` 1 and `streams` None)."""

    stage_axis: str
    groups: list[list[list[str]]] | None
    placement: object
    balance: str
    micro_batches: int
    streams: StageStreams | None

    @classmethod
    def check(cls, mesh, batch_dim_name: str, stage_dim_name: str, placement, balance: str, micro_batches: int,
              stage_streams: bool | None) -> StageOptions:
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise ConfigError(f"micro_batches must be a whole number >= 1, got {micro_batches!r}.")
        if balance not in BALANCE_BY or balance == "time":
            # "time" times each layer alone, with its variables read outside any replica: not possible once the
            # strategy's scope has created them (LayerPlacementStrategy measures before moving them).
            raise ConfigError(f"balance must be 'params' or 'flops' for ModelParallelStrategy stages, got "
                              f"{balance!r}; to balance measured times, place the stages by hand (placement=[...]).")
        if len(mesh.shape) != 3:
            if placement is not None or micro_batches != 1:
                raise ConfigError(
                    f"placement={placement!r} / micro_batches={micro_batches} need pipeline stages, but the mesh "
                    f"{mesh.axis_names} has no stage axis; use a rank-3 mesh, e.g. DeviceMesh((2, 2, 2), ('batch', "
                    f"{stage_dim_name!r}, 'model'), devices), or leave them out.")
            return cls(stage_dim_name, None, None, balance, 1, None)
        placement = "auto" if placement is None else placement
        if isinstance(placement, str) and placement != "auto":
            raise ConfigError(f"placement must be 'auto', a list of split layer names, or a dict; got {placement!r}.")
        use_streams = micro_batches > 1 if stage_streams is None else bool(stage_streams)
        return cls(stage_dim_name, mesh.stage_groups(batch_dim_name, stage_dim_name), placement, balance,
                   micro_batches, StageStreams() if use_streams else None)


@dataclasses.dataclass
class StagedShardPlan:
    """Which stage each layer is on (`stages`, a `StagePlan` over the groups' home devices) and how the layers
    are split over their stage's group (`shards`, a `ShardPlan`)."""

    stages: StagePlan
    shards: ShardPlan
    groups: list[list[list[str]]]  # devices[row][stage][k]

    @property
    def layers(self):
        """The split layers (as `ShardPlan.layers`)."""
        return self.shards.layers

    def __str__(self) -> str:
        lines = [str(self.stages), str(self.shards), "stage groups (row, stage): devices"]
        for r, row in enumerate(self.groups):
            for s, group in enumerate(row):
                lines.append(f"  ({r}, {s}): {group}")
        return "\n".join(lines)


def check_stage_placement(placement, stages: int, stage_dim_name: str) -> None:
    """ConfigError when a list of split points cannot give exactly `stages` stages (the stage axis' size)."""
    if isinstance(placement, (list, tuple)) and len(placement) != stages - 1:
        raise ConfigError(f"placement lists {len(placement)} split layer name(s), i.e. {len(placement) + 1} stages, "
                          f"but the mesh's {stage_dim_name!r} axis has size {stages}; give {stages - 1} split "
                          f"point(s), or a DeviceMesh whose {stage_dim_name!r} axis has {len(placement) + 1} devices.")


def _nested(layer) -> list:
    return [layer, *keras_model.all_layers(layer)] if isinstance(layer, keras.layers.Layer) else [layer]


def _scope_layer_call(layer, device_for_replica: Callable[[], str]) -> None:
    """Runs a layer's traced forward under its stage's home device without wrapping its tensors: a split layer
    places its shards itself, and a following row-parallel layer must still find its output's shards."""
    original = layer.call

    @functools.wraps(original)
    def call(*args, **kwargs):
        if any(isinstance(t, keras.KerasTensor) for t in tf.nest.flatten((args, kwargs))):
            return original(*args, **kwargs)
        with tf.device(device_for_replica()):
            return original(*args, **kwargs)

    layer.call = call


def shard_stages(strategy: tf.distribute.Strategy, model: keras.Model, layout_map: LayoutMap,
                 groups: Sequence[Sequence[Sequence[str]]], replica: Callable[[], int], *, model_axis: str,
                 batch_axis: str, stage_axis: str, placement="auto", balance: str = "params",  # or "flops"
                 micro_batches: int = 1, streams: StageStreams | None = None) -> StagedShardPlan:
    """Assigns `model`'s layers to stages, moves their variables to their stage's group and splits them by
    `layout_map`; wraps the layer calls (and, with micro_batches > 1, the model call). `groups[r][s]` is row r's
    stage-s group, `replica()` the calling replica's row. Call inside `strategy.scope()`, eagerly, once."""
    homes = [[group[0] for group in row] for row in groups]
    try:
        graph = keras_model.layer_graph(model)
    except TypeError as err:
        raise ConfigError(f"cannot place model {model.name!r} on stages: {err}.") from None
    infos = describe_model(model)
    check_stage_placement(placement, len(homes[0]), stage_axis)
    try:
        plan = make_plan(infos, placement, homes, balance=balance, micro_batches=micro_batches)
    except ConfigError as err:
        raise ConfigError(f"placement={placement!r}: {err} (ModelParallelStrategy has one stage per index of the "
                          f"mesh's {stage_axis!r} axis, {len(homes[0])} in all.)") from None
    move_model_variables(strategy, model, graph, plan)
    stage_of_layer = {}
    for layer, *_ in graph:
        for inner in _nested(layer):
            stage_of_layer.setdefault(id(inner), plan.stage_of[layer.name])

    def group_devices(stage: int) -> list[str]:
        return list(groups[replica()][stage])

    def group_of(layer):
        stage = stage_of_layer.get(id(layer), 0)
        return [list(row[stage]) for row in groups], functools.partial(group_devices, stage)

    every = [[d for group in row for d in group] for row in groups]
    shards = shard_model(strategy, model, layout_map, every, model_axis, batch_axis,
                         functools.partial(group_devices, 0), groups=group_of)
    for layer, *_ in graph:
        stage = plan.stage_of[layer.name]
        home = functools.partial(lambda s: groups[replica()][s][0], stage)
        if places_itself(layer):
            _scope_layer_call(layer, home)
        elif any(places_itself(inner) for inner in _nested(layer)[1:]):
            # e.g. a MultiHeadAttention with split projections: its backward runs once, from one tape (a stream's
            # separate input- and weight-gradient passes would run the split sublayers' backward twice)
            place_layer_call(layer, home, None, lag=stage)
        else:
            place_layer_call(layer, home, streams, lag=stage)
    pipeline_model_call(model, micro_batches, streams)
    return StagedShardPlan(plan, shards, [[list(g) for g in row] for row in groups])
