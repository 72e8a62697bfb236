"""Named model builders used by configs and benchmarks."""

from __future__ import annotations

import keras


def build_model(name: str, input_shape, num_classes: int, hidden=(64,), **kwargs) -> keras.Model:
    """Builds one of MODELS by name (see `MODELS` for the choices)."""
    if name not in MODELS:
        raise ValueError(f"Unknown model {name!r}; choose one of {sorted(MODELS)}.")
    return MODELS[name](tuple(input_shape), num_classes, tuple(hidden), **kwargs)


def mlp(input_shape, num_classes, hidden) -> keras.Model:
    """Flatten + Dense(ReLU) layers + softmax classifier."""
    inputs = keras.Input(input_shape)
    h = keras.layers.Flatten()(inputs)
    for i, width in enumerate(hidden):
        h = keras.layers.Dense(width, activation="relu", name=f"dense_{i}")(h)
    outputs = keras.layers.Dense(num_classes, activation="softmax", dtype="float32", name="logits")(h)
    return keras.Model(inputs, outputs, name="mlp")


def cnn(input_shape, num_classes, hidden) -> keras.Model:
    """Two 3x3 convolutions (with BatchNorm), pooling, Dense layers, softmax classifier."""
    inputs = keras.Input(input_shape)
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="conv_0")(inputs)
    h = keras.layers.BatchNormalization(name="bn_0")(h)
    h = keras.layers.Conv2D(64, 3, padding="same", activation="relu", name="conv_1")(h)
    h = keras.layers.MaxPooling2D(2)(h)
    h = keras.layers.Flatten()(h)
    for i, width in enumerate(hidden):
        h = keras.layers.Dense(width, activation="relu", name=f"dense_{i}")(h)
    outputs = keras.layers.Dense(num_classes, activation="softmax", dtype="float32", name="logits")(h)
    return keras.Model(inputs, outputs, name="cnn")


MODELS = {"mlp": mlp, "cnn": cnn}
