"""Operator-level model parallelism for attention: the heads of one multi-head attention layer split
over devices (Megatron-LM).

Device d holds the query, key and value projections of its block of heads and the rows of the
output projection that read them. It projects the whole input into its heads, attends, and
projects its heads' outputs to a partial result; the partial results are summed (the one
all-reduce forward) before the output bias. Backward, the gradients reaching the shared input
from every device are summed (the one all-reduce backward). Nothing else crosses devices.
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf
from keras import ops

from tfdist.arguments import check_bool, check_int
from tfdist.devices import chosen_devices, on_device

__all__ = ["ParallelMultiHeadAttention"]


@keras.saving.register_keras_serializable(package="tfdist")
class ParallelMultiHeadAttention(keras.layers.Layer):
    """`keras.layers.MultiHeadAttention` (3-D inputs, attention over the sequence axis) with its
    heads split over `devices`.

    Called like Keras' layer: `layer(query, value, key=None, attention_mask=None,
    use_causal_mask=False)`. It has no attention dropout (add a `Dropout` after it).

    Args:
        num_heads: A multiple of the number of devices.
        key_dim, value_dim, use_bias, output_shape, kernel_initializer, bias_initializer:
            As in `keras.layers.MultiHeadAttention` (`output_shape`: an int, the last dimension).
        devices: The devices holding one block of heads each (default: the first two).

    Example:
        ```python
        devices = tfdist.devices.local_devices(2)
        attention = tfdist.tensor_parallel.ParallelMultiHeadAttention(4, 8, devices=devices)
        sequence = np.random.rand(2, 16, 32).astype("float32")
        print(attention(sequence, sequence).shape)  # 2 heads on each device
        ```
    """

    def __init__(self, num_heads: int, key_dim: int, value_dim: int | None = None,
                 use_bias: bool = True, output_shape: int | None = None, devices=None,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros", **kwargs):
        super().__init__(**kwargs)
        for name, value in (("num_heads", num_heads), ("key_dim", key_dim),
                            ("value_dim", value_dim if value_dim is not None else key_dim)):
            check_int(name, value, 1)
        self.num_heads = num_heads
        self.key_dim = key_dim
        self.value_dim = value_dim if value_dim is not None else key_dim
        self.use_bias = check_bool("use_bias", use_bias)
        self.output_dim = output_shape
        self.devices = chosen_devices(devices, 2, type(self).__name__)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.supports_jit = False  # XLA would compile every block onto one device
        n = len(self.devices)
        if num_heads % n:
            raise ValueError(f"num_heads={num_heads} is not divisible by the {n} devices "
                             f"{self.devices}: use a multiple of {n} heads, or {n}'s divisor as "
                             "the number of devices.")
        self.heads_per_device = num_heads // n

    def build(self, query_shape, value_shape=None, key_shape=None):
        value_shape = value_shape or query_shape
        key_shape = key_shape or value_shape
        out_dim = self.output_dim or query_shape[-1]
        h = self.heads_per_device
        shapes = {"query": (query_shape[-1], self.num_heads, self.key_dim),
                  "key": (key_shape[-1], self.num_heads, self.key_dim),
                  "value": (value_shape[-1], self.num_heads, self.value_dim)}
        self.blocks: list[dict[str, keras.Variable]] = []
        full = {name: self.kernel_initializer(shape) for name, shape in shapes.items()}
        full["output"] = self.kernel_initializer((self.num_heads, self.value_dim, out_dim))
        for d, device in enumerate(self.devices):
            heads = slice(d * h, (d + 1) * h)
            block = {}
            with tf.device(device):
                for name, kernel in full.items():
                    part = kernel[heads] if name == "output" else kernel[:, heads]
                    block[f"{name}_kernel"] = self.add_weight(
                        name=f"{name}_kernel_{d}", shape=tuple(part.shape),
                        initializer=lambda shape, dtype=None, part=part: tf.cast(part, dtype))
                    if self.use_bias and name != "output":
                        block[f"{name}_bias"] = self.add_weight(
                            name=f"{name}_bias_{d}", shape=tuple(part.shape[1:]),
                            initializer=self.bias_initializer)
            self.blocks.append(block)
        if self.use_bias:
            with tf.device(self.devices[0]):
                self.output_bias = self.add_weight(name="output_bias", shape=(out_dim,),
                                                   initializer=self.bias_initializer)

    def _heads(self, query, key, value, mask, causal, names, *weights):
        w = dict(zip(names, weights))

        def project(x, name):
            y = ops.einsum("abc,cde->abde", x, w[f"{name}_kernel"])
            return y + w[f"{name}_bias"] if self.use_bias else y

        q, k, v = project(query, "query"), project(key, "key"), project(value, "value")
        out = ops.dot_product_attention(q, k, v, mask=mask, scale=1.0 / math.sqrt(self.key_dim),
                                        is_causal=causal)
        return ops.einsum("abcd,cde->abe", out, w["output_kernel"])

    def call(self, query, value, key=None, attention_mask=None, use_causal_mask=False):
        key = value if key is None else key
        mask, causal = None, False
        if attention_mask is not None:
            mask = ops.cast(attention_mask, "bool")
            if use_causal_mask:
                rows = ops.expand_dims(ops.arange(ops.shape(query)[1]), -1)
                cols = ops.arange(ops.shape(value)[1])
                mask = ops.logical_and(mask, ops.expand_dims(rows >= cols, 0))
            mask = ops.expand_dims(mask, 1)  # [B, 1, T, S]: the same for every head
        else:
            causal = bool(use_causal_mask)
        partial = []
        for device, block in zip(self.devices, self.blocks):
            names = list(block)
            def heads(q, k, v, *weights, names=names):
                return self._heads(q, k, v, mask, causal, names, *weights)
            partial.append(on_device(device, heads, query, key, value,
                                     *(variable.value for variable in block.values())))
        with tf.device(self.devices[0]):
            y = tf.add_n(partial)
            return y + self.output_bias if self.use_bias else y

    def compute_output_shape(self, query_shape, value_shape=None, key_shape=None):
        return (*query_shape[:-1], self.output_dim or query_shape[-1])

    def load_from(self, layer: keras.layers.MultiHeadAttention) -> None:
        """Takes an unsplit `keras.layers.MultiHeadAttention`'s weights (same heads and sizes)."""
        if not isinstance(layer, keras.layers.MultiHeadAttention):
            raise ValueError(f"ParallelMultiHeadAttention.load_from takes a "
                             f"keras.layers.MultiHeadAttention, got {layer!r}.")
        if (layer.num_heads, layer.key_dim, layer.value_dim) != (
                self.num_heads, self.key_dim, self.value_dim):
            raise ValueError(
                f"{layer.name} has num_heads={layer.num_heads}, key_dim={layer.key_dim}, "
                f"value_dim={layer.value_dim}; this layer has {self.num_heads}, {self.key_dim}, "
                f"{self.value_dim}.")
        dense = {"query": layer.query_dense, "key": layer.key_dense, "value": layer.value_dense,
                 "output": layer.output_dense}
        h = self.heads_per_device
        for d, block in enumerate(self.blocks):
            heads = slice(d * h, (d + 1) * h)
            for name, source in dense.items():
                kernel = ops.convert_to_tensor(source.kernel)
                block[f"{name}_kernel"].assign(kernel[heads] if name == "output"
                                               else kernel[:, heads])
                if self.use_bias and name != "output":
                    block[f"{name}_bias"].assign(ops.convert_to_tensor(source.bias)[heads])
        if self.use_bias:
            self.output_bias.assign(layer.output_dense.bias)

    def get_config(self):
        return {**super().get_config(), "num_heads": self.num_heads, "key_dim": self.key_dim,
                "value_dim": self.value_dim, "use_bias": self.use_bias,
                "output_shape": self.output_dim, "devices": list(self.devices),
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer)}
