"""The parts of Keras' optimizer step that every ZeRO engine applies itself, on state spread over replicas.

A sharded engine runs the user's optimizer's own `update_step` on each owner's shard, so Keras never sees the
whole step: gradient accumulation, decoupled weight decay and the moving average (EMA) are applied here, with
Keras' rules, on whatever the engine's per-replica state is — one flat shard per replica (stages 1 and 2) or one
piece per variable and replica (stage 3). A replica's state is a tensor or a list of tensors; the functions take
it as it comes (`tf.nest`), so both engines share one implementation. Clipping on the global gradient is in
`tfdist.zero.clipping`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf

from tfdist._compat import keras_optimizer

__all__ = ["accumulate_or_update", "decay", "ema_step", "moving_average", "overwrite_every", "update_averages"]


def accumulate_or_update(optimizer, grads: Sequence, accumulators: Sequence, devices: Sequence[str], dtype,
                         update: Callable[[list], None]) -> None:
    """Keras' `gradient_accumulation_steps`: every micro-step adds `grads[i]` (replica i's reduced gradient
    state) to its accumulators on `devices[i]`; every k-th calls `update(mean of the k)` and zeroes them. Without
    accumulation it calls `update(grads)`. Cross-replica context, inside the step's tf.function."""
    steps = optimizer.gradient_accumulation_steps
    if not steps:
        update(list(grads))
        return
    micro_steps = keras_optimizer.iteration_counter(optimizer)

    def mean_and_update():
        total = []
        for row, accs, device in zip(grads, accumulators, devices):
            with tf.device(device):
                total.append(tf.nest.map_structure(lambda g, a: (tf.identity(g) + a) / tf.cast(steps, dtype),
                                                   row, accs))
        update(total)
        for accs, device in zip(accumulators, devices):
            with tf.device(device):
                for a in tf.nest.flatten(accs):
                    a.assign(tf.zeros_like(a))
        return tf.constant(True)

    def accumulate():
        for row, accs, device in zip(grads, accumulators, devices):
            with tf.device(device):
                for g, a in zip(tf.nest.flatten(row), tf.nest.flatten(accs)):
                    a.assign_add(tf.identity(g))
        return tf.constant(False)

    tf.cond(tf.equal((micro_steps + 1) % steps, 0), mean_and_update, accumulate)


def decay(optimizer, variables: Sequence, params: Sequence, lrs: Sequence, devices: Sequence[str], dtype) -> None:
    """Keras' decoupled weight decay (`exclude_from_weight_decay` honoured): `params[j][i]`, replica i's copy (or
    piece) of `variables[j]`, loses `weight_decay * lr` of itself, with Keras' own ops, in cross-replica context
    (where Keras' `_apply_weight_decay` would need a merge_call)."""
    if not optimizer.weight_decay:
        return
    for j, variable in enumerate(variables):
        if not keras_optimizer.uses_weight_decay(optimizer, variable):
            continue
        for i, device in enumerate(devices):
            with tf.device(device):
                wd, lr = tf.cast(optimizer.weight_decay, dtype), tf.cast(lrs[i], dtype)
                params[j][i].assign_sub(params[j][i] * wd * lr)


def update_averages(optimizer, averages: Sequence, currents: Sequence, iterations, devices: Sequence[str],
                    dtype) -> None:
    """Keras' EMA, `average = m * average + (1 - m) * variable` with m = 0 on the first step: `averages[i]` and
    `currents[i]` are replica i's state (a tensor or a list) on `devices[i]`."""
    for average, current, device in zip(averages, currents, devices):
        with tf.device(device):
            for a, c in zip(tf.nest.flatten(average), tf.nest.flatten(current())):
                a.assign(moving_average(optimizer, a, c, iterations, dtype))


def moving_average(optimizer, average, current, iterations, dtype) -> tf.Tensor:
    """Keras' EMA of one variable after a step: `m * average + (1 - m) * current`, m = 0 on the first step
    (`iterations` before its increment) and the optimizer's `ema_momentum` after it."""
    momentum = tf.cast(tf.not_equal(iterations, 0), dtype) * tf.cast(optimizer.ema_momentum, dtype)
    return momentum * average + (1 - momentum) * current


def ema_step(optimizer, iterations, update: Callable[[], None], overwrite: Callable[[], None]) -> None:
    """With `use_ema`: `update()` the averages, and every `ema_overwrite_frequency` steps `overwrite()` the
    parameters with them, as Keras' optimizer does."""
    if not optimizer.use_ema:
        return
    update()
    overwrite_every(optimizer, iterations, overwrite)


def overwrite_every(optimizer, iterations, overwrite: Callable[[], None]) -> None:
    """Calls `overwrite()` on the steps where Keras' `ema_overwrite_frequency` says so (never when it is None)."""
    frequency = optimizer.ema_overwrite_frequency
    if not frequency:
        return

    def run():
        overwrite()
        return tf.constant(True)

    tf.cond(tf.equal((iterations + 1) % frequency, 0), run, lambda: tf.constant(False))
