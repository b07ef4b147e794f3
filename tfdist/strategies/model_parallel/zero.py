"""ModelParallelStrategy's update path for an optimizer being built: a ZeRO engine per device group (zero_stage > 0)
or stage 0's summed-gradient update, told which shards make one logical variable (clipnorm takes its norm); and the
collectives those engines use when the batch axis spans processes (TF collective groups or Horovod)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import keras
import tensorflow as tf

from tfdist._compat import distribute as tf_distribute
from tfdist.errors import ConfigError
from tfdist.tensor_parallel._tf_rows import column_launchers
from tfdist.tensor_parallel.optimizer_state import logical_keys
from tfdist.tensor_parallel.processes import device_position
from tfdist.zero.attach import engine_of, register_engine
from tfdist.zero.collectives import LocalCollectives
from tfdist.zero.config import check_stage3_options
from tfdist.zero.fsdp.mesh_engine import GroupedZero3Engine
from tfdist.zero.mesh_engine import GroupedZeroEngine
from tfdist.zero.replica_values import tf_variable
from tfdist.zero.stage0_update import RowNorms, SummedGradientUpdate
from tfdist.zero.tf_collectives import TFShardCollectives

__all__ = ["Stage3Options", "attach_update", "horovod_zero_collectives", "zero_collectives"]


@dataclass(frozen=True)
class Stage3Options:
    """zero_stage=3's FSDP options, with `tfdist.MirroredStrategy`'s names and meaning, per device group."""

    unit_bytes: int | None = None
    reshard_after_forward: bool = True
    prefetch: bool = False

    @classmethod
    def check(cls, zero_stage: int, fsdp_unit_bytes, reshard_after_forward, fsdp_prefetch) -> Stage3Options:
        """Validated as the data-parallel strategies do (a ConfigError naming the parameter)."""
        check_stage3_options(zero_stage, fsdp_unit_bytes, reshard_after_forward, fsdp_prefetch)
        for name, value, default in (("reshard_after_forward", reshard_after_forward, True),
                                     ("fsdp_prefetch", fsdp_prefetch, False)):
            if value is not default and zero_stage != 3:
                raise ConfigError(f"{name}={value} is a ZeRO stage 3 option (how gathered parameters are kept or "
                                  f"fetched); it needs zero_stage=3 (got zero_stage={zero_stage}).")
        return cls(None if fsdp_unit_bytes is None else int(fsdp_unit_bytes), reshard_after_forward, fsdp_prefetch)


def attach_update(strategy, optimizer, variables: list, target, plans: list, options: Stage3Options,
                  collectives: Callable[[], dict]) -> None:
    """Before Keras' build creates the slots: at zero_stage > 0 a `GroupedZeroEngine` / `GroupedZero3Engine` over
    `variables` (the shards; `target`: the model, for stage 3's units; `collectives()`: the engines' host device
    and collectives); at stage 0 the `SummedGradientUpdate` when the optimizer clips or averages. A
    LossScaleOptimizer's inner optimizer is the one sharded. With the model axis across processes (rows spanning
    processes, stage 0 only) clipnorm and global_clipnorm sum the shards' squares over the row's processes."""
    # clipnorm takes each logical variable's norm (over its shards); the keys say which shards belong together
    logical = logical_keys(plans, variables)
    # A row across processes (zero_stage 0 only): this process holds only its shards; clipping sums their squares
    # over the row's processes with the split layers' own row all-reduce (`RowNorms`).
    span = next((plan.span for plan in plans if getattr(plan, "span", None) is not None), None)
    row = None
    if span is not None:
        shards = {id(shard) for plan in plans for split in plan.layers for group in split.shards.values()
                  for shard in group}
        row = RowNorms(span.all_reduce, frozenset(id(v) for v in variables if id(v) in shards),
                       strategy.extended.worker_devices[0])
        inner = getattr(optimizer, "inner_optimizer", optimizer)
        norm = [f"{name}={value}" for name, value in (("clipnorm", inner.clipnorm),
                                                       ("global_clipnorm", inner.global_clipnorm)) if value]
        if norm and (inner is not optimizer or inner.gradient_accumulation_steps):
            # Keras' own path then clips per process: the norm of this process's shards only.
            raise ConfigError(f"{norm[0]} with the model axis across processes (a mesh row that spans processes) "
                              "is supported without gradient_accumulation_steps and outside a LossScaleOptimizer "
                              f"(got gradient_accumulation_steps={inner.gradient_accumulation_steps}, "
                              f"{type(optimizer).__name__}): each process would take the norm of its own shards "
                              "only. Drop one of them, or use a mesh whose rows each stay inside one process.")
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if not strategy.zero_stage and inner.gradient_accumulation_steps and tf_distribute.uses_merge_call(strategy):
        # Keras' accumulation puts the update inside a tf.cond; rows that meet in a merge_call cannot run it there.
        raise ConfigError(f"gradient_accumulation_steps={inner.gradient_accumulation_steps} at zero_stage=0 needs one "
                          "mesh row per process (this process runs several, which meet in a merge_call). Use "
                          "zero_stage=1 or higher (its engine accumulates), or accumulate in a custom loop.")
    if strategy.zero_stage and engine_of(optimizer) is None and not isinstance(
            optimizer, keras.optimizers.LossScaleOptimizer):
        devices = [[c.device for c in strategy.experimental_local_results(tf_variable(v))] for v in variables]
        if strategy.zero_stage == 3:  # parameters too: pieces gathered per unit (an attention as one unit)
            if target is None:
                raise ConfigError("zero_stage=3 shards the parameters of a Keras model created inside the "
                                  "strategy's scope; the optimizer is being built for variables of no such model. "
                                  "Create the model (and compile it) inside `with strategy.scope():`.")
            engine = GroupedZero3Engine(optimizer, variables, devices, target, **collectives(),
                                        whole=lambda layer: isinstance(layer, keras.layers.MultiHeadAttention),
                                        logical=logical, unit_bytes=options.unit_bytes,
                                        reshard_after_forward=options.reshard_after_forward,
                                        prefetch=options.prefetch, grad_dtype=strategy.grad_dtype)
        else:
            engine = GroupedZeroEngine(optimizer, variables, devices, strategy.zero_stage,
                                       **collectives(), logical=logical, grad_dtype=strategy.grad_dtype)
        register_engine(optimizer, engine)
    # Stage 0: clipping on the summed gradient and Keras' EMA over rows that meet in a merge_call, as ZeRO does.
    if not strategy.zero_stage and SummedGradientUpdate.needed(optimizer):
        SummedGradientUpdate.attach(optimizer, {id(v): key for v, key in zip(variables, logical)}, row)


def zero_collectives(strategy, grid: Sequence[Sequence[str]], first_row: int, cache: dict) -> dict:
    """ModelParallelStrategy's GroupedZeroEngine host device and collectives: device copies in one process;
    across processes the group of each mesh column (a group's devices: one per row), whose members are the rows
    in rank order: with one row per process the strategy's group of that device position, with several a group
    of its own (`column_launchers`, one per column, kept in `cache` for every optimizer of the strategy).
    `grid`: this process's mesh rows; `first_row`: the global index of its first."""
    if strategy.size == 1:
        return {"collectives": LocalCollectives}
    timeout_s = strategy.timeout_s
    host = tf.DeviceSpec.from_string(grid[0][0]).replace(device_type="CPU", device_index=0).to_string()

    def collectives(devices: list[str]) -> TFShardCollectives:
        own = [strategy.extended.launcher_for(d) for d in devices]
        if len(devices) == 1:
            return TFShardCollectives.over_launchers(own, [first_row], strategy.size, timeout_s)
        # TF ranks a group's members by process, then device index: each local copy's piece is its rank.
        order = sorted(range(len(devices)), key=lambda i: device_position(devices[i]))
        shard_ids = [first_row + order.index(i) for i in range(len(devices))]
        launchers = cache.get(tuple(devices))
        if launchers is None:
            column = min(device_position(d)[1] for d in devices)  # a column's devices are its own: a unique key
            launchers = cache[tuple(devices)] = column_launchers(strategy, devices, column,
                                                                 strategy.size * len(grid), timeout_s, own)
        return TFShardCollectives.over_launchers(launchers, shard_ids, strategy.size * len(grid), timeout_s)

    return {"host_device": host, "collectives": collectives}


def horovod_zero_collectives(strategy) -> dict:
    """The GroupedZeroEngine's collectives when the batch axis spans Horovod ranks and each rank holds whole rows:
    per mesh column (a group's devices: this rank's copies, one per local row, in row order) `tfdist.HorovodStrategy`'s
    `HorovodShardCollectives` over every rank. Its numbering is the one the engine needs: local copy i of rank p owns
    piece p * M + i (M rows per rank), and row p * M + i is this rank's i-th row because rows go rank by rank
    (`process_rows`). It concatenates the copies in the order given, so the numbering does not depend on device
    indices (TF's groups rank members by device index; `zero_collectives` reorders for them). A column's set is
    every rank: Horovod's global process set, ops paired across ranks by their traced names (SPMD)."""
    from tfdist.zero.horovod_collectives import HorovodShardCollectives  # imports Horovod: only when it is asked for

    def collectives(devices: list[str]) -> HorovodShardCollectives:
        return HorovodShardCollectives(devices, strategy.rank, strategy.size, strategy.timeout_s)

    return {"collectives": collectives}
