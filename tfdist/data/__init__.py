"""Datasets shipped with pip packages, per-epoch data order, and batch-size rules for distributed training."""

from tfdist.data.batching import global_batch_size, per_replica_batch_size
from tfdist.data.datasets import DATASET_NAMES, Arrays, Datasets, PerWorkerInput, digits, load, load_arrays, mnist
from tfdist.data.epochs import EpochOrder

__all__ = [
    "Arrays", "Datasets", "DATASET_NAMES", "EpochOrder", "digits", "global_batch_size", "load", "load_arrays",
    "mnist", "per_replica_batch_size", "PerWorkerInput",
]
