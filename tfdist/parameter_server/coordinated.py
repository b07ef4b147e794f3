"""Keras `fit`/`evaluate`/`predict` for a model whose variables live on parameter servers.

Keras 3 runs each step itself (`model.train_function(iterator)`); under parameter-server training the
coordinator (the chief) must instead *schedule* steps on whichever worker is free. `attach(model,
strategy)` gives one model (nothing else) three thin wrappers around Keras' own methods:

- `fit(dataset_fn, steps_per_epoch=..., ...)` checks its arguments, turns the function into a
  per-worker input (`PerWorkerDataset`) and sets `model.train_function` to `ScheduledSteps`, then calls
  Keras' `fit`, which runs callbacks, history and progress bar as usual;
- `evaluate(dataset_fn, steps=...)` schedules test steps on the workers the same way; `evaluate(x, y)`
  and `predict(x)` with ordinary data run on the chief, reading the variables from the servers.

`attach` also makes the model give its Embedding layers sharded lookups whenever it is called
(tfdist.parameter_server.sharded_embedding), so a table split over the servers is read row by row, never whole.
"""

from __future__ import annotations

import collections
import functools
import types
import weakref

import keras
import tensorflow as tf

from tfdist._compat import keras_model
from tfdist.errors import ConfigError, troubleshooting
from tfdist.parameter_server import sharded_embedding
from tfdist.parameter_server._tf_sharded import atomic_updates, sharded_gradients
from tfdist.parameter_server.per_worker_data import PerWorkerDataset

__all__ = ["ParameterServerLost", "ScheduledSteps", "attach"]


class ParameterServerLost(RuntimeError):
    """A parameter server stopped answering: the variables it held are gone, training cannot go on."""


class ScheduledSteps:
    """Keras' train/test function for a coordinator: every call schedules `steps_per_call` steps on a free
    worker and returns the logs of an earlier step that has finished.

    At most `max_in_flight` calls are outstanding: beyond that a call waits for the oldest (this keeps
    the chief from queueing a whole epoch ahead, and gives the progress bar numbers at most that many
    steps old). The last call of an epoch waits for every scheduled step (`coordinator.join()`), so
    Keras reads the epoch's final metrics and callbacks see finished work.

    `graphs` holds the graph of every trace of the worker function (normally one), to inspect what a
    step runs where (op devices and shapes).
    """

    def __init__(self, step_function, strategy, coordinator, *, steps_per_call: int, calls_per_epoch: int,
                 max_in_flight: int):
        self.coordinator, self.calls_per_epoch, self.max_in_flight = coordinator, calls_per_epoch, max_in_flight
        self.in_flight: collections.deque = collections.deque()
        self.calls = 0
        self.logs: dict = {}
        self.graphs: list[tf.Graph] = []

        @tf.function
        def worker_fn(iterator):
            self.graphs.append(tf.compat.v1.get_default_graph())  # runs once per trace: the FuncGraph
            outputs = None
            for _ in range(steps_per_call):
                outputs = strategy.run(step_function, args=(next(iterator),))
            return tf.nest.map_structure(lambda v: strategy.experimental_local_results(v)[0], outputs)

        self.worker_fn = worker_fn

    def __call__(self, batches) -> dict:
        with sharded_gradients(), atomic_updates(), _clear_errors():
            self.in_flight.append(self.coordinator.schedule(self.worker_fn, args=(batches.per_worker_iterator,)))
            self.calls += 1
            if self.calls % self.calls_per_epoch == 0:
                self.sync()
            while len(self.in_flight) > self.max_in_flight:
                self.logs = self.in_flight.popleft().fetch()
        return self.logs

    def sync(self) -> dict:
        """Waits for every scheduled step; returns the logs of the last one."""
        with _clear_errors():
            self.coordinator.join()
            if self.in_flight:
                self.logs = self.in_flight[-1].fetch()
            self.in_flight.clear()
        return self.logs


class _SyncAtEnd(keras.callbacks.Callback):
    """Waits for scheduled steps when an epoch or the run ends early (EarlyStopping, stop_training)."""

    def __init__(self, steps: ScheduledSteps):
        super().__init__()
        self.steps = steps

    def on_epoch_end(self, epoch, logs=None):
        self.steps.sync()

    def on_train_end(self, logs=None):
        self.steps.sync()


class _clear_errors:
    """Turns the coordinator's "a parameter server is gone" into one clear error (a worker that fails is
    retried by the coordinator itself and never reaches here)."""

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        if err is not None and _is_ps_failure(err):
            raise ParameterServerLost(
                "a parameter server stopped answering, and the variables it held are lost: training stopped. "
                "Restart the job; with tfdist.training.BackupAndRestore (or the --backup-dir of tfdist train) "
                f"it resumes from the last completed epoch. ({type(err).__name__}: {str(err).splitlines()[0]})"
                + troubleshooting("a-parameter-server-was-lost")
            ) from None  # TF's error is named in the message; its deep traceback would only hide it
        return False


def _is_ps_failure(err: BaseException) -> bool:
    text = f"{type(err).__name__} {err}"
    return "PSUnavailable" in text or ("/job:ps" in text and isinstance(err, (tf.errors.UnavailableError,
                                                                              tf.errors.AbortedError,
                                                                              tf.errors.CancelledError)))


_attached: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> the strategy it is attached to


def attach(model: keras.Model, strategy, *, max_in_flight: int | None = None) -> None:
    """Gives `model` (this instance only) fit/evaluate/predict that work under `strategy`, a tfdist
    ParameterServerStrategy. Called by the strategy for every model created in its scope."""
    if _attached.get(model) is strategy:
        return
    in_flight = max_in_flight or 2 * max(1, strategy.num_workers)
    cls = type(model)
    for name, wrapper in (("fit", _fit), ("evaluate", _evaluate), ("predict", _predict)):
        method = functools.wraps(getattr(cls, name))(
            functools.partial(wrapper, strategy=strategy, stock=getattr(cls, name), max_in_flight=in_flight))
        object.__setattr__(model, name, types.MethodType(method, model))
    _attached[model] = strategy
    sharded_embedding.attach_on_call(model)  # its layers do not exist yet: they are attached when it runs


def _scheduled(model, strategy, step_function, steps: int, max_in_flight: int) -> ScheduledSteps:
    per_call = int(getattr(model, "steps_per_execution", 1) or 1)
    return ScheduledSteps(step_function, strategy, strategy.coordinator, steps_per_call=per_call,
                          calls_per_epoch=-(-steps // per_call), max_in_flight=max_in_flight)


def _require_steps(value, parameter: str, method: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"ParameterServerStrategy: {method} needs {parameter}= (a whole number >= 1; got "
                          f"{value!r}): every worker reads its own endless pipeline, so the number of steps "
                          "is what ends an epoch.")
    return value


def _fit(model, x=None, y=None, *, strategy, stock, max_in_flight, steps_per_epoch=None, callbacks=None,
         validation_data=None, **kwargs):
    if y is not None:
        raise ConfigError("ParameterServerStrategy: fit takes no y= ; the dataset function yields (x, y) batches.")
    if steps_per_epoch is None:  # tfdist.data's dataset functions know their pass (tfdist.data.PerWorkerInput)
        steps_per_epoch = getattr(x, "steps_per_epoch", None)
    steps = _require_steps(steps_per_epoch, "steps_per_epoch", "fit")
    data = PerWorkerDataset(x, strategy.coordinator, strategy)
    scheduled = _scheduled(model, strategy, model.train_step, steps, max_in_flight)
    model.train_function = scheduled
    callbacks = [_SyncAtEnd(scheduled), *(callbacks or [])]
    try:
        with _clear_errors():
            return stock(model, data, steps_per_epoch=steps, callbacks=callbacks, validation_data=validation_data,
                         **kwargs)
    finally:
        model.train_function = None


def _evaluate(model, x=None, y=None, *, strategy, stock, max_in_flight, steps=None, **kwargs):
    kwargs.pop("_use_cached_eval_dataset", None)  # fit's cached iterator was made for the workers
    if callable(x) and not isinstance(x, (tf.data.Dataset, keras.utils.PyDataset)):
        steps = _require_steps(steps, "steps", "evaluate(dataset_fn)")
        data = PerWorkerDataset(x, strategy.coordinator, strategy)
        model.test_function = _scheduled(model, strategy, model.test_step, steps, max_in_flight)
        try:
            with _clear_errors():
                return stock(model, data, steps=steps, **kwargs)
        finally:
            model.test_function = None
    return _on_chief(model, stock, x, y, steps=steps, **kwargs)


def _predict(model, x=None, *, strategy, stock, max_in_flight, **kwargs):
    if callable(x) and not isinstance(x, (tf.data.Dataset, keras.utils.PyDataset)):
        raise ConfigError("ParameterServerStrategy: predict runs on the chief; pass arrays or a tf.data.Dataset, "
                          "not a dataset function.")
    return _on_chief(model, stock, x, **kwargs)


def _on_chief(model, stock, *args, **kwargs):
    # Keras runs the step itself, on the chief, outside any strategy; the variables are read from the
    # parameter servers. The test/predict functions traced here are dropped afterwards.
    model.test_function = model.predict_function = None
    try:
        with keras_model.using_strategy(model, None), _clear_errors():
            return stock(model, *args, **kwargs)
    finally:
        model.test_function = model.predict_function = None
