"""TensorBoard: Keras' TensorBoard callback for a job of several processes."""

from __future__ import annotations

import os

import keras

from tfdist.cluster.rank import rank
from tfdist.errors import ConfigError, import_extra
from tfdist.training.chief_callback import ChiefCallback

__all__ = ["TensorBoard"]


class TensorBoard(ChiefCallback):
    """`keras.callbacks.TensorBoard` for training across processes: the chief writes `log_dir`, as one process
    would; the other workers write nothing, since their epoch metrics are the same all-reduced values.

    With `per_worker=True` every process writes its own `log_dir/worker_<rank>` (rank 0 is the chief), to compare
    workers' step times or input pipelines side by side in TensorBoard. `profile_batch` profiles the chief only,
    in either mode: TensorFlow 2.21's profiler can crash the other tasks of a collective job when it stops.
    Other arguments are Keras'; `strategy` says who is chief (default: the launcher's environment).

    Example:
        >>> from tfdist.training import TensorBoard
        >>> model.fit(data.train, epochs=5, callbacks=[TensorBoard("logs", profile_batch=(5, 8))])
        # then: tensorboard --logdir logs
    """

    def __init__(self, log_dir: str = "logs", *, per_worker: bool = False, strategy=None, **kwargs):
        if not isinstance(per_worker, bool):
            raise ConfigError(f"per_worker must be True or False, got {per_worker!r}.")
        import_extra("tensorboard", "tensorboard", "tfdist.training.TensorBoard")  # Keras writes through it
        self._log_dir, self._kwargs, self._per_worker = os.fspath(log_dir), kwargs, per_worker
        self._rank = rank(strategy)
        super().__init__(strategy, writes_here=True if per_worker else None)

    def _make(self, scratch: str | None) -> keras.callbacks.Callback:
        kwargs = dict(self._kwargs)
        if not self.chief:
            kwargs["profile_batch"] = 0
        if scratch is not None:
            return keras.callbacks.TensorBoard(scratch, **kwargs)
        log_dir = os.path.join(self._log_dir, f"worker_{self._rank}") if self._per_worker else self._log_dir
        return keras.callbacks.TensorBoard(log_dir, **kwargs)
