"""`tfdist.enable_keras_distribution()`: Keras' own distribution API drives tfdist strategies on TensorFlow."""

from __future__ import annotations

import json
import os
import weakref

import keras
import numpy as np
import tensorflow as tf

from tfdist._compat import keras_model, tf_runtime
from tfdist.cluster.global_devices import list_devices as job_devices
from tfdist.comm.launch_env import local_device_count
from tfdist.devices import local_devices, resolve_devices
from tfdist.errors import ConfigError
from tfdist.keras_distribution import _keras_api
from tfdist.strategies.mirrored import MirroredStrategy
from tfdist.strategies.model_parallel.strategy import ModelParallelStrategy
from tfdist.strategies.multi_worker import MultiWorkerMirroredStrategy

__all__ = ["disable_keras_distribution", "enable_keras_distribution", "strategy_for"]

_strategies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Keras distribution -> its strategy
_job = {"processes": 1, "rank": 0, "initialized": False}
_active: list = [None]  # the strategy the current Keras distribution set


def enable_keras_distribution() -> None:
    """Makes `keras.distribution` drive tfdist on TensorFlow, for the rest of the process (idempotent).

    Until this call plain Keras is untouched (on TensorFlow, Keras accepts a distribution and trains on one
    device). After it, code written for Keras-on-JAX runs unchanged: `keras.distribution.set_distribution(...)`
    or `with distribution.scope():` makes the matching tfdist strategy current, so models built after it are
    distributed and `fit`, `evaluate`, `predict`, saving and custom loops run under it:

    - `DataParallel(devices=...)` or `DataParallel(device_mesh=...)`: `tfdist.MirroredStrategy` over the mesh's
      devices; across processes (after `keras.distribution.initialize`), `tfdist.MultiWorkerMirroredStrategy`.
    - `ModelParallel(layout_map=..., batch_dim_name=...)`: `tfdist.ModelParallelStrategy` with that layout map.

    `keras.distribution.initialize(job_addresses, num_processes, process_id)` joins a job of several processes
    (every process's "host:port", comma-separated); with no arguments it reads the `KERAS_DISTRIBUTION_*`
    variables, else the TF_CONFIG that `tfdist launch` and tfdist's SLURM set-up give each process.
    `keras.distribution.list_devices()` then names every process's devices.

    Example:
        >>> import keras, numpy as np, tfdist
        >>> tfdist.devices.virtual_cpus(2)
        >>> tfdist.enable_keras_distribution()
        >>> distribution = keras.distribution.DataParallel(devices=keras.distribution.list_devices())
        >>> with distribution.scope():
        ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        ...     model.compile(optimizer="sgd", loss="mse")
        ...     model.fit(np.ones((8, 4)), np.ones((8, 1)), batch_size=4, verbose=0)
        ...     model.distribute_strategy.num_replicas_in_sync
        2

    Guide: docs/keras-distribution.md.
    """
    if keras.backend.backend() != "tensorflow":
        raise ConfigError(f"enable_keras_distribution() is for Keras on TensorFlow; this Keras runs on "
                          f"{keras.backend.backend()!r}, whose own keras.distribution needs no tfdist.")
    if _keras_api.enabled():
        return
    _keras_api.enable(_on_change, {"initialize": _initialize, "num_processes": lambda: _job["processes"],
                                   "process_id": lambda: _job["rank"], "list_devices": _list_devices,
                                   "get_device_count": lambda device_type=None: len(_list_devices(device_type))})
    if _keras_api.current() is not None:
        _on_change(_keras_api.current())


def disable_keras_distribution() -> None:
    """Undoes `enable_keras_distribution()`: no tfdist strategy is current and Keras' API is as shipped."""
    if _active[0] is not None:
        tf.distribute.experimental_set_strategy(None)
        _active[0] = None
    _keras_api.disable()


def strategy_for(distribution) -> tf.distribute.Strategy:
    """The tfdist strategy a `keras.distribution` DataParallel or ModelParallel stands for (one per object)."""
    strategy = _strategies.get(distribution)
    if strategy is None:
        strategy = _strategies[distribution] = _new_strategy(distribution)
        _keras_api.leave_datasets_whole(distribution)
    return strategy


def _new_strategy(distribution) -> tf.distribute.Strategy:
    devices = [str(d) for d in np.asarray(distribution.device_mesh.devices).flatten()]
    local = _local_devices_of(devices)
    if isinstance(distribution, keras.distribution.ModelParallel):
        return _built_under_it(ModelParallelStrategy)(_keras_api.layout_map_of(distribution),
                                                      batch_dim_name=distribution.batch_dim_name)
    if isinstance(distribution, keras.distribution.DataParallel):
        if _job["processes"] > 1:
            return _built_under_it(MultiWorkerMirroredStrategy)(local_devices=local)
        return _built_under_it(MirroredStrategy)(devices=local)
    raise ConfigError(f"keras.distribution.{type(distribution).__name__} has no tfdist strategy; use "
                      "keras.distribution.DataParallel or keras.distribution.ModelParallel.")


def _on_change(distribution) -> None:
    """Before Keras records `distribution` as current: make its strategy TensorFlow's current one."""
    if tf.distribute.has_strategy() and tf.distribute.get_strategy() is not _active[0]:
        raise ConfigError("keras.distribution.set_distribution (or distribution.scope()) was called inside "
                          f"`with strategy.scope():` of {type(tf.distribute.get_strategy()).__name__}; use either "
                          "the Keras distribution or the strategy's scope, not one inside the other.")
    # Keras' base class holds a mesh and no way to lay anything out: as current, it distributes nothing.
    plain = distribution is None or _keras_api.is_base_distribution(distribution)
    strategy = None if plain else strategy_for(distribution)
    tf.distribute.experimental_set_strategy(strategy)
    _active[0] = strategy


def _local_devices_of(devices: list[str]) -> list[str] | int:
    """This process's part of a mesh, checked without starting TensorFlow (in a job, the strategy configures the
    runtime first): device names in one process, a count (TFDIST_LOCAL_DEVICES's) in a job."""
    mine, count = [], 0
    for name in devices:
        spec = tf.DeviceSpec.from_string(name if name.startswith("/") else "/" + name)
        task = spec.task if spec.job not in (None, "localhost") else None
        if task is None and _job["processes"] == 1:
            mine.append(name if name.startswith("/") else "/" + name)
            continue
        if _job["processes"] == 1:
            raise ConfigError(f"the mesh names device {name!r} of another process, but this process has not joined a "
                              "job: call keras.distribution.initialize(...) first (before the distribution is "
                              "created).")
        if task is None or task >= _job["processes"]:
            raise ConfigError(f"the mesh names device {name!r}; in a job of {_job['processes']} processes name every "
                              "device with its process (keras.distribution.list_devices()).")
        count += task == _job["rank"]
    if _job["processes"] > 1:
        if count != _devices_per_process():
            raise ConfigError(f"the mesh gives this process {count} device(s) but it has {_devices_per_process()}; "
                              "build the mesh from keras.distribution.list_devices().")
        return count
    try:
        return resolve_devices(mine)
    except ConfigError as err:
        raise ConfigError(f"the mesh names a device this process does not have ({err}) Build the mesh from "
                          "keras.distribution.list_devices().") from None


def _devices_per_process() -> int:
    """In a job: TFDIST_LOCAL_DEVICES (`tfdist launch --devices-per-worker`), else this machine's GPUs or logical
    CPUs (read without starting TensorFlow)."""
    return local_device_count() or len(local_devices())


def _built_under_it(cls):
    """`cls` whose steps refuse a model built before the Keras distribution was set (its variables would not
    be distributed: Keras records a model's strategy when the model is created)."""

    class Strategy(cls):
        def experimental_distribute_dataset(self, dataset, options=None):
            current = _keras_api.current()
            if _job["processes"] == 1 or current is None or current.auto_shard_dataset:
                return super().experimental_distribute_dataset(dataset, options)
            return self.distribute_datasets_from_function(_this_process_share(self, dataset), options)

        def run(self, fn, args=(), kwargs=None, options=None):
            model = keras_model.model_of_step(fn)
            if model is not None and _keras_api.strategy_of(model) is not self:
                raise ConfigError(f"model {model.name!r} was built before keras.distribution.set_distribution(...) "
                                  "(or outside distribution.scope()); build and compile it after setting the "
                                  "distribution, as on JAX.")
            return super().run(fn, args=args, kwargs=kwargs, options=options)

    Strategy.__name__ = Strategy.__qualname__ = cls.__name__
    return Strategy


def _this_process_share(strategy, dataset):
    """With `auto_shard_dataset=False` across processes, each process's data is its own part, as on JAX: this
    process's replicas split its batches among themselves, and nothing is sharded again."""
    local = strategy.num_replicas_in_sync // _job["processes"]
    if local < 1 or strategy.num_replicas_in_sync % _job["processes"]:
        raise ConfigError(f"the mesh has {strategy.num_replicas_in_sync} data-parallel replica(s) for "
                          f"{_job['processes']} processes; through keras.distribution each process must hold whole "
                          "replicas (mesh rows). For rows spanning processes use tfdist.ModelParallelStrategy.")
    batch = tf_runtime.dataset_batch_size(dataset)
    if local > 1 and (batch is None or batch % local):
        raise ConfigError(f"each process's batches ({batch or 'of unknown size'}) must split evenly over its {local} "
                          "replicas: batch the dataset with a global batch divisible by the number of replicas.")
    share = dataset.rebatch(batch // local) if local > 1 else dataset
    return lambda context: share


def _initialize(job_addresses=None, num_processes=None, process_id=None) -> None:
    """keras.distribution.initialize on TensorFlow: this process's place in the job, as TF_CONFIG."""
    if job_addresses:
        addresses = [a.strip() for a in str(job_addresses).split(",") if a.strip()]
        if num_processes is not None and int(num_processes) != len(addresses):
            raise ConfigError(f"keras.distribution.initialize: job_addresses lists {len(addresses)} processes but "
                              f"num_processes={num_processes}; on TensorFlow give every process's host:port.")
        if process_id is None or not 0 <= int(process_id) < len(addresses):
            raise ConfigError(f"keras.distribution.initialize: process_id must be in [0, {len(addresses)}), got "
                              f"{process_id!r}.")
        os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": addresses},
                                              "task": {"type": "worker", "index": int(process_id)}})
        processes, rank = len(addresses), int(process_id)
    elif "TF_CONFIG" in os.environ:  # tfdist launch, tfdist's SLURM set-up
        config = json.loads(os.environ["TF_CONFIG"])
        processes = sum(len(v) for k, v in config.get("cluster", {}).items() if k in ("chief", "worker"))
        task = config.get("task", {})
        rank = task.get("index", 0) + (1 if task.get("type") == "worker" and "chief" in config["cluster"] else 0)
    else:
        raise ConfigError("keras.distribution.initialize: no job given. Pass job_addresses='host:port,...' (every "
                          "process's), num_processes and process_id, set KERAS_DISTRIBUTION_JOB_ADDRESSES, "
                          "KERAS_DISTRIBUTION_NUM_PROCESSES and KERAS_DISTRIBUTION_PROCESS_ID, or start the "
                          "processes with `tfdist launch`.")
    _job.update(processes=processes, rank=rank, initialized=True)


def _list_devices(device_type=None) -> list[str]:
    """keras.distribution.list_devices: every process's devices once the job is initialized."""
    if _job["processes"] == 1:
        return _keras_api.keras_list_devices(device_type)
    kind = (device_type or local_devices()[0].rsplit(":", 2)[-2]).upper()  # not started yet: TF's own would start it
    return job_devices(kind, devices_per_process=_devices_per_process())

