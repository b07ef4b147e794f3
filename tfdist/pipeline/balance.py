"""Automatic balancing: split a layer sequence into contiguous stages minimising the busiest stage."""

from __future__ import annotations

import time
from collections.abc import Sequence

from tfdist.errors import ConfigError

__all__ = ["block_partition", "measure_layer_times", "needs_input_gradients"]


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


def needs_input_gradients(graph) -> list[bool]:
    """Per layer of `graph` (`tfdist.pipeline.layer_graph` order): does training need its input gradient?

    Only if some layer upstream of it has trainable weights: the first layers of a model (fed by
    its inputs) compute weight gradients only, which is why the first stage of a pipeline does
    less backward work than the others (the pipelined backward prunes those input gradients too).
    """
    needed: dict[int, bool] = {}
    out = []
    for layer, parents, *_ in graph:
        flag = any(bool(p.trainable_weights) or needed.get(id(p), False) for p in parents)
        needed[id(layer)] = flag
        out.append(flag)
    return out


def measure_layer_times(layers, input_shapes, *, batch: int = 64, repeats: int = 5, loops: int = 10,
                        input_gradients: Sequence[bool] | None = None) -> list[float]:
    """Seconds of each layer's forward + backward on a random batch, for balance='time'.

    The backward is the one training runs: weight gradients always, the input gradient only
    where `input_gradients[i]` is true (see `needs_input_gradients`; default: always). Each
    layer runs alone on the current device, `loops` times in a sequential loop inside one
    tf.function (first call not timed), so a small layer is not drowned in the function-call
    overhead; the fastest of `repeats` calls counts, minus the fastest run of the same harness
    around an identity layer (timed next to each layer). `input_shapes[i]` lists the input
    shapes (with a None batch dimension) of `layers[i]`.
    """
    import tensorflow as tf

    def harness(layer, single: bool, with_inputs: bool):
        @tf.function
        def step(xs):
            def body(i, total):
                with tf.GradientTape() as tape:
                    tape.watch(xs)
                    y = layer(xs[0] if single else xs, training=True)
                    out = tf.add_n([tf.reduce_sum(t) for t in tf.nest.flatten(y)])
                sources = ([xs] if with_inputs else []) + [layer.trainable_variables]
                grads = [g for g in tf.nest.flatten(tape.gradient(out, sources)) if g is not None]
                # Each gradient is used (so none is pruned) and the next iteration waits for it.
                return i + 1, total + tf.add_n([out] + [tf.reduce_sum(g[:1]) for g in grads])

            return tf.while_loop(lambda i, _: i < loops, body, (tf.constant(0), tf.constant(0.0)),
                                 parallel_iterations=1)[1]
        return step

    def once(fn, inputs) -> float:
        start = time.perf_counter()
        fn(inputs).numpy()
        return time.perf_counter() - start

    def fastest(fn, inputs) -> float:
        return min(once(fn, inputs) for _ in range(repeats)) / loops

    import keras

    # The identity harness is timed next to every layer and its fastest run overall is the
    # overhead: one overhead sample taken while the machine was busy would otherwise exceed
    # every small layer's time and flatten all costs to zero.
    identity, identity_inputs = harness(keras.layers.Identity(), True, True), [tf.random.uniform((batch, 8))]
    identity(identity_inputs).numpy()
    if input_gradients is None:
        input_gradients = [True] * len(layers)
    raw, overheads = [], []
    for layer, shapes, with_inputs in zip(layers, input_shapes, input_gradients):
        inputs = [tf.random.uniform((batch, *s[1:])) for s in shapes]
        fn = harness(layer, len(shapes) == 1, with_inputs)
        fn(inputs).numpy()
        overheads.append(fastest(identity, identity_inputs))
        raw.append(fastest(fn, inputs))
    overheads.append(fastest(identity, identity_inputs))
    overhead = min(overheads)
    return [max(t - overhead, 0.0) for t in raw]


def measure_stage_costs(graph, infos, device: str, batch: int) -> None:
    """Fills `info.seconds` of every layer of `graph` with its measured forward + training backward
    on `device` at `batch` samples (balance="time"). The layers' variables (BatchNorm statistics,
    RNG seeds) are put back as they were, so measuring changes no weight."""
    import tensorflow as tf

    layers = [layer for layer, *_ in graph]
    saved = [[v.numpy() for v in layer.variables] for layer in layers]
    with tf.device(device):
        times = measure_layer_times(layers, [info.input_shapes for info in infos], batch=batch,
                                    input_gradients=needs_input_gradients(graph))
    for layer, values in zip(layers, saved):
        for v, value in zip(layer.variables, values):
            v.assign(value)
    for info, seconds in zip(infos, times):
        info.seconds = seconds
