"""ModelCheckpoint: Keras' checkpoint callback, written by the chief only."""

from __future__ import annotations

import os
import shutil
import tempfile

import keras

from tfdist.cluster.rank import is_chief
from tfdist.zero.attach import cross_process_engine

__all__ = ["ModelCheckpoint"]


class ModelCheckpoint(keras.callbacks.Callback):
    """`keras.callbacks.ModelCheckpoint` that saves on the chief only; other workers write nothing.

    Takes the same arguments as `keras.callbacks.ModelCheckpoint`, plus `strategy` (who is chief).
    All workers hold identical weights and identical (all-reduced) metrics, so the chief's copy is
    the model, and "save_best_only" decides the same way everywhere.

    Example:
        >>> from tfdist.training import ModelCheckpoint
        >>> ckpt = ModelCheckpoint("out/best.keras", monitor="val_loss", save_best_only=True)
    """

    def __init__(self, filepath, *args, strategy=None, **kwargs):
        super().__init__()
        self.chief = is_chief(strategy)
        self.inner = keras.callbacks.ModelCheckpoint(filepath, *args, **kwargs) if self.chief else None
        # Multi-process ZeRO (shards in other processes): every rank runs the same checkpoint logic,
        # since reading the optimizer state is a collective; other ranks write into a private
        # temporary directory that is emptied after each hook.
        self._args, self._kwargs, self._filepath = args, kwargs, os.fspath(filepath)
        self._scratch: str | None = None

    def _engine(self):
        return cross_process_engine(self.model) if self.model is not None else None

    def _shadow(self):
        """Non-chief ranks under multi-process ZeRO: an inner callback writing to a scratch directory."""
        if self.inner is None:
            # The pid in the name lets a job check that its own scratch directories are gone.
            self._scratch = tempfile.mkdtemp(prefix=f"tfdist-ckpt-rank-{os.getpid()}-")
            path = os.path.join(self._scratch, os.path.basename(self._filepath))
            self.inner = keras.callbacks.ModelCheckpoint(path, *self._args, **self._kwargs)
            self.inner.set_model(self.model)
            if self.params:
                self.inner.set_params(self.params)

    def set_model(self, model):
        super().set_model(model)
        if self.inner is not None:
            self.inner.set_model(model)

    def set_params(self, params):
        super().set_params(params)
        if self.inner is not None:
            self.inner.set_params(params)

    def _forward(self, name: str, *args):
        """Runs the inner callback's hook `name`: on the chief, or on every rank under multi-process ZeRO."""
        engine = self._engine()
        if engine is not None:
            if not self.chief:
                self._shadow()
            try:
                with engine.state.collective_reads():
                    return getattr(self.inner, name)(*args)
            finally:
                if self._scratch is not None:
                    self._empty_scratch(last=name == "on_train_end")
        if self.inner is not None and (self.chief or self._scratch is None):
            return getattr(self.inner, name)(*args)
        return None

    def _empty_scratch(self, last: bool) -> None:
        for entry in os.listdir(self._scratch):
            target = os.path.join(self._scratch, entry)
            shutil.rmtree(target) if os.path.isdir(target) else os.remove(target)
        if last:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch, self.inner = None, None

    # --- Keras hooks: each one forwards to the inner keras.callbacks.ModelCheckpoint ------------------
    def on_train_begin(self, logs=None):
        return self._forward("on_train_begin", logs)

    def on_train_end(self, logs=None):
        return self._forward("on_train_end", logs)

    def on_epoch_begin(self, epoch, logs=None):
        return self._forward("on_epoch_begin", epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        return self._forward("on_epoch_end", epoch, logs)

    def on_train_batch_begin(self, batch, logs=None):
        return self._forward("on_train_batch_begin", batch, logs)

    def on_train_batch_end(self, batch, logs=None):
        return self._forward("on_train_batch_end", batch, logs)

    def on_test_begin(self, logs=None):
        return self._forward("on_test_begin", logs)

    def on_test_end(self, logs=None):
        return self._forward("on_test_end", logs)

    def on_test_batch_begin(self, batch, logs=None):
        return self._forward("on_test_batch_begin", batch, logs)

    def on_test_batch_end(self, batch, logs=None):
        return self._forward("on_test_batch_end", batch, logs)

    def on_predict_begin(self, logs=None):
        return self._forward("on_predict_begin", logs)

    def on_predict_end(self, logs=None):
        return self._forward("on_predict_end", logs)

    def on_predict_batch_begin(self, batch, logs=None):
        return self._forward("on_predict_batch_begin", batch, logs)

    def on_predict_batch_end(self, batch, logs=None):
        return self._forward("on_predict_batch_end", batch, logs)
