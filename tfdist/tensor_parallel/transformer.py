"""A tensor-parallel Transformer block (pre-norm): attention heads split over the devices, the MLP
split Megatron-style (first Dense by columns, second by rows), so each half of the block costs one
sum forward and one backward.

    y = x + attention(norm1(x));  out = y + mlp_out(activation(mlp_in(norm2(y))))

`transformer_block` builds the same block from plain Keras layers, with the layer names
`ParallelTransformerBlock.load_from` reads.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfdist.devices import chosen_devices
from tfdist.tensor_parallel.attention import ParallelMultiHeadAttention
from tfdist.tensor_parallel.dense import ColumnParallelDense, RowParallelDense

__all__ = ["ParallelTransformerBlock", "transformer_block"]


def transformer_block(input_shape, num_heads: int, key_dim: int, ff_dim: int,
                      activation="gelu", causal: bool = False, name: str = "transformer_block"
                      ) -> keras.Model:
    """The unsplit block as a functional Keras model on inputs of shape (sequence, features);
    its layers are named attention_norm, attention, mlp_norm, mlp_in and mlp_out.

    Example:
        ```python
        block = tfdist.tensor_parallel.transformer_block((64, 32), num_heads=4, key_dim=8, ff_dim=64)
        print(block.count_params())  # the unsplit reference of ParallelTransformerBlock
        ```
    """
    x = keras.Input(tuple(input_shape))
    h = keras.layers.LayerNormalization(name="attention_norm")(x)
    h = keras.layers.MultiHeadAttention(num_heads, key_dim, name="attention")(
        h, h, use_causal_mask=causal)
    y = x + h
    h = keras.layers.LayerNormalization(name="mlp_norm")(y)
    h = keras.layers.Dense(ff_dim, activation=activation, name="mlp_in")(h)
    h = keras.layers.Dense(input_shape[-1], name="mlp_out")(h)
    return keras.Model(x, y + h, name=name)


@keras.saving.register_keras_serializable(package="tfdist")
class ParallelTransformerBlock(keras.layers.Layer):
    """`transformer_block` with its attention heads and MLP units split over `devices`.

    Args:
        num_heads: A multiple of the number of devices.
        key_dim: Size of each attention head.
        ff_dim: The MLP's hidden units, a multiple of the number of devices.
        activation: The MLP's activation.
        causal: Masks attention to later positions (a decoder block).
        devices: The devices (default: the first two).

    Example:
        ```python
        plain = tfdist.tensor_parallel.transformer_block((64, 32), num_heads=4, key_dim=8, ff_dim=64)
        block = tfdist.tensor_parallel.ParallelTransformerBlock(
            4, 8, 64, devices=tfdist.devices.local_devices(2))
        block(np.zeros((1, 64, 32), "float32"))  # builds it
        block.load_from(plain)
        z = np.random.rand(2, 64, 32).astype("float32")
        np.testing.assert_allclose(block(z), plain(z), atol=1e-5)
        ```
    """

    def __init__(self, num_heads: int, key_dim: int, ff_dim: int, activation="gelu",
                 causal: bool = False, devices=None, **kwargs):
        super().__init__(**kwargs)
        self.devices = chosen_devices(devices, 2, type(self).__name__)
        self.num_heads, self.key_dim, self.ff_dim = num_heads, key_dim, ff_dim
        self.activation = keras.activations.get(activation)
        self.causal = causal
        self.supports_jit = False
        # The norms live on the first device (built there in `build`).
        self.attention_norm = keras.layers.LayerNormalization(name="attention_norm")
        self.mlp_norm = keras.layers.LayerNormalization(name="mlp_norm")
        self.attention = ParallelMultiHeadAttention(num_heads, key_dim, devices=self.devices,
                                                    name="attention")
        self.mlp_in = ColumnParallelDense(ff_dim, self.devices, activation=activation,
                                          gather_output=False, name="mlp_in")
        self.mlp_out: RowParallelDense | None = None

    def build(self, input_shape):
        with tf.device(self.devices[0]):
            self.attention_norm.build(input_shape)
            self.mlp_norm.build(input_shape)
        self.attention.build(input_shape, input_shape)
        self.mlp_in.build(input_shape)
        self.mlp_out = RowParallelDense(input_shape[-1], self.devices, input_is_parallel=True,
                                        name="mlp_out")
        n = len(self.devices)
        self.mlp_out.build([(*input_shape[:-1], self.ff_dim // n)] * n)

    def call(self, inputs):
        assert self.mlp_out is not None
        with tf.device(self.devices[0]):
            h = self.attention_norm(inputs)
        y = inputs + self.attention(h, h, use_causal_mask=self.causal)
        with tf.device(self.devices[0]):
            h = self.mlp_norm(y)
        return y + self.mlp_out(self.mlp_in(h))

    def compute_output_shape(self, input_shape):
        return input_shape

    def load_from(self, block: keras.Model) -> None:
        """Takes the weights of an unsplit block (`transformer_block`, or any model or layer with
        layers named attention_norm, attention, mlp_norm, mlp_in and mlp_out)."""
        if self.mlp_out is None:
            raise ValueError(f"{self.name} is not built yet: call it once (or build it) before "
                             "load_from.")
        self.attention_norm.set_weights(block.get_layer("attention_norm").get_weights())
        self.mlp_norm.set_weights(block.get_layer("mlp_norm").get_weights())
        self.attention.load_from(block.get_layer("attention"))
        self.mlp_in.load_from(block.get_layer("mlp_in"))
        self.mlp_out.load_from(block.get_layer("mlp_out"))

    def get_config(self):
        return {**super().get_config(), "num_heads": self.num_heads, "key_dim": self.key_dim,
                "ff_dim": self.ff_dim, "activation": keras.activations.serialize(self.activation),
                "causal": self.causal, "devices": list(self.devices)}
