"""Automatic balancing: split a layer sequence into contiguous stages minimising the busiest stage."""

from __future__ import annotations

import time
from collections.abc import Sequence

from tfdist.errors import ConfigError

__all__ = ["block_partition", "measure_layer_times"]


def block_partition(costs: Sequence[float], stages: int) -> list[int]:
    """Splits `costs` (one per layer, in order) into `stages` contiguous non-empty blocks.

    Returns the number of layers in each block. The split minimises the largest block sum (the
    pipeline's bottleneck stage); among splits with that bottleneck it picks the one whose
    blocks are most even (smallest sum of squared block loads). This is the linear-partition
    problem torchgpipe (balance/blockpartition.py) and DeepSpeed's PipelineModule
    (partition_balanced) solve; an exact dynamic programme is cheap at the layer counts of Keras
    models (O(stages x layers^2)).

    Example:
        >>> block_partition([1, 1, 1, 1, 4], 2)
        [4, 1]
        >>> block_partition([3, 1, 1, 1], 3)
        [1, 1, 2]
    """
    n = len(costs)
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ConfigError(f"stages must be a whole number >= 1, got {stages!r}.")
    if stages > n:
        raise ConfigError(f"cannot split {n} layer(s) into {stages} stages: each stage needs at least "
                          f"one layer. Use at most {n} devices per pipeline.")
    if any(c < 0 for c in costs):
        raise ConfigError(f"layer costs must be >= 0, got {list(costs)}.")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = (float("inf"), float("inf"))
    # best[k][i]: (bottleneck, sum of squares) splitting the first i layers into k blocks.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):  # last block is layers j..i-1
                prev = best[k - 1][j]
                if prev[0] == float("inf"):
                    continue
                load = prefix[i] - prefix[j]
                cand = (max(prev[0], load), prev[1] + load * load)
                if cand < best[k][i]:
                    best[k][i], cut[k][i] = cand, j
    sizes, i = [], n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def measure_layer_times(layers, input_shapes, *, batch: int = 32, repeats: int = 5) -> list[float]:
    """Median forward+backward seconds of each layer on a random batch, for balance='time'.

    `input_shapes[i]` lists the input shapes (with a None batch dimension) of `layers[i]`. Layers
    run one at a time on the current device, compiled with tf.function (first call not timed).
    """
    import statistics

    import tensorflow as tf

    times = []
    for layer, shapes in zip(layers, input_shapes):
        inputs = [tf.random.uniform((batch, *s[1:])) for s in shapes]

        @tf.function
        def step(xs, layer=layer, single=len(shapes) == 1):
            with tf.GradientTape() as tape:
                tape.watch(xs)
                y = layer(xs[0] if single else xs, training=True)
                total = tf.add_n([tf.reduce_sum(t) for t in tf.nest.flatten(y)])
            return tape.gradient(total, [xs, layer.trainable_variables])

        step(inputs)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            tf.nest.map_structure(lambda t: t.numpy() if t is not None else None, step(inputs))
            samples.append(time.perf_counter() - start)
        times.append(statistics.median(samples))
    return times
