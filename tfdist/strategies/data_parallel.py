"""DataParallel: what the data-parallel strategies share — ZeRO options and attachment, uneven-data agreement,
scoped hooks, memory_report."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import tensorflow as tf

from tfdist import sharding
from tfdist._compat.keras_model import model_of_step
from tfdist.comm.shard_collectives import ShardCollectives
from tfdist.training.uneven import UnevenData, check_mode

__all__ = ["DataParallel"]


class DataParallel:
    """Base of `MirroredStrategy`, `MultiWorkerMirroredStrategy` and `HorovodStrategy` (listed first
    among the bases, before the tf.distribute strategy class each one refines).

    - `zero_stage`/`offload` are checked once here, and the strategy registers itself with the
      sharding layer (`tfdist.sharding.register_strategy`), with the collectives its replicas use;
    - inside `scope()` and `run()` (and only there) Keras optimizers built for this strategy get
      their ZeRO engine (`tfdist.sharding.building_optimizers`); plain Keras elsewhere in the process
      runs the stock classes;
    - across processes, distributed datasets iterate under an uneven-data agreement
      (`tfdist.training.uneven`): every rank takes the same steps even when the ranks' datasets differ in
      length ("stop" at the shortest rank's end, or "join" with empty batches);
    - `memory_report(model)` measures per-replica bytes.

    A subclass calls `_check_zero_options` (and `check_mode` on its `uneven_data`) before building its
    StrategyExtended and `_register_sharding` and `_attach_uneven_data` after.
    """

    zero_stage: int = 0
    offload: bool = False
    zero_stages: tuple[int, ...] = sharding.SUPPORTED_STAGES  # the ZeRO stages this strategy runs
    uneven_data: str = "stop"
    _uneven: UnevenData | None = None

    def _check_zero_options(self, zero_stage, offload) -> None:
        self.zero_stage, self.offload = sharding.check_options(zero_stage, offload, stages=self.zero_stages)

    def _register_sharding(self, make_collectives: Callable[[], ShardCollectives], host_device: str | None = None):
        config = None
        if self.zero_stage:
            extra = {} if host_device is None else {"host_device": host_device}
            config = sharding.ZeroConfig(self.zero_stage, self.offload, make_collectives(), **extra)
        sharding.register_strategy(self, config)

    def _attach_uneven_data(self, mode: str, fused: bool) -> None:
        """Agrees on uneven per-rank data when this strategy spans several processes (one process: one
        pipeline, nothing to agree on). `fused`: the step's gradient all-reduce sums floats exactly, so the
        agreement can ride along with it (the extended is a `tfdist._compat.fused_flags` class)."""
        self.uneven_data = check_mode(mode)
        processes = self.num_replicas_in_sync // len(self.extended.worker_devices)
        if processes > 1:
            self._uneven = UnevenData(self, mode, host_device=self._host_device())
            if fused:
                self.extended.step_carrier = self._uneven

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
        with super().scope() as strategy, sharding.building_optimizers():
            yield strategy

    def run(self, fn, args=(), kwargs=None, options=None):
        """`tf.distribute.Strategy.run`; an optimizer first built inside `fn` (a custom training loop's
        first `apply_gradients`) is sharded as `zero_stage` says."""
        with sharding.building_optimizers(), self._uneven_step(fn):
            return super().run(fn, args=args, kwargs=kwargs, options=options)

    def _uneven_step(self, fn):
        if self._uneven is None:
            return contextlib.nullcontext()
        # Keras' train_step: its optimizer weighs each replica's loss (by 1 unless the data "join"s).
        self._uneven.weigh(getattr(model_of_step(fn), "optimizer", None))
        return self._uneven.step()

    def memory_report(self, model) -> sharding.MemoryReport:
        """Per-replica bytes of parameters, gradients and optimizer state of `model`'s training, for
        this process's replicas.

        Read from the devices and shapes of the variables (and of the gradient tensors the traced
        step keeps), next to the ZeRO formula for all `num_replicas_in_sync` replicas. Call it after
        the optimizer is built (after the first `fit` step or `model.optimizer.build(...)` in scope).
        """
        return sharding.memory_report(self, model)
