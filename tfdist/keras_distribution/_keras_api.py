"""Private: what `tfdist.enable_keras_distribution()` reaches in Keras' distribution API, and only once it is called.

- `keras.src.distribution.distribution_lib.set_distribution`: Keras' setter of the current distribution, which
  `Distribution.scope()` also calls (looked up in its module at call time). It is wrapped so that each change is
  handed to tfdist first; the public names that were bound to it (`keras.distribution.set_distribution`) are
  pointed at the wrapper.
- `keras.src.backend.tensorflow.distribution_lib`: the TensorFlow backend's half of the API. It lacks
  `initialize`, `num_processes` and `process_id` (Keras calls them from `keras.distribution.initialize` and from
  every `Distribution`'s constructor); tfdist provides them, and a `list_devices` that names every process's
  devices once the job is initialized.
- `keras.src.saving.saving_lib.get_attr_skipset`: each time Keras saves an object it builds a throwaway one of
  its kind (for an optimizer, an `Optimizer` and its two variables) to list the attributes to skip; it means to
  keep the list, but reads it under another name than it stores it. Under a strategy made current by a
  distribution across processes, creating a variable is a collective (tfdist makes every process's initial values
  identical), which a process saving alone would wait on forever. The wrapper builds each list once, in a thread
  of its own, where no strategy is current.
- `Distribution.distribute_dataset`: on JAX it gives each process its part of a dataset. Under a tfdist strategy
  the strategy does that (keeping the dataset's known length, which Keras' re-batching loses: Keras then runs one
  more step per epoch), so for a distribution tfdist drives it returns the dataset whole (`leave_datasets_whole`).
- `ModelParallel._layout_map`: the layout map a `keras.distribution.ModelParallel` was given (no public reader);
  `Model._distribute_strategy`: the strategy Keras recorded when a model was created.

`disable()` puts everything back.
"""

from __future__ import annotations

import tfdist._compat  # noqa: F401  (the TF/Keras version check, before any reach-in below)

import functools
import sys
import threading
from collections.abc import Callable

from keras.src.backend.tensorflow import distribution_lib as tf_backend
from keras.src.distribution import distribution_lib as keras_lib
from keras.src.saving import saving_lib

__all__ = ["current", "disable", "enable", "enabled", "is_base_distribution", "keras_list_devices",
           "layout_map_of", "leave_datasets_whole", "strategy_of"]

_MISSING = object()
_saved: dict[str, object] = {}  # backend attribute -> what it was (_MISSING: absent)
_rebound: list[tuple[object, str, object]] = []  # (module, attribute, original) pointed at the wrapper


def enabled() -> bool:
    return bool(_saved)


def enable(on_change: Callable[[object], None], backend_functions: dict[str, Callable]) -> None:
    """Calls `on_change(distribution)` before Keras records each new current distribution, and gives the
    TensorFlow backend `backend_functions` (name -> function)."""
    if enabled():
        return
    original = keras_lib.set_distribution

    @functools.wraps(original)
    def set_distribution(value):
        on_change(value)  # first: a refused distribution leaves Keras' current one as it was
        original(value)

    for name, module in list(sys.modules.items()):
        if name.startswith("keras") and module is not None and getattr(module, "set_distribution", None) is original:
            _rebound.append((module, "set_distribution", original))
            module.set_distribution = set_distribution
    _rebound.append((saving_lib, "get_attr_skipset", saving_lib.get_attr_skipset))
    saving_lib.get_attr_skipset = _skipset_outside_strategies(saving_lib.get_attr_skipset)
    for name, function in backend_functions.items():
        _saved[name] = getattr(tf_backend, name, _MISSING)
        setattr(tf_backend, name, function)


def disable() -> None:
    for module, name, original in _rebound:
        setattr(module, name, original)
    _rebound.clear()
    for name, value in _saved.items():
        if value is _MISSING:
            delattr(tf_backend, name)
        else:
            setattr(tf_backend, name, value)
    _saved.clear()


def _skipset_outside_strategies(original: Callable) -> Callable:
    built: dict[str, set] = {}

    @functools.wraps(original)
    def get_attr_skipset(obj_type):
        if obj_type not in built:
            found: list = []
            thread = threading.Thread(target=lambda: found.append(original(obj_type)), name="keras-skipset")
            thread.start()  # a thread starts with no tf.distribute strategy current
            thread.join()
            if not found:
                return original(obj_type)  # it raised there: raise here, as Keras would
            built[obj_type] = found[0]
        return set(built[obj_type])

    return get_attr_skipset


def current():
    """Keras' current distribution (None when none is set)."""
    return keras_lib.distribution()


def keras_list_devices(device_type=None) -> list[str]:
    """The TensorFlow backend's own `list_devices` (this process's devices, as 'cpu:0')."""
    return _saved.get("list_devices", tf_backend.list_devices)(device_type)


def leave_datasets_whole(distribution) -> None:
    """`distribution.distribute_dataset(dataset)` returns `dataset` (for this distribution object only)."""
    distribution.distribute_dataset = lambda dataset: dataset


def is_base_distribution(distribution) -> bool:
    """`distribution` is an instance of Keras' abstract `Distribution` itself (not exported by keras.distribution)."""
    return type(distribution) is keras_lib.Distribution


def strategy_of(model):
    """The tf.distribute strategy Keras recorded when `model` was created (None: none was current)."""
    return model._distribute_strategy


def layout_map_of(distribution):
    """The `keras.distribution.LayoutMap` a `ModelParallel` was built with."""
    return distribution._layout_map
