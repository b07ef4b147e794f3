"""tfdist.ModelParallelStrategy: feature splitting (tensor parallelism) x data parallelism, by a LayoutMap."""

from __future__ import annotations

import contextlib
import functools
import weakref

import keras
import tensorflow as tf

from tfdist._compat import distribute as tf_distribute
from tfdist._compat import keras_model, keras_optimizer, tf_runtime
from tfdist.comm.sum_dtype import check_sum_dtype
from tfdist.data_parallel._sum_in_dtype import sum_gradients_in
from tfdist.data_parallel.input_reuse import ReusedInputIterators
from tfdist.errors import ConfigError, check_seconds
from tfdist.pipeline.layer_call import colocate_with_inputs
from tfdist.pipeline.microbatches import check_batch
from tfdist.strategies.model_parallel.zero import (
    Stage3Options,
    attach_update,
    horovod_zero_collectives,
    zero_collectives,
)
from tfdist.tensor_parallel.horovod_processes import choose_backend, horovod_row_span, horovod_rows, start_horovod
from tfdist.tensor_parallel.layout_map import LayoutMap, as_layout_map
from tfdist.tensor_parallel.memory import SplitMemoryReport, split_memory_report
from tfdist.tensor_parallel.processes import check_process_options, process_rows, row_span, start_processes
from tfdist.tensor_parallel.shard import (
    ShardPlan,
    keep_logical_optimizer_saving,
    shard_model,
)
from tfdist.tensor_parallel.span import RowDevices
from tfdist.tensor_parallel.stages import StagedShardPlan, StageOptions, shard_stages
from tfdist.zero.attach import engine_of
from tfdist.zero.config import check_stage
from tfdist.zero.loss_scale import agree_on_finite_gradients
from tfdist.zero.mesh_engine import GroupedZeroEngine
from tfdist.zero.replica_values import tf_variable

__all__ = ["ModelParallelStrategy"]


class ModelParallelStrategy(ReusedInputIterators, tf.distribute.MirroredStrategy):
    """Splits variables over the mesh's model axis (Megatron-style) and data over its batch axis.

    Same vocabulary as `keras.distribution.ModelParallel`: a `LayoutMap` says which dimension of which variable
    is split over which mesh axis; variables without a rule are replicated. Each row of the mesh (one index of
    `batch_dim_name`) is a data-parallel replica; a rank-3 mesh ("batch", "stage", "model") also cuts the model into
    pipeline stages, and the mesh may span processes (`tfdist launch`, or Horovod). Build and compile the model
    inside `scope()`; saving writes the full logical variables, so a `.keras` file loads at any mesh shape.

    Args:
        layout_map: a `tfdist.LayoutMap` (or `keras.distribution.LayoutMap`) over a `tfdist.DeviceMesh`.
        batch_dim_name: the mesh axis along which data is split ("batch"); a mesh without it is one row.
        stage_dim_name: on a rank-3 mesh, the axis of pipeline stages ("stage"); the third axis splits variables.
        placement: rank-3 meshes only: "auto" (default there: contiguous stages balanced by `balance`), a list of S-1
            layer names where stages 2..S start, {layer_name: stage} or {stage: [layer names]}.
        balance: what "auto" balances: "params" (default) or "flops" (estimated), counted over whole (unsplit) layers.
        micro_batches: GPipe micro-batches per step (rank-3 meshes; must divide the per-replica batch).
        stage_streams: one op stream per stage device (see `LayerPlacementStrategy`); None: on when micro_batches > 1.
        timeout_s: across processes only: seconds to wait for the other processes at start-up and in any one
            collective.
        zero_stage: ZeRO over the batch axis: 0 (default), 1 (each of the R rows keeps 1/R of the optimizer state),
            2 (and of the summed gradient) or 3 (and of the parameters: FSDP). Element-wise optimizers only.
        fsdp_unit_bytes, reshard_after_forward, fsdp_prefetch: zero_stage 3's options, as in
            `tfdist.MirroredStrategy`, per device group.
        backend: across processes, who moves the bytes: "auto" (default), "tf" or "horovod".
        grad_dtype: the dtype gradients are summed in over the batch axis, each cast before the sum and back after
            (`"bfloat16"` under a `mixed_bfloat16` policy halves the bytes; None: their own dtype), at every
            `zero_stage`, as in `tfdist.MirroredStrategy`. In one process, or across processes with whole rows
            per process.

    Example:
        >>> import keras, numpy as np, tfdist
        >>> tfdist.devices.virtual_cpus(4)
        >>> mesh = tfdist.DeviceMesh((2, 2), ("batch", "model"), ["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"])
        >>> layout_map = tfdist.LayoutMap(mesh)
        >>> layout_map[".*up/kernel"] = (None, "model")   # paths in a Sequential: "sequential/up/kernel"
        >>> layout_map[".*up/bias"] = ("model",)
        >>> layout_map[".*down/kernel"] = ("model", None)
        >>> strategy = tfdist.ModelParallelStrategy(layout_map, batch_dim_name="batch")
        >>> with strategy.scope():
        ...     model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="up"),
        ...                               keras.layers.Dense(4, name="down")])
        ...     model.compile(optimizer="adam", loss="mse")
        >>> model.fit(np.random.rand(64, 8), np.random.rand(64, 4), batch_size=16, verbose=0)
        >>> print(strategy.shard_plan(model))          # which device holds which slice

    Guide: docs/tensor-parallel.md.
    """

    def __init__(self, layout_map, batch_dim_name: str = "batch", *, stage_dim_name: str = "stage",
                 placement=None, balance: str = "params", micro_batches: int = 1, stage_streams: bool | None = None,
                 timeout_s: float = 60.0, zero_stage: int = 0, fsdp_unit_bytes: int | None = None,
                 reshard_after_forward: bool = True, fsdp_prefetch: bool = False, backend: str = "auto",
                 grad_dtype=None):
        self.zero_stage = check_stage(zero_stage, (0, 1, 2, 3))
        self.grad_dtype = check_sum_dtype(grad_dtype, "grad_dtype")
        self._fsdp = Stage3Options.check(self.zero_stage, fsdp_unit_bytes, reshard_after_forward, fsdp_prefetch)
        self._layout_map: LayoutMap = as_layout_map(layout_map)
        mesh = self._layout_map.device_mesh
        if not isinstance(batch_dim_name, str):
            raise ConfigError(f"batch_dim_name must be a mesh axis name (str), got {batch_dim_name!r}.")
        if len(mesh.shape) >= 2 and batch_dim_name not in mesh.axis_names:
            raise ConfigError(f"batch_dim_name={batch_dim_name!r} is not an axis of the mesh {mesh.axis_names}; "
                              "name its data-parallel axis.")
        self._batch_axis = batch_dim_name
        self._stages = StageOptions.check(mesh, batch_dim_name, stage_dim_name, placement, balance, micro_batches,
                                          stage_streams)
        self._groups = self._stages.groups  # devices[row][stage][k] on a rank-3 mesh, else None
        self._staged: dict[int, tuple[weakref.ref, StagedShardPlan]] = {}
        others = [a for a in mesh.axis_names if a not in (batch_dim_name, stage_dim_name if self._groups else None)]
        self._model_axis = others[0] if others else "model"
        self._grid = mesh.grid(batch_dim_name)
        self._model_size = mesh.axis_size(self._model_axis) if self._groups else len(self._grid[0])
        self._plans: dict[int, tuple[weakref.ref, ShardPlan]] = {}
        self._models: weakref.WeakSet = weakref.WeakSet()
        self._logical_saving: weakref.WeakSet = weakref.WeakSet()  # optimizers that save their state logically
        self.timeout_s = check_seconds(timeout_s, "timeout_s")
        self.rank, self.size, self._first_row = 0, 1, 0  # this process among the job's (tfdist.cluster.rank)
        self.backend = choose_backend(backend)  # across processes: TF collectives or Horovod
        tf_backend = self.backend == "tf"
        rows = process_rows(self._grid) if tf_backend else horovod_rows(self._grid, self.timeout_s)
        self.saves_collectively = rows is not None and rows.span_first is not None  # see tfdist.training.save_model
        if rows is not None and self.grad_dtype is not None and rows.span_first is not None:
            raise ConfigError(
                f"grad_dtype={self.grad_dtype.name}: ModelParallelStrategy sums gradients in another dtype within one "
                "process and across processes with whole rows per process; this mesh puts the model axis across "
                "processes. Keep each row inside one process, or leave grad_dtype=None.")
        if rows is not None:  # the batch axis across processes: this process runs its own rows (processes.py)
            check_process_options(rows, self.zero_stage, self._groups, stage_dim_name, self.backend)
            make_extended, self._server = (start_processes if tf_backend else start_horovod)(self, rows, self.timeout_s)
            self.rank, self.size, self._first_row, self._grid = rows.rank, rows.size, rows.first_row, rows.local_grid
            tf_distribute.init_strategy(self, lambda: sum_gradients_in(
                make_extended(), None if self.zero_stage else self.grad_dtype,
                "under ModelParallelStrategy at zero_stage 0"))
            if self.saves_collectively:  # the model axis across processes: this process's part of its row
                span = row_span(self, rows) if tf_backend else horovod_row_span(rows, self._server)
                self._grid = [RowDevices(rows.local_grid[0], span)]
            return
        # Gradients of shard k are summed over the rows on row 0's k-th device and copied back (never through
        # one device for all shards); replicated variables' on row 0's first device.
        # grad_dtype: at zero_stage 0 each gradient is cast where it lives around that reduction; ZeRO's engines
        # cast their reduce-scatters themselves.
        tf_distribute.init_strategy(self, lambda: sum_gradients_in(
            tf_distribute.PlacementExtended(self, [row[0] for row in self._grid], tf.distribute.ReductionToOneDevice()),
            None if self.zero_stage else self.grad_dtype, "under ModelParallelStrategy at zero_stage 0"))
        # (rank 3: a row's first device is its stage-0 group's first device; the same reduction then sums each
        # variable on row 0's copy of it, i.e. on its own stage group.)

    # --- public ---------------------------------------------------------------------------------
    @property
    def layout_map(self) -> LayoutMap:
        return self._layout_map

    @property
    def mesh_rows(self) -> list[list[str]]:
        """devices[row][k]: row = data-parallel replica, k = position on the model axis (on a rank-3 mesh: the
        row's stage x model devices, stage-major; see `stage_groups`; across processes: this process's rows)."""
        return [list(row) for row in self._grid]

    @property
    def stage_groups(self) -> list[list[list[str]]] | None:
        """devices[row][stage][k] on a rank-3 mesh (each [row][stage] is one tensor-parallel group), else None."""
        return None if self._groups is None else [[list(g) for g in row] for row in self._groups]

    def placement_plan(self, model: keras.Model) -> StagedShardPlan:
        """Rank-3 meshes: the model's stages (layer -> stage/home device) and its split, placing it if needed."""
        if self._groups is None:
            raise ConfigError("placement_plan needs pipeline stages: a rank-3 mesh (batch, stage, model).")
        self.shard(model)
        return self._staged[id(model)][1]

    def shard(self, model: keras.Model) -> ShardPlan:
        """Splits a model built inside `scope()` by the layout map (idempotent) and returns the plan."""
        entry = self._plans.get(id(model))
        if entry is not None and entry[0]() is model:
            return entry[1]
        if not isinstance(model, keras.Model) or not model.built:
            raise ConfigError(f"shard() needs a built Keras model (give it a keras.Input inside strategy.scope()), "
                              f"got {model!r}.")
        optimizer = getattr(model, "optimizer", None)
        # An optimizer built on the logical variables: its slots would be full-size, its index would miss the shards.
        if (optimizer is not None and getattr(optimizer, "built", False) and self._model_size > 1
                and len(self._layout_map) and _knows_any(optimizer, model.trainable_variables)):
            raise ConfigError("the model's optimizer was built before the model was split; build it inside "
                              "strategy.scope() (fit does), or call strategy.shard(model) first.")
        with tf.init_scope(), self.scope():
            if self._groups is not None:
                options = self._stages
                staged = shard_stages(self, model, self._layout_map, self._groups, self._replica,
                                      model_axis=self._model_axis, batch_axis=self._batch_axis,
                                      stage_axis=options.stage_axis, placement=options.placement,
                                      balance=options.balance, micro_batches=options.micro_batches,
                                      streams=options.streams)
                self._staged[id(model)] = (weakref.ref(model), staged)
                plan = staged.shards
            else:
                plan = shard_model(self, model, self._layout_map, self._grid, self._model_axis, self._batch_axis,
                                   self._row_devices)
        self._plans[id(model)] = (weakref.ref(model), plan)
        return plan

    def shard_plan(self, model: keras.Model) -> ShardPlan:
        """The model's split: layers, shard shapes, bytes of variables per device (splits it if needed)."""
        return self.shard(model)

    def memory_report(self, model: keras.Model) -> SplitMemoryReport:
        """Bytes each mesh device holds for `model` (weights, gradients, optimizer state), read from the devices
        its variables live on, next to a replicated device's (splits the model if needed). With stages, a row's
        S x T devices share the model: `model_axis_size` is then S x T.

        Example:
            >>> report = strategy.memory_report(model)       # after fit: optimizer slots included
            >>> round(report.ratio("params"), 4), 1 / report.model_axis_size     # Transformer block, T = 2
            (0.5013, 0.5)
            >>> print(report)                                # one row per device, MiB
        """
        self.shard(model)
        engine = engine_of(model)
        if isinstance(engine, GroupedZeroEngine):  # ZeRO: the slots are views of per-device pieces
            optimizer = engine.optimizer
            logical = [v for v in optimizer.variables if engine.slot_reference(v) is not None]
            report = split_memory_report(model, self.mesh_rows, (logical, engine.state_variables),
                                         engine.kept_gradient_bytes if self.zero_stage == 2 else None)
            report.zero_stage = self.zero_stage
        else:
            report = split_memory_report(model, self.mesh_rows)
        if self._groups is not None:  # a row's devices are S stages x T: the ideal share is 1/(S*T)
            report.mesh_shape = self._layout_map.device_mesh.shape
        return report

    # --- tf.distribute hooks ---------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self):
        """The strategy's scope: models created in it are remembered, and a Keras optimizer built in it on a
        model's variables first splits that model and is then built on the shards."""
        with super().scope() as strategy, keras_model.model_hooks(self._models.add), \
                keras_optimizer.optimizer_hooks(self._on_optimizer_build):
            yield strategy

    def run(self, fn, args=(), kwargs=None, options=None):
        model = keras_model.model_of_step(fn)
        if model is not None and model.built:
            self.shard(model)
        if self._groups is not None:
            fn = self._in_pipeline(fn)
        return super().run(fn, args=args, kwargs=kwargs, options=options)

    def experimental_distribute_dataset(self, dataset, options=None):
        if self._groups is not None:
            check_batch(tf_runtime.dataset_batch_size(dataset), len(self._groups), self._stages.micro_batches)
        return super().experimental_distribute_dataset(dataset, options)

    # --- internals --------------------------------------------------------------------------------
    def _replica(self) -> int:
        """The calling replica's row among this process's rows (0 outside a replica context)."""
        if len(self._grid) == 1:
            return 0
        ctx = tf.distribute.get_replica_context()
        if ctx is None or ctx.num_replicas_in_sync == 1:
            return 0
        value = tf.get_static_value(ctx.replica_id_in_sync_group)  # global: rows of earlier processes first
        return int(value) - self._first_row if value is not None else 0

    def _in_pipeline(self, fn):
        def replica_fn(*args, **kwargs):
            if not tf.inside_function():
                return fn(*args, **kwargs)
            # Ops built outside any layer (loss, metrics, backward sums) follow their inputs instead of
            # defaulting to the row's first device (as in LayerPlacementStrategy).
            with tf.compat.v1.device(colocate_with_inputs(self._groups[self._replica()][0][0])):
                return fn(*args, **kwargs)

        return functools.wraps(fn)(replica_fn)

    def _row_devices(self) -> list[str]:
        return self._grid[self._replica()]

    def _on_optimizer_build(self, optimizer, variables) -> None:
        if keras_optimizer.optimizer_strategy(optimizer) is not self:
            return
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and self.num_replicas_in_sync > 1:
            agree_on_finite_gradients(optimizer)  # every row skips the same steps
        ids = {id(v) for v in variables}
        # The model compiled with this optimizer, else the largest model holding these variables (a Sequential
        # holds a functional model over the same layers: split once, by the outer one).
        models = sorted((m for m in list(self._models) if m.built), key=lambda m: -len(m.weights))
        models.sort(key=lambda m: getattr(m, "optimizer", None) is not optimizer)
        target = None
        for model in models:
            if any(id(v) in ids for v in model.trainable_variables):
                self.shard(model)
                target = model
                break
        expanded = []
        for v in variables:
            expanded.extend(self._shards_of(v) or [v])
        if len(expanded) != len(variables) or any(a is not b for a, b in zip(expanded, variables)):
            if not isinstance(variables, list):
                raise ConfigError("build the optimizer with a list of variables (model.trainable_variables).")
            variables[:] = expanded  # Keras builds on this very list: the shards, not the logical variables
        # Also when the model was split before (strategy.shard/shard_plan): its variables are shards already.
        shards = {id(shard) for _, plan in self._plans.values() for split in plan.layers
                  for parts in split.shards.values() for shard in parts}
        attach_update(self, optimizer, variables, target, [plan for _, plan in self._plans.values()], self._fsdp,
                      self._zero_collectives)
        if optimizer not in self._logical_saving and any(id(v) in shards for v in variables):
            keep_logical_optimizer_saving(optimizer, lambda: [plan for _, plan in self._plans.values()],
                                          functools.partial(self._slot_reference, optimizer))
            self._logical_saving.add(optimizer)

    def _zero_collectives(self) -> dict:
        """The GroupedZeroEngine's host device and collectives (`processes.zero_collectives`; over Horovod
        ranks `horovod.horovod_zero_collectives`)."""
        if self.backend == "horovod" and self.size > 1:
            return horovod_zero_collectives(self)
        return zero_collectives(self, self._grid, self._first_row, self.__dict__.setdefault("_column_launchers", {}))

    def _slot_reference(self, optimizer, variable):
        """The tf variable an optimizer variable is a slot of (None for other optimizer variables)."""
        engine = engine_of(optimizer)
        if isinstance(engine, GroupedZeroEngine):
            reference = engine.slot_reference(variable)  # a logical view of ZeRO's pieces
            if reference is not None:
                return tf_variable(reference)
        return self.extended.slot_reference(tf_variable(variable))

    def _shards_of(self, variable) -> list | None:
        for ref, plan in self._plans.values():
            for split in plan.layers:
                for role, kv in split.logical.items():
                    if kv is variable and role in split.shards:
                        return split.shards[role]
        return None


def _knows_any(optimizer, variables) -> bool:
    for variable in variables:
        try:
            keras_optimizer.variable_index(optimizer, variable)
            return True
        except (KeyError, ValueError):
            continue
    return False

