"""Shared pieces of benchmarks: step timing, interleaved rounds, bus bandwidth, JSON and PNG output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence

import keras


class StepTimer(keras.callbacks.Callback):
    """Records the wall time between consecutive training-batch ends (steady-state step times)."""

    def __init__(self):
        super().__init__()
        self.step_seconds: list[float] = []
        self._last: float | None = None

    def on_train_begin(self, logs=None):
        self._last = None  # the first step of each fit() pays for iterator start-up: not counted

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        if self._last is not None:
            self.step_seconds.append(now - self._last)
        self._last = now


def interleaved(runs: dict[str, Callable[[], None]], rounds: int) -> None:
    """Calls every run once per round, alternating the order (ABBA...) so drift hits all runs alike."""
    names = list(runs)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            runs[name]()


def median_ms(seconds: Sequence[float]) -> float:
    return 1000.0 * statistics.median(seconds)


def bus_bandwidth(nbytes: float, seconds: float, n: int) -> float:
    """Bus bandwidth in bytes/s of an all-reduce of `nbytes` over `n` ranks: 2(n-1)/n * bytes / time,
    what each link carries in a ring all-reduce (comparable across n, unlike bytes / time)."""
    return 2 * (n - 1) / n * nbytes / seconds


def machine() -> dict:
    import tensorflow as tf

    return {"cpus": os.cpu_count(), "python": platform.python_version(), "tensorflow": tf.__version__,
            "keras": keras.__version__, "host": platform.node()}


def write_json(path: str | None, record: dict) -> None:
    if not path:
        return
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {path}")


def save_figure(fig, path: str, dpi: int = 120) -> None:
    """Writes a matplotlib figure (tight layout), creating its directory."""
    fig.tight_layout()
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=dpi)
    print(f"wrote {path}")
