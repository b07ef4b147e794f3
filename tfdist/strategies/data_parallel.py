"""DataParallel: what the data-parallel strategies share — ZeRO options and attachment, scoped hooks, memory_report."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import tensorflow as tf

from tfdist import sharding
from tfdist.comm.shard_collectives import ShardCollectives

__all__ = ["DataParallel"]


class DataParallel:
    """Base of `MirroredStrategy`, `MultiWorkerMirroredStrategy` and `HorovodStrategy` (listed first
    among the bases, before the tf.distribute strategy class each one refines).

    - `zero_stage`/`offload` are checked once here, and the strategy registers itself with the
      sharding layer (`tfdist.sharding.register_strategy`), with the collectives its replicas use;
    - inside `scope()` and `run()` (and only there) Keras optimizers built for this strategy get
      their ZeRO engine (`tfdist.sharding.building_optimizers`); plain Keras elsewhere in the process
      runs the stock classes;
    - `memory_report(model)` measures per-replica bytes.

    A subclass calls `_check_zero_options` before building its StrategyExtended and
    `_register_sharding` after.
    """

    zero_stage: int = 0
    offload: bool = False

    def _check_zero_options(self, zero_stage, offload) -> None:
        self.zero_stage, self.offload = sharding.check_options(zero_stage, offload)

    def _register_sharding(self, make_collectives: Callable[[], ShardCollectives], host_device: str | None = None):
        config = None
        if self.zero_stage:
            extra = {} if host_device is None else {"host_device": host_device}
            config = sharding.ZeroConfig(self.zero_stage, self.offload, make_collectives(), **extra)
        sharding.register_strategy(self, config)

    @contextlib.contextmanager
    def scope(self) -> Iterator[tf.distribute.Strategy]:
        """`tf.distribute.Strategy.scope()`; inside it, optimizers built for this strategy are sharded
        as `zero_stage` says."""
        with super().scope() as strategy, sharding.building_optimizers():
            yield strategy

    def run(self, fn, args=(), kwargs=None, options=None):
        """`tf.distribute.Strategy.run`; an optimizer first built inside `fn` (a custom training loop's
        first `apply_gradients`) is sharded as `zero_stage` says."""
        with sharding.building_optimizers():
            return super().run(fn, args=args, kwargs=kwargs, options=options)

    def memory_report(self, model) -> sharding.MemoryReport:
        """Per-replica bytes of parameters, gradients and optimizer state of `model`'s training, for
        this process's replicas.

        Read from the devices and shapes of the variables (and of the gradient tensors the traced
        step keeps), next to the ZeRO formula for all `num_replicas_in_sync` replicas. Call it after
        the optimizer is built (after the first `fit` step or `model.optimizer.build(...)` in scope).
        """
        return sharding.memory_report(self, model)
