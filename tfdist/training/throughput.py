"""Throughput: training samples per second, epoch by epoch."""

from __future__ import annotations

import statistics
import time

import keras

__all__ = ["Throughput"]


class Throughput(keras.callbacks.Callback):
    """Measures training images per second, epoch by epoch.

    `images_per_sec` is the median over epochs after the first (the first pays for tracing and
    compilation), or the first epoch's figure when there is only one.
    """

    def __init__(self, samples_per_epoch: int):
        super().__init__()
        self.samples_per_epoch = samples_per_epoch
        self.epoch_seconds: list[float] = []
        self._start = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_seconds.append(time.perf_counter() - self._start)

    @property
    def images_per_sec(self) -> float:
        if not self.epoch_seconds:
            return 0.0
        steady = self.epoch_seconds[1:] or self.epoch_seconds
        return self.samples_per_epoch / statistics.median(steady)
