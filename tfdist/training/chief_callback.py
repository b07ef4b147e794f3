"""A Keras callback that writes on the chief only: what ModelCheckpoint and TensorBoard share.

All workers of a synchronous job hold identical weights and identical (all-reduced) metrics, so what the chief
writes is the job's. One case needs every rank: under ZeRO across processes the optimizer state and stage-3
weights live in pieces on every rank, and reading them is a collective. There every rank runs the same inner
callback, and the others write into a private scratch directory that is emptied after each hook.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import keras

from tfdist.cluster.rank import is_chief
from tfdist.zero.attach import cross_process_engine

__all__ = ["ChiefCallback"]


class ChiefCallback(keras.callbacks.Callback):
    """Forwards every Keras hook to `self.inner`, the Keras callback a subclass makes with `_make(scratch)`:
    `scratch=None` for the one that writes where the user looks, a directory for a non-chief rank's shadow."""

    def __init__(self, strategy=None, *, writes_here: bool | None = None):
        super().__init__()
        self.chief = is_chief(strategy)
        self._scratch: str | None = None
        self.inner = self._make(None) if (self.chief if writes_here is None else writes_here) else None

    def _make(self, scratch: str | None) -> keras.callbacks.Callback:
        raise NotImplementedError

    def _engine(self):
        return cross_process_engine(self.model) if self.model is not None else None

    def _shadow(self):
        """Non-chief ranks under multi-process ZeRO: an inner callback writing to a scratch directory."""
        if self.inner is None:
            # The pid in the name lets a job check that its own scratch directories are gone.
            self._scratch = tempfile.mkdtemp(prefix=f"tfdist-ckpt-rank-{os.getpid()}-")
            self.inner = self._make(self._scratch)
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

    # --- Keras hooks: each one forwards to the inner callback ----------------------------------------------
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
