"""tfdist.ParameterServerStrategy: asynchronous training with parameter servers, for Keras 3 `fit`."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator

import tensorflow as tf

from tfdist._compat import keras_model
from tfdist.comm.peers import silent_after
from tfdist.errors import ConfigError, troubleshooting
from tfdist.parameter_server import _tf_sharded as ps_compat
from tfdist.parameter_server import coordinated

__all__ = ["ParameterServerStrategy"]

_UNSUPPORTED = {
    "zero_stage": "the variables and their optimizer state already live on the parameter servers (sharded over "
                  "them with variable_partitioner), and updates are not all-reduced",
    "offload": "optimizer state lives on the parameter servers' host memory already",
    "stages": "layer placement is a different strategy (tfdist.LayerPlacementStrategy)",
    "devices": "each worker uses its own devices; there is nothing to place by hand",
}


class ParameterServerStrategy(tf.distribute.experimental.ParameterServerStrategy):
    """Asynchronous parameter-server training that works with Keras 3 `compile`/`fit`/`evaluate`/callbacks.

    Variables live on the parameter servers (large ones split over them); the chief schedules each training step
    on whichever worker is free, and the worker applies its gradient on the servers without waiting for the
    others, so a slow or lost worker does not hold the job back (gradients may be a few steps stale). The same
    script runs in every process: in a "ps" or "worker" process (TF_CONFIG) the constructor serves and never
    returns. `fit` takes a dataset function that each worker runs for itself, and needs `steps_per_epoch`.

    Args:
        cluster_resolver: a `tf.distribute.cluster_resolver.ClusterResolver` with "chief", "worker" and
            "ps" jobs; None reads TF_CONFIG.
        variable_partitioner: "auto" (default: variables with shards of at least `min_shard_bytes` split along their
            first axis over the servers, others whole, round-robin), None (never split), or a
            `tf.distribute.experimental.partitioners.Partitioner`.
        min_shard_bytes: with "auto", the smallest shard worth splitting into (default 256 KiB).
        connect_timeout_s: seconds the chief waits for every ps and worker to listen, before a clear
            error naming the silent ones (no hang).
        max_in_flight: steps scheduled ahead of the finished ones (default: 2 per worker).

    Example:
        >>> # train.py, run with: tfdist launch -n 2 --ps 1 -- python train.py
        >>> import keras, tfdist
        >>> strategy = tfdist.ParameterServerStrategy()          # ps/workers serve here, forever
        >>> data = tfdist.data.mnist(global_batch_size=64, strategy=strategy)  # a dataset function per worker
        >>> with strategy.scope():
        ...     model = tfdist.models.cnn()
        ...     model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        >>> model.fit(data.train, validation_data=data.test, epochs=3)

    Guide: docs/parameter-server.md.
    """

    def __init__(self, cluster_resolver: tf.distribute.cluster_resolver.ClusterResolver | None = None, *,
                 variable_partitioner="auto", min_shard_bytes: int = 256 << 10, connect_timeout_s: float = 120.0,
                 max_in_flight: int | None = None, **unsupported):
        for name in unsupported:
            if name in _UNSUPPORTED:
                raise ConfigError(f"ParameterServerStrategy does not take {name}=: {_UNSUPPORTED[name]}.")
            raise TypeError(f"ParameterServerStrategy() got an unexpected keyword argument {name!r}")
        resolver = cluster_resolver or tf.distribute.cluster_resolver.TFConfigClusterResolver()
        cluster = _checked_cluster(resolver)
        if resolver.task_type in ("ps", "worker"):
            serve(resolver)  # never returns
        if resolver.task_type != "chief":
            raise ConfigError(f"ParameterServerStrategy: this process is task {resolver.task_type!r}; only 'chief', "
                              "'worker' and 'ps' tasks take part in parameter-server training.")
        _wait_for_tasks(cluster, connect_timeout_s)
        num_ps = len(cluster["ps"])
        ps_compat.init_ps_strategy(self, resolver, _partitioner(variable_partitioner, min_shard_bytes, num_ps))
        self.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(self)
        self.num_workers, self.num_ps = len(cluster["worker"]), num_ps
        self._max_in_flight = max_in_flight

    @contextlib.contextmanager
    def scope(self) -> Iterator[tf.distribute.Strategy]:
        """The strategy's scope; every Keras model created in it gets fit/evaluate/predict that schedule
        their steps on the workers (tfdist.parameter_server.coordinated)."""
        with super().scope() as strategy, keras_model.model_hooks(self._attach):
            yield strategy

    def _attach(self, model) -> None:
        if keras_model.strategy_of(model) is self:
            coordinated.attach(model, self, max_in_flight=self._max_in_flight)


def serve(resolver) -> None:
    """Runs this process's TensorFlow server (a parameter server or a worker) until the process is stopped."""
    spec = resolver.cluster_spec()
    address = spec.task_address(resolver.task_type, resolver.task_id)
    print(f"[tfdist] {resolver.task_type} {resolver.task_id} serving at {address}; stopped by the launcher when "
          "the chief finishes", file=sys.stderr, flush=True)
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    server = tf.distribute.Server(spec, job_name=resolver.task_type, task_index=resolver.task_id,
                                  protocol=resolver.rpc_layer or "grpc", start=True)
    server.join()
    sys.exit(0)


def _checked_cluster(resolver) -> dict[str, list[str]]:
    spec = resolver.cluster_spec().as_dict()
    if not spec:
        raise ConfigError("ParameterServerStrategy needs a cluster with 'chief', 'worker' and 'ps' jobs, and found "
                          "none (TF_CONFIG is unset?). Start the job with: tfdist launch -n 2 --ps 1 -- python "
                          "train.py  (or set TF_CONFIG on every process).")
    missing = [job for job in ("chief", "worker", "ps") if not spec.get(job)]
    if missing:
        raise ConfigError(f"ParameterServerStrategy: the cluster {json.dumps(spec)} has no {' and no '.join(missing)} "
                          f"job; it needs one 'chief' (the coordinator), at least one 'worker' and at least one "
                          f"'ps'. Example: tfdist launch -n 2 --ps 1 -- python train.py.")
    if len(spec["chief"]) != 1:
        raise ConfigError(f"ParameterServerStrategy: the cluster has {len(spec['chief'])} chief tasks; it needs "
                          "exactly one (the coordinator).")
    return {job: list(addrs) if isinstance(addrs, list) else list(addrs.values()) for job, addrs in spec.items()}


def _wait_for_tasks(cluster: dict[str, list[str]], timeout_s: float) -> None:
    """Waits until every ps and worker listens; ConfigError naming the silent ones after `timeout_s`."""
    tasks = [(job, i, addr) for job in ("ps", "worker") for i, addr in enumerate(cluster[job])]
    pending = silent_after(tasks, timeout_s, address_of=lambda task: task[2])
    if pending:
        names = ", ".join(f"{job} {i} at {addr}" for job, i, addr in pending)
        raise ConfigError(f"ParameterServerStrategy: not answering after connect_timeout_s={timeout_s:g} s: {names}. "
                          "Start every task listed in TF_CONFIG (tfdist launch -n N --ps K does), check the "
                          "addresses, or raise connect_timeout_s." + troubleshooting("a-peer-never-starts"))


def _partitioner(value, min_shard_bytes: int, num_ps: int):
    if value == "auto":
        if num_ps < 2:
            return None
        return tf.distribute.experimental.partitioners.MinSizePartitioner(min_shard_bytes=min_shard_bytes,
                                                                          max_shards=num_ps)
    if value is None or isinstance(value, tf.distribute.experimental.partitioners.Partitioner):
        return value
    raise ConfigError(f"ParameterServerStrategy: variable_partitioner must be 'auto', None or a "
                      f"tf.distribute.experimental.partitioners.Partitioner, got {value!r}.")
