"""Builds a strategy from a short name, for the CLI and scripts that take the strategy as a setting."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from tfdist.errors import ConfigError

if TYPE_CHECKING:
    import tensorflow as tf

# The one table of strategy names: name -> (module, class), imported only when that strategy is built
# ("default" is TensorFlow's own default strategy and has no class here).
CLASSES = {
    "mirrored": ("tfdist.strategies.mirrored", "MirroredStrategy"),
    "multiworker": ("tfdist.strategies.multi_worker", "MultiWorkerMirroredStrategy"),
    "horovod": ("tfdist.strategies.horovod", "HorovodStrategy"),
    "placement": ("tfdist.strategies.layer_placement", "LayerPlacementStrategy"),
    "ps": ("tfdist.strategies.parameter_server", "ParameterServerStrategy"),
}

# name -> builder(replicas: int | None, **options) -> strategy: how a name and a replica count become options.
_BUILDERS: dict[str, Callable[..., tf.distribute.Strategy]] = {}


def strategy_class(name: str) -> type:
    """The strategy class called `name` in CLASSES (imported now)."""
    module, cls = CLASSES[name]
    return getattr(importlib.import_module(module), cls)


def register(name: str):
    """Decorator: makes `builder(replicas=None, **options)` available as strategy `name`."""

    def add(builder: Callable[..., tf.distribute.Strategy]) -> Callable[..., tf.distribute.Strategy]:
        _BUILDERS[name] = builder
        return builder

    return add


def strategy_names() -> list[str]:
    return sorted(_BUILDERS)


def make_strategy(name: str, replicas: int | None = None, **options) -> tf.distribute.Strategy:
    """Returns the strategy called `name` over `replicas` local replicas (None: all local devices).

    Example:
        >>> strategy = make_strategy("mirrored", replicas=4)
    """
    if name not in _BUILDERS:
        raise ConfigError(f"strategy must be one of {strategy_names()}, got {name!r}.")
    if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1):
        raise ConfigError(f"replicas must be a whole number >= 1, got {replicas!r}.")
    return _BUILDERS[name](replicas=replicas, **options)


def local_replica_devices(replicas: int | None) -> list[str] | None:
    """Device names for `replicas` local replicas: the first GPUs, or that many logical CPUs (None: all)."""
    if replicas is None:
        return None
    from tfdist.devices import process_devices

    return process_devices(replicas, parameter="replicas")


@register("mirrored")
def _mirrored(replicas: int | None = None, **options) -> tf.distribute.Strategy:
    return strategy_class("mirrored")(devices=local_replica_devices(replicas), **options)


@register("default")
def _default(replicas: int | None = None, **options) -> tf.distribute.Strategy:
    # No distribution at all: the baseline every other strategy is compared with.
    if replicas not in (None, 1):
        raise ConfigError(f"strategy 'default' runs one replica; got replicas={replicas}.")
    import tensorflow as tf

    return tf.distribute.get_strategy()


@register("horovod")
def _horovod(replicas: int | None = None, **options) -> tf.distribute.Strategy:
    # One process per launcher slot; `replicas` is the number of local devices of each process.
    return strategy_class("horovod")(local_devices=local_replica_devices(replicas), **options)


@register("multiworker")
def _multiworker(replicas: int | None = None, **options) -> tf.distribute.Strategy:
    # N processes from TF_CONFIG (e.g. `tfdist launch -n N`); `replicas` = local devices per worker.
    return strategy_class("multiworker")(local_devices=replicas, **options)


@register("placement")
def _placement(replicas: int | None = None, **options) -> tf.distribute.Strategy:
    # Layer placement: `replicas` devices become the stages of one pipeline ("auto" balance),
    # unless options say otherwise (placement=, balance=, micro_batches=, data_parallel=).
    return strategy_class("placement")(devices=local_replica_devices(replicas), **options)


@register("ps")
def _parameter_server(replicas: int | None = None, **options) -> tf.distribute.Strategy:
    # Asynchronous parameter-server training from TF_CONFIG (`tfdist launch -n N --ps K`): in ps and
    # worker processes this serves until the launcher stops it; `replicas` does not apply.
    if replicas not in (None, 1):
        raise ConfigError(f"strategy 'ps' runs one replica per worker process; got replicas={replicas}. "
                          "Add workers instead: tfdist launch -n N --ps K.")
    return strategy_class("ps")(**options)
