"""ReusedInputIterators: distributed datasets that keep one input iterator across epochs.

Over several local devices TF builds a multi-device iterator for every pass over a distributed dataset, and
Keras asks for one at the start of every epoch and every validation. Building one traces per-device functions
(0.2-1 s on 4 logical CPUs); destroying the previous one waits for its tf.data autotune threads (up to many
seconds). Strategies with this mixin hand out datasets whose iterator is built once and rewound for each new pass
(`tfdist.data_parallel._rewinding_input`), so the first step of an epoch costs what any step costs.
"""

from __future__ import annotations

from tfdist.data_parallel import _rewinding_input as rewinding_input

__all__ = ["ReusedInputIterators", "iterator_counts", "total_iterator_counts"]


class ReusedInputIterators:
    """Mixin, listed before the tf.distribute strategy class: `experimental_distribute_dataset` and
    `distribute_datasets_from_function` return datasets that reuse one iterator (rewound per pass) while
    `reuse_input_iterators` is True.

    One distributed dataset then has one iterator: a new eager `iter()` starts a new pass for whoever holds an
    earlier one (Keras and `for x in dataset` loops hold one at a time). To iterate one dataset in two places at
    once, distribute it twice, or set `reuse_input_iterators = False` before distributing.
    """

    reuse_input_iterators: bool = True

    def experimental_distribute_dataset(self, dataset, options=None, **kwargs):
        """`tf.distribute.Strategy.experimental_distribute_dataset`; the result keeps one iterator across passes."""
        return self._reusing(super().experimental_distribute_dataset(dataset, options, **kwargs))

    def distribute_datasets_from_function(self, dataset_fn, options=None, **kwargs):
        """`tf.distribute.Strategy.distribute_datasets_from_function`; the result keeps one iterator across
        passes."""
        return self._reusing(super().distribute_datasets_from_function(dataset_fn, options, **kwargs))

    def _reusing(self, distributed):
        return rewinding_input.rewinding(distributed) if self.reuse_input_iterators else distributed


def iterator_counts(distributed) -> dict[str, int]:
    """For a dataset from a ReusedInputIterators strategy: how many iterators its `iter()` calls built, how many
    passes they started by rewinding, and how many calls found the iterator untouched since the last rewind."""
    return rewinding_input.iterator_counts(distributed).as_dict()


def total_iterator_counts() -> dict[str, int]:
    """`iterator_counts` summed over every distributed dataset of this process that reuses its iterator."""
    return rewinding_input.total_counts().as_dict()
