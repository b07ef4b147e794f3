"""tfdist.ModelParallelStrategy: feature splitting (tensor parallelism) x data parallelism, by a LayoutMap."""

from __future__ import annotations

import contextlib
import weakref

import keras
import tensorflow as tf

from tfdist._compat import distribute as tf_distribute
from tfdist._compat import keras_model, keras_optimizer
from tfdist.errors import ConfigError, check_seconds
from tfdist.placement.layout_map import LayoutMap, as_layout_map
from tfdist.placement.tensor_parallel_shard import ShardPlan, keep_logical_optimizer_saving, shard_model
from tfdist.placement.split_memory import SplitMemoryReport, split_memory_report
from tfdist.strategies.input_reuse import ReusedInputIterators
from tfdist.strategies.model_parallel_procs import process_rows, start_processes

__all__ = ["ModelParallelStrategy"]


class ModelParallelStrategy(ReusedInputIterators, tf.distribute.MirroredStrategy):
    """Splits variables over the mesh's model axis (Megatron-style) and data over its batch axis.

    Same vocabulary as `keras.distribution.ModelParallel`: a `LayoutMap` says which dimension of which variable
    is split over which mesh axis. Each row of the mesh (one index of `batch_dim_name`) is a replica, as in
    MirroredStrategy; inside a row, shard k of a split variable is a variable on the row's k-th device, and the
    split layer computes there. Column-parallel Dense (kernel `(None, "model")`, bias `("model",)`) followed by
    a row-parallel Dense (kernel `("model", None)`) exchange nothing between them: one all-reduce forward and
    one backward per pair. Embedding splits its vocabulary (`("model", None)`) or features. Variables without
    a rule are replicated (computed on the row's first device). Saving writes the full logical variables, so a
    `.keras` file loads at any mesh shape and in plain Keras.

    The model is split when its optimizer is built (inside `fit`, or `optimizer.build(...)` in the scope), or
    on its first step, or by `strategy.shard(model)`; build and compile the model inside `scope()`. Like
    `tfdist.MirroredStrategy`, it keeps one input iterator per distributed dataset (`reuse_input_iterators`).

    Args:
        layout_map: a `tfdist.LayoutMap` (or `keras.distribution.LayoutMap`) over a `tfdist.DeviceMesh`.
        batch_dim_name: the mesh axis along which data is split ("batch"); a mesh without it is one row.
        timeout_s: across processes only: seconds to wait for the other processes at start-up and in any one
            collective.

    Across processes (`tfdist launch -n N --devices-per-worker M`): the mesh lists every process's devices,
    '/job:worker/replica:0/task:T/device:CPU:I' (`tfdist.cluster.list_devices()`), the batch axis spans the
    processes and each process holds whole rows (the model axis stays inside it). Create the mesh and the
    strategy first thing (before TensorFlow initialises); each process reads its own part of every global batch,
    gradients are summed over its rows and then across processes per device, so every process applies the same
    update. Variables start as rank 0's. Save with `tfdist.cluster.save_model(model, path)` on every process (the
    chief writes); `predict` returns each process's own part of every batch. See docs/tensor-parallel.md.

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
    """

    def __init__(self, layout_map, batch_dim_name: str = "batch", timeout_s: float = 60.0):
        self._layout_map: LayoutMap = as_layout_map(layout_map)
        mesh = self._layout_map.device_mesh
        if not isinstance(batch_dim_name, str):
            raise ConfigError(f"batch_dim_name must be a mesh axis name (str), got {batch_dim_name!r}.")
        if len(mesh.shape) == 2 and batch_dim_name not in mesh.axis_names:
            raise ConfigError(f"batch_dim_name={batch_dim_name!r} is not an axis of the mesh {mesh.axis_names}; "
                              "name its data-parallel axis.")
        self._batch_axis = batch_dim_name
        others = [a for a in mesh.axis_names if a != batch_dim_name]
        self._model_axis = others[0] if others else "model"
        self._grid = mesh.grid(batch_dim_name)
        self._plans: dict[int, tuple[weakref.ref, ShardPlan]] = {}
        self._models: weakref.WeakSet = weakref.WeakSet()
        self._logical_saving: weakref.WeakSet = weakref.WeakSet()  # optimizers that save their state logically
        self.timeout_s = check_seconds(timeout_s, "timeout_s")
        self.rank, self.size, self._first_row = 0, 1, 0  # this process among the job's (tfdist.cluster.rank)
        rows = process_rows(self._grid)
        if rows is not None:  # the batch axis across processes: this process runs its own rows (model_parallel_procs)
            make_extended, self._server = start_processes(self, rows, self.timeout_s)
            self.rank, self.size, self._first_row, self._grid = rows.rank, rows.size, rows.first_row, rows.local_grid
            tf_distribute.init_strategy(self, make_extended)
            return
        # Gradients of shard k are summed over the rows on row 0's k-th device and copied back (never through
        # one device for all shards); replicated variables' on row 0's first device.
        tf_distribute.init_strategy(self, lambda: tf_distribute.PlacementExtended(
            self, [row[0] for row in self._grid], tf.distribute.ReductionToOneDevice()))

    # --- public ---------------------------------------------------------------------------------
    @property
    def layout_map(self) -> LayoutMap:
        return self._layout_map

    @property
    def mesh_rows(self) -> list[list[str]]:
        """devices[row][k]: row = data-parallel replica, k = position on the model axis (across processes: this
        process's rows)."""
        return [list(row) for row in self._grid]

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
        if (optimizer is not None and getattr(optimizer, "built", False) and len(self._grid[0]) > 1
                and len(self._layout_map) and _knows_any(optimizer, model.trainable_variables)):
            raise ConfigError("the model's optimizer was built before the model was split; build it inside "
                              "strategy.scope() (fit does), or call strategy.shard(model) first.")
        with tf.init_scope(), self.scope():
            plan = shard_model(self, model, self._layout_map, self._grid, self._model_axis, self._batch_axis,
                               self._row_devices)
        self._plans[id(model)] = (weakref.ref(model), plan)
        return plan

    def shard_plan(self, model: keras.Model) -> ShardPlan:
        """The model's split: layers, shard shapes, bytes of variables per device (splits it if needed)."""
        return self.shard(model)

    def memory_report(self, model: keras.Model) -> SplitMemoryReport:
        """Bytes each mesh device holds for `model` (weights, gradients, optimizer state), read from the devices
        its variables live on, next to a replicated device's (splits the model if needed).

        Example:
            >>> report = strategy.memory_report(model)       # after fit: optimizer slots included
            >>> round(report.ratio("params"), 4), 1 / report.model_axis_size     # Transformer block, T = 2
            (0.5013, 0.5)
            >>> print(report)                                # one row per device, MiB
        """
        self.shard(model)
        return split_memory_report(model, self.mesh_rows)

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
        return super().run(fn, args=args, kwargs=kwargs, options=options)

    # --- internals --------------------------------------------------------------------------------
    def _row_devices(self) -> list[str]:
        if len(self._grid) == 1:
            return self._grid[0]
        ctx = tf.distribute.get_replica_context()
        if ctx is None or ctx.num_replicas_in_sync == 1:
            return self._grid[0]
        value = tf.get_static_value(ctx.replica_id_in_sync_group)  # global: rows of earlier processes first
        return self._grid[int(value) - self._first_row if value is not None else 0]

    def _on_optimizer_build(self, optimizer, variables) -> None:
        if keras_optimizer.optimizer_strategy(optimizer) is not self:
            return
        ids = {id(v) for v in variables}
        # The model compiled with this optimizer, else the largest model holding these variables (a Sequential
        # holds a functional model over the same layers: split once, by the outer one).
        models = sorted((m for m in list(self._models) if m.built), key=lambda m: -len(m.weights))
        models.sort(key=lambda m: getattr(m, "optimizer", None) is not optimizer)
        for model in models:
            if any(id(v) in ids for v in model.trainable_variables):
                self.shard(model)
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
        if optimizer not in self._logical_saving and any(id(v) in shards for v in variables):
            keep_logical_optimizer_saving(optimizer, lambda: [plan for _, plan in self._plans.values()],
                                          self.extended.slot_reference)
            self._logical_saving.add(optimizer)

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
