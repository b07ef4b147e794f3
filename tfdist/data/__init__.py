"""Datasets shipped with pip packages, and batch-size rules for distributed training."""

from tfdist.data.batching import global_batch_size, per_replica_batch_size
from tfdist.data.datasets import DATASET_NAMES, Arrays, Datasets, digits, load, load_arrays, mnist

__all__ = [
    "Arrays", "Datasets", "DATASET_NAMES", "digits", "global_batch_size", "load", "load_arrays",
    "mnist", "per_replica_batch_size",
]
