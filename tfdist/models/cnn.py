"""The example convolutional network used by the CLI, the notebooks and the tests."""

from __future__ import annotations

import keras


def cnn(
    input_shape: tuple[int, ...] = (28, 28, 1),
    num_classes: int = 10,
    *,
    filters: tuple[int, int] = (32, 64),
    dense_units: int = 128,
    dropout: float = 0.0,
    seed: int | None = 0,
) -> keras.Model:
    """Returns a small Conv-Pool-Conv-Pool-Dense classifier with softmax outputs.

    Layers have fixed names (conv1, pool1, conv2, pool2, flatten, dense1, [dropout], logits) so
    placement plans and tests can refer to them. `seed` makes initial weights reproducible; build it
    inside `strategy.scope()` to train it with a strategy. Inputs smaller than 12x12 (e.g. 8x8 digits)
    skip the second pooling.

    Example:
        >>> model = tfdist.models.cnn()
        >>> model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    """
    init = lambda i: keras.initializers.GlorotUniform(seed=None if seed is None else seed + i)  # noqa: E731
    small = min(input_shape[:2]) < 12
    layers = [
        keras.Input(input_shape, name="image"),
        keras.layers.Conv2D(filters[0], 3, padding="same", activation="relu", kernel_initializer=init(0), name="conv1"),
        keras.layers.MaxPooling2D(2, name="pool1"),
        keras.layers.Conv2D(filters[1], 3, padding="same", activation="relu", kernel_initializer=init(1), name="conv2"),
    ]
    if not small:
        layers.append(keras.layers.MaxPooling2D(2, name="pool2"))
    layers += [
        keras.layers.Flatten(name="flatten"),
        keras.layers.Dense(dense_units, activation="relu", kernel_initializer=init(2), name="dense1"),
    ]
    if dropout:
        layers.append(keras.layers.Dropout(dropout, seed=seed, name="dropout"))
    layers.append(keras.layers.Dense(num_classes, activation="softmax", kernel_initializer=init(3), name="logits"))
    return keras.Sequential(layers, name="cnn")
