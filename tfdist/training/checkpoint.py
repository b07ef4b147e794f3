"""ModelCheckpoint: Keras' checkpoint callback, written by the chief only."""

from __future__ import annotations

import os

import keras

from tfdist.training.chief_callback import ChiefCallback

__all__ = ["ModelCheckpoint"]


class ModelCheckpoint(ChiefCallback):
    """`keras.callbacks.ModelCheckpoint` that saves on the chief only; other workers write nothing.

    Takes the same arguments as `keras.callbacks.ModelCheckpoint`, plus `strategy` (who is chief).
    All workers hold identical weights and identical (all-reduced) metrics, so the chief's copy is
    the model, and "save_best_only" decides the same way everywhere.

    Example:
        >>> from tfdist.training import ModelCheckpoint
        >>> ckpt = ModelCheckpoint("out/best.keras", monitor="val_loss", save_best_only=True)
    """

    def __init__(self, filepath, *args, strategy=None, **kwargs):
        self._args, self._kwargs, self._filepath = args, kwargs, os.fspath(filepath)
        super().__init__(strategy)

    def _make(self, scratch: str | None) -> keras.callbacks.Callback:
        path = self._filepath if scratch is None else os.path.join(scratch, os.path.basename(self._filepath))
        return keras.callbacks.ModelCheckpoint(path, *self._args, **self._kwargs)
