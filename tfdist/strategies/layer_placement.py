"""tfdist.LayerPlacementStrategy: model parallelism by layers, GPipe micro-batches, data x model."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Mapping, Sequence

import keras
import tensorflow as tf

from tfdist._compat import distribute as tf_distribute
from tfdist._compat import keras_model, keras_optimizer, tf_runtime
from tfdist.data_parallel.input_reuse import ReusedInputIterators
from tfdist.devices import resolve_devices
from tfdist.errors import ConfigError
from tfdist.pipeline.balance import measure_stage_costs
from tfdist.pipeline.layer_call import colocate_with_inputs, place_layer_call
from tfdist.pipeline.microbatches import check_batch, pipeline_model_call
from tfdist.pipeline.migrate import move_model_variables
from tfdist.pipeline.plan import BALANCE_BY, StagePlan, describe_model, make_plan
from tfdist.pipeline.streams import StageStreams

__all__ = ["LayerPlacementStrategy"]


class LayerPlacementStrategy(ReusedInputIterators, tf.distribute.MirroredStrategy):
    """Splits a Keras model by layers over devices (pipeline stages), for the ordinary Keras path.

    Each layer's variables, forward and backward ops and optimizer slots live on its stage's device.
    `micro_batches=M` pipelines each batch GPipe-style; `data_parallel=D` runs D such pipelines over D x K
    devices. Use it when a model with its optimizer state does not fit on one device. Build the model inside
    `scope()`; it is placed on its first fit/evaluate/predict step, or by `strategy.place(model)`.

    Args:
        devices: device names, or None for all local devices (GPUs, else logical CPUs).
        placement: "auto" (balanced contiguous stages), a list of K-1 layer names where stages
            2..K start, {layer_name: stage} (unnamed layers join the previous layer's stage), or
            {stage: [layer names]}.
        balance: what "auto" balances: "params" (default), "flops" (estimated) or "time" (measured).
        micro_batches: GPipe micro-batches per step (must divide the per-replica batch).
        stage_streams: one op stream per stage device, running its layer calls in trace order; None
            (default): on when micro_batches > 1.
        data_parallel: number of pipeline replicas D; len(devices) must be a multiple of D.

    Example:
        >>> import keras, numpy as np, tfdist
        >>> tfdist.devices.virtual_cpus(4)
        >>> strategy = tfdist.LayerPlacementStrategy(["/cpu:0", "/cpu:1"], micro_batches=4)
        >>> with strategy.scope():
        ...     model = tfdist.models.cnn()
        ...     model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        >>> print(strategy.place(model))              # the plan: layer -> stage/device
        >>> model.fit(np.random.rand(64, 28, 28, 1), np.arange(64) % 10, batch_size=32)

    Guide: docs/layer-placement.md.
    """

    def __init__(
        self,
        devices: Sequence[str] | None = None,
        placement: str | Sequence[str] | Mapping = "auto",
        balance: str = "params",
        micro_batches: int = 1,
        data_parallel: int = 1,
        stage_streams: bool | None = None,
    ):
        for name, value in (("micro_batches", micro_batches), ("data_parallel", data_parallel)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a whole number >= 1, got {value!r}.")
        if balance not in BALANCE_BY:
            raise ConfigError(f"balance must be one of {list(BALANCE_BY)}, got {balance!r}.")
        if isinstance(placement, str) and placement != "auto":
            raise ConfigError(f"placement must be 'auto', a list of split layer names, or a dict; got {placement!r}.")
        resolved = resolve_devices(devices)
        if len(resolved) % data_parallel:
            raise ConfigError(f"data_parallel={data_parallel} does not divide the {len(resolved)} devices "
                              f"{resolved}; pass data_parallel x stages devices.")
        stages = len(resolved) // data_parallel
        self._grid = [resolved[r * stages:(r + 1) * stages] for r in range(data_parallel)]
        self._placement = placement
        self._balance = balance
        self._micro_batches = micro_batches
        use_streams = micro_batches > 1 if stage_streams is None else bool(stage_streams)
        self._streams = StageStreams() if use_streams else None
        self._plans: dict[int, tuple[weakref.ref, StagePlan]] = {}
        self._last_plan: StagePlan | None = None
        self._measure_batch: int | None = None  # micro-batch size, once a batch has been seen
        self._optimizers: weakref.WeakSet = weakref.WeakSet()  # created in scope(): their slots move too
        # ReductionToOneDevice reduces each gradient on the first device its destination lives
        # on, i.e. per stage: stage k's gradients are summed on replica 0's stage-k device and
        # copied to the other replicas' stage-k devices (never through stage 0).
        tf_distribute.init_strategy(self, lambda: tf_distribute.PipelineExtended(
            self, [row[0] for row in self._grid], tf.distribute.ReductionToOneDevice()))

    # --- public ---------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self._grid[0])

    @property
    def stage_devices(self) -> list[list[str]]:
        """devices[replica][stage]."""
        return [list(row) for row in self._grid]

    def placement_plan(self, model: keras.Model | None = None) -> StagePlan:
        """The stage plan of `model` (placing it if needed), or of the last model placed.

        `print(strategy.placement_plan())` shows layer -> stage/device with parameters,
        estimated FLOPs and activation bytes per sample, and each stage's totals.
        """
        if model is not None:
            return self.place(model)
        if self._last_plan is None:
            raise ConfigError("no model has been placed yet: build it inside strategy.scope() and train it, "
                              "or call strategy.placement_plan(model) / strategy.place(model).")
        return self._last_plan

    def place(self, model: keras.Model) -> StagePlan:
        """Places a model built inside `scope()` on the stages and returns its plan (idempotent)."""
        entry = self._plans.get(id(model))
        if entry is not None and entry[0]() is model:
            return entry[1]
        if not isinstance(model, keras.Model):
            raise ConfigError(f"place() needs a Keras model, got {type(model).__name__}.")
        if not model.built:
            raise ConfigError(f"model {model.name!r} is not built; give it a keras.Input (or call build()) "
                              "inside strategy.scope() before placing it.")
        try:
            graph = keras_model.layer_graph(model)
        except TypeError as err:
            raise ConfigError(f"cannot place model {model.name!r}: {err}.") from None
        with tf.init_scope():  # may be called while Keras traces its first step
            infos = describe_model(model)
            if self._balance == "time" and self._placement == "auto":
                measure_stage_costs(graph, infos, self._grid[0][0], self._measure_batch or 64)
            plan = make_plan(infos, self._placement, self._grid, balance=self._balance,
                             micro_batches=self._micro_batches)
            with self.scope():
                move_model_variables(self, model, graph, plan, optimizers=list(self._optimizers))
        for layer, *_ in graph:
            stage = plan.stage_of[layer.name]
            place_layer_call(layer, functools.partial(self._device, stage), self._streams, lag=stage)
        pipeline_model_call(model, self._micro_batches, self._streams)
        self._plans[id(model)] = (weakref.ref(model), plan)
        self._last_plan = plan
        return plan

    # --- tf.distribute hooks ----------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self):
        """The strategy's scope; optimizers created in it are remembered, so that placing a model later
        also moves (and re-indexes) an optimizer a custom training loop built before its first step."""
        with super().scope() as strategy, keras_optimizer.optimizer_hooks(_check_build, self._optimizers.add):
            yield strategy

    def run(self, fn, args=(), kwargs=None, options=None):
        model = keras_model.model_of_step(fn)
        if model is not None:
            if self._measure_batch is None:  # balance='time' measures at the micro-batch size
                sizes = [t.shape[0] for t in tf.nest.flatten((args, kwargs or {}))
                         if tf.is_tensor(t) and t.shape.rank and t.shape[0] is not None]
                if sizes and sizes[0] >= self._micro_batches:
                    self._measure_batch = sizes[0] // self._micro_batches
            self.place(model)
        return super().run(self._in_pipeline(fn), args=args, kwargs=kwargs, options=options)

    def experimental_distribute_dataset(self, dataset, options=None):
        batch = tf_runtime.dataset_batch_size(dataset)
        check_batch(batch, len(self._grid), self._micro_batches)
        if batch and self._measure_batch is None:
            self._measure_batch = max(batch // (len(self._grid) * self._micro_batches), 1)
        return super().experimental_distribute_dataset(dataset, options)

    # --- internals --------------------------------------------------------------------------
    def _replica(self) -> int:
        if len(self._grid) == 1:
            return 0
        ctx = tf.distribute.get_replica_context()
        if ctx is None or ctx.num_replicas_in_sync == 1:
            return 0
        value = tf.get_static_value(ctx.replica_id_in_sync_group)
        return int(value) if value is not None else 0

    def _device(self, stage: int) -> str:
        return self._grid[self._replica()][stage]

    def _in_pipeline(self, fn):
        @functools.wraps(fn)
        def replica_fn(*args, **kwargs):
            if not tf.inside_function():
                return fn(*args, **kwargs)
            # Ops built outside any layer (loss, metrics, gradient sums over micro-batches)
            # follow their inputs instead of defaulting to the replica's first device.
            with tf.compat.v1.device(colocate_with_inputs(self._device(0))):
                return fn(*args, **kwargs)

        return replica_fn


def _check_build(optimizer, variables) -> None:
    """Placement needs no build hook (slots follow their variable through PlacementExtended); it only refuses
    what several pipelines cannot run."""
    strategy = tf.distribute.get_strategy()
    if (isinstance(strategy, LayerPlacementStrategy) and optimizer.gradient_accumulation_steps
            and strategy.num_replicas_in_sync > 1):
        # Keras puts an accumulating update inside tf.cond; pipelines meeting in a merge_call cannot run it there.
        raise ConfigError(f"gradient_accumulation_steps={optimizer.gradient_accumulation_steps} needs one pipeline "
                          f"(data_parallel=1; this strategy runs {strategy.num_replicas_in_sync}). Use "
                          "micro_batches=M to accumulate within a step, or one pipeline.")
