"""DataParallel: what the data-parallel strategies share — ZeRO options and attachment, uneven-data agreement,
scoped hooks, memory_report."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import keras
import tensorflow as tf

from tfdist.zero.attach import building_optimizers, configure_stage3, register_strategy
from tfdist.zero.config import SUPPORTED_STAGES, ZeroConfig, check_options, check_stage3_options
from tfdist.zero.memory import MemoryReport, memory_report
from tfdist._compat import keras_optimizer
from tfdist._compat.keras_model import model_of_step, step_objects
from tfdist.comm.sum_dtype import check_sum_dtype
from tfdist.data_parallel import _no_sync as grad_accumulate
from tfdist.data_parallel.buckets import DEFAULT_BUCKET_CAP_MB, GradientPath
from tfdist.data_parallel.comm_hooks import hook_from
from tfdist.data_parallel.uneven import UnevenData, check_mode
from tfdist.errors import ConfigError
from tfdist.zero.collectives import ShardCollectives

__all__ = ["DataParallel"]


class DataParallel:
    """Base of `MirroredStrategy`, `MultiWorkerMirroredStrategy` and `HorovodStrategy` (listed first
    among the bases, before the tf.distribute strategy class each one refines).

    - `zero_stage`/`offload` are checked once here, and the strategy registers itself with the
      sharding layer (`tfdist.register_strategy`), with the collectives its replicas use;
    - inside `scope()` and `run()` (and only there) Keras optimizers built for this strategy get
      their ZeRO engine (`tfdist.building_optimizers`); plain Keras elsewhere in the process
      runs the stock classes;
    - across processes, distributed datasets iterate under an uneven-data agreement
      (`tfdist.data_parallel.uneven`): every rank takes the same steps even when the ranks' datasets differ in
      length ("stop" at the shortest rank's end, or "join" with empty batches);
    - `memory_report(model)` measures per-replica bytes.

    A subclass calls `_check_zero_options` (and `check_mode` on its `uneven_data`) before building its
    StrategyExtended and `_register_sharding` and `_attach_uneven_data` after.
    """

    zero_stage: int = 0
    offload: bool = False
    zero_stages: tuple[int, ...] = SUPPORTED_STAGES  # the ZeRO stages this strategy runs
    uneven_data: str = "stop"
    _uneven: UnevenData | None = None
    gradient_path: GradientPath | None = None
    grad_dtype: tf.DType | None = None  # the dtype gradients are summed in across replicas (None: their own)
    _no_sync_depth: int = 0

    def _check_zero_options(self, zero_stage, offload, fsdp_unit_bytes=None, reshard_after_forward: bool = True,
                            fsdp_prefetch: bool = False) -> None:
        """Checks ZeRO's arguments (stage 3's too) before the strategy starts anything."""
        self.zero_stage, self.offload = check_options(zero_stage, offload, stages=self.zero_stages)
        check_stage3_options(self.zero_stage, fsdp_unit_bytes, reshard_after_forward, fsdp_prefetch)
        self._stage3_options = {"unit_bytes": fsdp_unit_bytes, "reshard_after_forward": reshard_after_forward,
                                "prefetch": fsdp_prefetch}

    def _check_grad_dtype(self, grad_dtype) -> None:
        """Checks `grad_dtype` (before the strategy starts anything); `_register_sharding` and
        `_attach_gradient_path` then sum the gradients in it."""
        self.grad_dtype = check_sum_dtype(grad_dtype, "grad_dtype")

    def _register_sharding(self, make_collectives: Callable[[], ShardCollectives], host_device: str | None = None):
        config = None
        if self.zero_stage:
            extra = {} if host_device is None else {"host_device": host_device}
            config = ZeroConfig(self.zero_stage, self.offload, make_collectives(), grad_dtype=self.grad_dtype,
                                **extra)
        register_strategy(self, config)
        if self.zero_stage == 3:
            configure_stage3(self, **self._stage3_options)

    def _attach_uneven_data(self, mode: str, fused: bool) -> None:
        """Agrees on uneven per-rank data when this strategy spans several processes (one process: one
        pipeline, nothing to agree on). `fused`: the step's gradient all-reduce sums floats exactly, so the
        agreement can ride along with it (the extended is a `tfdist.data_parallel._fused_flags` class)."""
        self.uneven_data = check_mode(mode)
        processes = self.num_replicas_in_sync // len(self.extended.worker_devices)
        if processes > 1:
            self._uneven = UnevenData(self, mode, host_device=self._host_device())
            if fused:
                self.extended.step_carrier = self._uneven

    # -- the gradient path: buckets and communication hooks (tfdist.data_parallel.buckets, docs/comm.md) -------------
    def _check_bucket_cap(self, bucket_cap_mb) -> float | None:
        if bucket_cap_mb is None:
            return None
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
            raise ConfigError(f"bucket_cap_mb must be a number of MB > 0 (PyTorch DDP's default is "
                              f"{DEFAULT_BUCKET_CAP_MB}) or None (one all-reduce after the whole backward), "
                              f"got {bucket_cap_mb!r}.")
        if self.zero_stage:
            raise ConfigError(f"bucket_cap_mb={bucket_cap_mb} needs zero_stage=0: with zero_stage={self.zero_stage} "
                              "ZeRO reduces the gradients its own way (reduce-scatter to the shards' owners). "
                              "Drop bucket_cap_mb or use zero_stage=0.")
        return float(bucket_cap_mb)

    def _attach_gradient_path(self, bucket_cap_mb: float | None) -> None:
        """Routes the step's gradient all-reduce through buckets of `bucket_cap_mb` (None: the stock path, until
        a hook is registered, or one bucket per dtype summed in `grad_dtype`). The extended is a
        `tfdist.data_parallel._grad_path` class. ZeRO sums in `grad_dtype` its own way (its ZeroConfig)."""
        if bucket_cap_mb is not None or (self.grad_dtype is not None and not self.zero_stage):
            self.gradient_path = GradientPath(bucket_cap_mb, self.num_replicas_in_sync, sum_dtype=self.grad_dtype)
            self.extended.gradient_router = self.gradient_path

    def set_bucket_cap(self, bucket_cap_mb: float | None) -> None:
        """Sets the gradient buckets' size in MB (None: back to one all-reduce after the whole backward, and no
        hook) for training steps traced from now on (a model compiled afterwards; Keras traces at the first step).

        Example:
            >>> strategy.set_bucket_cap(25)               # same as MirroredStrategy(bucket_cap_mb=25)
        """
        bucket_cap_mb = self._check_bucket_cap(bucket_cap_mb)
        hook = None if self.gradient_path is None or bucket_cap_mb is None else self.gradient_path.hook
        self.gradient_path = self.extended.gradient_router = None
        self._attach_gradient_path(bucket_cap_mb)
        if hook is not None:
            self.gradient_path.hook = hook

    def register_comm_hook(self, hook) -> None:
        """Makes each gradient bucket's all-reduce go through `hook` (PyTorch DDP's `register_comm_hook`).

        `hook`: 'fp16', 'bf16', 'powersgd', 'powersgd:RANK', a `tfdist.data_parallel.powersgd.PowerSGD(...)` or a
        callable `hook(bucket) -> list of tensors` (signature in `tfdist.data_parallel.comm_hooks`). Register it before
        the first training step is traced (before `fit`, or before the first call of a custom loop's
        `tf.function`), once. Without `bucket_cap_mb` buckets of the default 25 MB are used. zero_stage 0 only.

        Example:
            >>> strategy = tfdist.MirroredStrategy(bucket_cap_mb=25)
            >>> strategy.register_comm_hook("fp16")       # gradients travel as float16
        """
        if self.zero_stage:
            raise ConfigError(f"register_comm_hook: communication hooks apply at zero_stage=0 only; this strategy has "
                              f"zero_stage={self.zero_stage}, whose gradients are reduce-scattered to their shards' "
                              "owners (and ZeRO-1 needs the exact sum). Create the strategy with zero_stage=0.")
        if self.grad_dtype is not None:
            raise ConfigError(f"register_comm_hook: this strategy sums gradients in grad_dtype={self.grad_dtype.name}, "
                              "and a hook decides how they travel too; use one of them (the 'bf16' and 'fp16' hooks "
                              "are grad_dtype='bfloat16' / 'float16' in buckets).")
        hook = hook_from(hook)
        if self.gradient_path is None:
            self._attach_gradient_path(DEFAULT_BUCKET_CAP_MB)
        if self.gradient_path.hook is not None:
            raise ConfigError(f"register_comm_hook: a hook is already registered ({self.gradient_path.hook!r}); "
                              "register one hook per strategy (PyTorch DDP allows one too).")
        self.gradient_path.hook = hook

    # -- no_sync: accumulate k micro-steps locally, then one all-reduce of the sum --------------------------------
    @contextlib.contextmanager
    def no_sync(self, enabled: bool = True) -> Iterator[None]:
        """Inside it, `optimizer.apply_gradients` of this strategy's optimizers adds each replica's gradients to
        local sums instead: no all-reduce, no update, no step counted (PyTorch DDP's `no_sync`). The first
        `apply_gradients` outside it adds the sums to its own gradients: one all-reduce, one update.

        For custom training loops (`model.fit` has Keras' `gradient_accumulation_steps`, which cannot run under
        several local devices' merge_call). It is read when the step is traced: give the step's `tf.function` a
        Python bool so that each mode has its own trace, and start with a no_sync step. Scale the loss for the
        big batch (k micro-batches: divide by k times the global micro-batch).

        Example:
            >>> @tf.function
            ... def train_step(x, y, sync):                       # sync: a Python bool, one trace each
            ...     with strategy.no_sync(enabled=not sync):
            ...         strategy.run(replica_step, args=(x, y))   # replica_step calls optimizer.apply_gradients
            >>> for i, (x, y) in enumerate(micro_batches):
            ...     train_step(x, y, sync=(i + 1) % k == 0)
        """
        if self.zero_stage:
            raise ConfigError(f"no_sync: gradient accumulation here needs zero_stage=0 (this strategy has "
                              f"zero_stage={self.zero_stage}, whose gradients go to their shards' owners).")
        if not enabled:
            yield
            return
        optimizers = self._optimizers()
        if not optimizers:
            raise ConfigError("no_sync: no Keras optimizer was created in this strategy's scope, so there is none whose "
                              "apply_gradients could accumulate. Create the optimizer inside `with strategy.scope():`.")
        for optimizer in optimizers:
            accumulators = self._accumulators.setdefault(id(optimizer), grad_accumulate.Accumulators())
            if accumulators.synced_without or (not accumulators.sums and grad_accumulate.applied_steps(optimizer)):
                raise ConfigError(
                    f"no_sync: optimizer {optimizer.name!r} already applied gradients outside no_sync before its "
                    "first no_sync step, so that step's traced function holds no accumulated gradients. Start the "
                    "loop with a no_sync micro-step (e.g. sync=(i + 1) % k == 0), or use a fresh optimizer.")
            grad_accumulate.install(optimizer, lambda: self._no_sync_depth > 0, accumulators)
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1

    def _optimizers(self) -> list:
        tracked = self.__dict__.setdefault("_tracked_optimizers", weakref.WeakSet())
        return [o for o in tracked if keras_optimizer.optimizer_strategy(o) is self]

    @property
    def _accumulators(self) -> dict:
        return self.__dict__.setdefault("_no_sync_accumulators", {})

    def _track_optimizer(self, optimizer) -> None:
        if tf.distribute.get_strategy() is self:
            self.__dict__.setdefault("_tracked_optimizers", weakref.WeakSet()).add(optimizer)

    def uneven_data_agreements(self) -> dict[str, int] | None:
        """How this process's steps were agreed so far: {"fused": steps agreed inside the previous step's
        gradient all-reduce, "separate": steps that needed an all-reduce of their own (the first step of an
        epoch, steps after ones without a gradient all-reduce)}; None in a one-process job."""
        return None if self._uneven is None else self._uneven.agreements()

    def _host_device(self) -> str:
        """This process's CPU (where host-side state lives)."""
        first = tf.DeviceSpec.from_string(self.extended.worker_devices[0])
        return first.replace(device_type="CPU", device_index=0).to_string()

    def experimental_distribute_dataset(self, dataset, options=None, uneven_data: str | None = None):
        """`tf.distribute.Strategy.experimental_distribute_dataset`; across processes, the result iterates
        under the uneven-data agreement, as `uneven_data` says (None: the strategy's). Call it on every rank."""
        if uneven_data is not None:
            check_mode(uneven_data)
        distributed = super().experimental_distribute_dataset(dataset, options)
        return self._agreeing(distributed, options, uneven_data)

    def distribute_datasets_from_function(self, dataset_fn, options=None, uneven_data: str | None = None):
        """`tf.distribute.Strategy.distribute_datasets_from_function`; across processes, each rank's dataset
        may have its own length: the ranks agree on every step, as `uneven_data` says ('stop' or 'join'; None:
        the strategy's own). Call it on every rank."""
        if uneven_data is not None:
            check_mode(uneven_data)
        distributed = super().distribute_datasets_from_function(dataset_fn, options)
        return self._agreeing(distributed, options, uneven_data)

    def _agreeing(self, distributed, options, mode: str | None = None):
        per_replica = options is not None and (
            options.experimental_replication_mode == tf.distribute.InputReplicationMode.PER_REPLICA)
        if self._uneven is None or per_replica:  # one pipeline per replica: TF's own partial-batch handling
            return distributed
        return self._uneven.distribute(distributed, mode)

    @contextlib.contextmanager
    def scope(self) -> Iterator[tf.distribute.Strategy]:
        """`tf.distribute.Strategy.scope()`; inside it, optimizers built for this strategy are sharded
        as `zero_stage` says."""
        with super().scope() as strategy, building_optimizers(), \
                keras_optimizer.optimizer_hooks(_no_build, self._track_optimizer):
            yield strategy

    def run(self, fn, args=(), kwargs=None, options=None):
        """`tf.distribute.Strategy.run`; an optimizer first built inside `fn` (a custom training loop's
        first `apply_gradients`) is sharded as `zero_stage` says."""
        if self.zero_stage == 3:
            self._build_optimizer_before_the_step(fn)
        in_step = getattr(self.extended, "in_step", contextlib.nullcontext)
        with building_optimizers(), self._uneven_step(fn), in_step():
            return super().run(fn, args=args, kwargs=kwargs, options=options)

    def _build_optimizer_before_the_step(self, fn) -> None:
        # Stage 3 cuts the parameters into pieces when the optimizer is built. A custom loop's optimizer is
        # built by its first apply_gradients, after the step's forward has read the full parameters: build
        # it here instead, before `fn` is traced, on the model `fn` trains (found as the placement strategy
        # finds it). Keras' fit builds its optimizer before the first step, so this finds nothing to do.
        unbuilt = [o for o in self._optimizers() if not o.built]
        if not unbuilt:
            return
        model = model_of_step(fn)
        used = [o for o in step_objects(fn, keras.optimizers.Optimizer) if not o.built and o in unbuilt]
        if model is None or not model.built or len(used) != 1:
            return  # the step's apply raises a ConfigError that says to build the optimizer first
        with tf.init_scope(), self.scope():
            used[0].build(model.trainable_variables)

    def _uneven_step(self, fn):
        if self._uneven is None:
            return contextlib.nullcontext()
        # Keras' train_step: its optimizer weighs each replica's loss (by 1 unless the data "join"s).
        self._uneven.weigh(getattr(model_of_step(fn), "optimizer", None))
        return self._uneven.step()

    def memory_report(self, model) -> MemoryReport:
        """Per-replica bytes of parameters, gradients and optimizer state of `model`'s training, for
        this process's replicas.

        Read from the devices and shapes of the variables (and of the gradient tensors the traced
        step keeps), next to the ZeRO formula for all `num_replicas_in_sync` replicas. Call it after
        the optimizer is built (after the first `fit` step or `model.optimizer.build(...)` in scope).
        """
        return memory_report(self, model)


def _no_build(optimizer, variables) -> None:
    """The build side of the optimizer hooks DataParallel.scope() opens (it only tracks creations)."""
