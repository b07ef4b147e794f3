"""Keras' own distribution API (`keras.distribution`) as a front to tfdist on TensorFlow.

- `front`: `enable_keras_distribution()`, which maps `DataParallel`/`ModelParallel` to tfdist strategies and
  gives the TensorFlow backend `initialize`, `num_processes`, `process_id` and a job-wide `list_devices`;
- `_keras_api`: the reaches into Keras that call makes (and only it).
"""

from __future__ import annotations

from tfdist.keras_distribution.front import disable_keras_distribution, enable_keras_distribution, strategy_for

__all__ = ["disable_keras_distribution", "enable_keras_distribution", "strategy_for"]
