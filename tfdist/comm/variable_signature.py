"""Checking that every process creates the same variable: a small signature all-gathered before it is synced.

Processes that build different models would otherwise meet in a broadcast of differently shaped tensors and
hang (Horovod) or fail deep inside TF. Each new variable's signature — [hash, index, ndims, dims (padded), dtype]
— is equal on every process iff the index-th variable agrees; a mismatch names every process's shape.
"""

from __future__ import annotations

import hashlib

import numpy as np
import tensorflow as tf

__all__ = ["mismatch_message", "signature"]

_MAX_DIMS = 8


def signature(index: int, shape: list, dtype: tf.DType) -> np.ndarray:
    """The int64 signature of the `index`-th variable created in this process."""
    dims = [-1 if d is None else int(d) for d in shape][:_MAX_DIMS]
    text = f"{index}|{shape}|{dtype.name}".encode()
    digest = int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "little")
    return np.array([digest, index, len(shape), *dims, *([-2] * (_MAX_DIMS - len(dims))), dtype.as_datatype_enum],
                    dtype=np.int64)


def mismatch_message(strategy: str, process: str, index: int, var, gathered: np.ndarray) -> str:
    """The error for signatures that differ: `gathered` holds one row per process (`process`: "rank"/"process")."""
    per_process = []
    for rank, row in enumerate(gathered):
        ndims = int(row[2])
        per_process.append(f"{process} {rank}: shape {tuple(int(d) for d in row[3:3 + min(ndims, _MAX_DIMS)])} "
                           f"{tf.as_dtype(int(row[-1])).name}")
    plural = process + ("es" if process.endswith("s") else "s")
    return (f"{strategy}: the {plural} are building different models. Variable #{index} "
            f"(here {var.name}) differs: {'; '.join(per_process)}. Every {process} must build the same model "
            "(same layers, same order) inside strategy.scope().")
