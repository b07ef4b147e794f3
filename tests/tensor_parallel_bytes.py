"""Per-device bytes of variables of a Transformer block split by `tfdist.LayoutMap.auto`, over 2 and 4 logical CPUs.

Run: python tests/tensor_parallel_bytes.py   (prints one line per model-axis size; the issue's target is 1/T + 2 %)
"""

from __future__ import annotations

import tfdist

tfdist.devices.virtual_cpus(4)

import keras  # noqa: E402


def block() -> keras.Model:
    """d_model 256, 8 heads of 32, feed-forward 1024, sequence 16 (3.16 MB of float32 variables)."""
    inputs = keras.Input((16, 256))
    attention = keras.layers.MultiHeadAttention(num_heads=8, key_dim=32, name="mha")(inputs, inputs)
    x = keras.layers.LayerNormalization(name="ln1")(inputs + attention)
    h = keras.layers.Dense(1024, activation="relu", name="ff_up")(x)
    h = keras.layers.Dense(256, name="ff_down")(h)
    return keras.Model(inputs, keras.layers.LayerNormalization(name="ln2")(x + h))


def main() -> None:
    for parts in (2, 4):
        mesh = tfdist.DeviceMesh((1, parts), ("batch", "model"), [f"/cpu:{i}" for i in range(parts)])
        strategy = tfdist.ModelParallelStrategy(tfdist.LayoutMap.auto(block(), mesh))
        with strategy.scope():
            model = block()
        plan = strategy.shard(model)
        worst = max(plan.bytes_per_device.values()) / plan.replicated_bytes
        print(f"T={parts}: replicated {plan.replicated_bytes:,} B; per device "
              f"{ {d.rsplit(':', 2)[-2] + ':' + d.rsplit(':', 1)[-1]: b for d, b in plan.bytes_per_device.items()} }; "
              f"largest / replicated = {worst:.4f} (1/T = {1 / parts:.4f})")


if __name__ == "__main__":
    main()
