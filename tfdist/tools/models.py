"""Named model builders used by configs and benchmarks."""

from __future__ import annotations

import keras


def build_model(name: str, input_shape, num_classes: int, hidden=(64,), **kwargs) -> keras.Model:
    """Builds one of MODELS by name (see `MODELS` for the choices); a ValueError says when
    the model does not take examples of `input_shape`, and which one does."""
    if name not in MODELS:
        raise ValueError(f"Unknown model {name!r}; choose one of {sorted(MODELS)}.")
    rank, what, least = INPUTS.get(name, (None, "", 0))
    shape = tuple(input_shape)
    if rank is not None and (len(shape) != rank or min(shape[:2]) < least):
        fits = [n for n, (r, _, at_least) in INPUTS.items()
                if r == len(shape) and min(shape[:2] or (0,)) >= at_least]
        raise ValueError(f"model.name {name!r} takes {what}; the data's examples are of shape "
                         f"{shape}: use {' or '.join(['mlp', *fits])} (model.name), or a model "
                         "of your own (model.name: module:function)")
    return MODELS[name](shape, num_classes, tuple(hidden), **kwargs)


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


def resnet50(input_shape, num_classes, hidden) -> keras.Model:
    """ResNet-50 (keras.applications, random weights) on images of `input_shape` (at least
    32 x 32 x 3); `hidden` is not used."""
    return keras.applications.ResNet50(weights=None, input_shape=input_shape,
                                       classes=num_classes, classifier_activation="softmax")


def transformer(input_shape, num_classes, hidden, layers: int = 4, heads: int = 4,
                vocab: int = 8192) -> keras.Model:
    """A BERT-like encoder (random weights): token embedding + learned positions, `layers`
    pre-norm blocks of `heads`-head self-attention and a 4x MLP, mean-pooled into a classifier.
    Width `hidden[0]` (d_model); the sequence length is `input_shape[0]`. The tokens are the
    inputs bucketed into `vocab` ids (synthetic data gives Gaussian values), so any numeric input
    of shape [sequence] works."""
    (length,), width = tuple(input_shape), hidden[0]
    if width % heads:
        raise ValueError(f"The transformer's width (model.hidden[0]={width}) must divide by its "
                         f"heads ({heads}).")
    inputs = keras.Input((length,))
    scaled = keras.ops.clip((inputs + 4.0) * (vocab / 8.0), 0, vocab - 1)
    ids = keras.ops.cast(scaled, "int32")
    h = keras.layers.Embedding(vocab, width, name="tokens")(ids)
    h = PositionEmbedding(name="positions")(h)
    for i in range(layers):
        a = keras.layers.LayerNormalization(name=f"ln_a{i}")(h)
        a = keras.layers.MultiHeadAttention(heads, width // heads, name=f"attention_{i}")(a, a)
        h = h + a
        m = keras.layers.LayerNormalization(name=f"ln_m{i}")(h)
        m = keras.layers.Dense(4 * width, activation="gelu", name=f"mlp_in_{i}")(m)
        h = h + keras.layers.Dense(width, name=f"mlp_out_{i}")(m)
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.LayerNormalization(name="ln_f")(h))
    outputs = keras.layers.Dense(num_classes, activation="softmax", dtype="float32",
                                 name="logits")(h)
    return keras.Model(inputs, outputs, name="transformer")


@keras.saving.register_keras_serializable(package="tfdist")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned vector per position to a sequence of shape [batch, length, width]: one
    trainable [length, width] table (initialized as keras.layers.Embedding's), whose gradient
    is a dense tensor of the table's shape."""

    def build(self, input_shape):
        length, width = input_shape[-2:]
        self.embeddings = self.add_weight(shape=(length, width), initializer="uniform",
                                          name="embeddings")

    def call(self, inputs):
        return inputs + keras.ops.cast(self.embeddings, inputs.dtype)


MODELS = {"mlp": mlp, "cnn": cnn, "resnet50": resnet50, "transformer": transformer}
# What a built-in model takes (mlp: any shape): (the rank of one example, what that is, the
# least height and width).
INPUTS = {"cnn": (3, "images (height, width, channels)", 1),
          "resnet50": (3, "images of at least 32 x 32 (height, width, channels)", 32),
          "transformer": (1, "sequences (one number per position)", 1)}
