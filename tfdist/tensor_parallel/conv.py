"""Operator-level model parallelism for convolutions: one Conv2D kernel split over devices.

`split="output"` gives each device a block of the filters: device d convolves the whole input with
its filters (plus its block of the bias and the activation), and the blocks are concatenated on
the channel axis, or handed on unconcatenated with `gather_output=False`. `split="input"` gives
each device a block of the input channels: device d convolves its slice of the channels with its
block of the kernel, and the partial outputs are summed before the bias and the activation. An
output-split layer with `gather_output=False` followed by an input-split layer with
`input_is_parallel=True` is the convolutional form of Megatron's MLP: one sum per pair.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import ops

from tfdist.arguments import check_bool, check_int
from tfdist.devices import chosen_devices
from tfdist.tensor_parallel.split import add_kernel_blocks, split_inputs, split_outputs

__all__ = ["ParallelConv2D"]

_SPLITS = ("output", "input")


def _pair(value, name: str) -> tuple[int, int]:
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, int) and v >= 1 for v in pair):
        raise ValueError(f"{name} must be a positive integer or a pair of them, got {value!r}.")
    return pair


@keras.saving.register_keras_serializable(package="tfdist")
class ParallelConv2D(keras.layers.Layer):
    """`keras.layers.Conv2D` (channels last) with its kernel split over `devices`.

    Args:
        filters: Output channels; with `split="output"` a multiple of the number of devices.
        kernel_size, strides, padding, dilation_rate, activation, use_bias: As in
            `keras.layers.Conv2D`, as are `kernel_initializer` and `bias_initializer`.
        devices: The devices holding one kernel block each (default: the first two).
        split: "output" splits the filters, "input" the input channels (which must then divide).
        gather_output: With `split="output"`, False hands on the per-device blocks as a list.
        input_is_parallel: With `split="input"`, the input is that list (one block per device).

    Example:
        ```python
        devices = tfdist.devices.local_devices(2)
        conv = tfdist.tensor_parallel.ParallelConv2D(32, 3, padding="same", devices=devices)
        print(conv(x[:4]).shape)  # 16 filters on each device
        ```
    """

    def __init__(self, filters: int, kernel_size, strides=1, padding: str = "valid",
                 dilation_rate=1, activation=None, use_bias: bool = True, devices=None,
                 split: str = "output", gather_output: bool = True,
                 input_is_parallel: bool = False, kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", **kwargs):
        super().__init__(**kwargs)
        check_int("filters", filters, 1)
        if split not in _SPLITS:
            raise ValueError(f"split={split!r} is not one of {_SPLITS}: 'output' splits the "
                             "filters over the devices, 'input' the input channels.")
        if padding not in ("valid", "same"):
            raise ValueError(f"padding={padding!r}: use 'valid' or 'same'.")
        if gather_output is False and split != "output":
            raise ValueError("gather_output=False needs split='output'.")
        if input_is_parallel and split != "input":
            raise ValueError("input_is_parallel=True needs split='input'.")
        self.filters = filters
        self.kernel_size = _pair(kernel_size, "kernel_size")
        self.strides = _pair(strides, "strides")
        self.dilation_rate = _pair(dilation_rate, "dilation_rate")
        self.padding = padding
        self.activation = keras.activations.get(activation)
        self.use_bias = check_bool("use_bias", use_bias)
        self.devices = chosen_devices(devices, 2, type(self).__name__)
        self.split = split
        self.gather_output = gather_output
        self.input_is_parallel = input_is_parallel
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.supports_jit = False  # XLA would compile every block onto one device
        n = len(self.devices)
        if split == "output" and filters % n:
            raise ValueError(f"filters={filters} is not divisible by the {n} devices "
                             f"{self.devices}: use a multiple of {n}, or split='input'.")

    def build(self, input_shape):
        n = len(self.devices)
        if self.input_is_parallel:
            if len(input_shape) != n:
                raise ValueError(f"ParallelConv2D(input_is_parallel=True) on {n} devices got "
                                 f"{len(input_shape)} inputs: give one input per device.")
            channels = sum(shape[-1] for shape in input_shape)
        else:
            channels = input_shape[-1]
        if self.split == "input" and channels % n:
            raise ValueError(f"input channels={channels} are not divisible by the {n} devices "
                             f"{self.devices}: use a multiple of {n} channels, or "
                             "split='output'.")
        full = self.kernel_initializer((*self.kernel_size, channels, self.filters))
        self.kernels = add_kernel_blocks(self, self.devices, full,
                                         axis=3 if self.split == "output" else 2)
        self.biases = []
        if self.use_bias:
            blocks = n if self.split == "output" else 1
            for d in range(blocks):
                with tf.device(self.devices[d]):
                    self.biases.append(self.add_weight(
                        name=f"bias_{d}", shape=(self.filters // blocks,),
                        initializer=self.bias_initializer))

    def _conv(self, x, kernel):
        return ops.conv(x, kernel, strides=self.strides, padding=self.padding,
                        dilation_rate=self.dilation_rate, data_format="channels_last")

    def call(self, inputs):
        if self.split == "output":
            return split_outputs(self._conv, self.devices, inputs, self.kernels, self.biases,
                                 self.activation, self.gather_output)
        return split_inputs(self._conv, self.devices, inputs, self.kernels,
                            self.biases[0] if self.use_bias else None, self.activation,
                            self.input_is_parallel)

    def compute_output_shape(self, input_shape):
        shape = input_shape[0] if self.input_is_parallel else input_shape
        spatial = []
        for size, k, s, r in zip(shape[1:3], self.kernel_size, self.strides, self.dilation_rate):
            if size is None:
                spatial.append(None)
            elif self.padding == "same":
                spatial.append(-(-size // s))
            else:
                spatial.append((size - (k - 1) * r - 1) // s + 1)
        if self.split == "output" and not self.gather_output:
            return [(shape[0], *spatial, self.filters // len(self.devices))] * len(self.devices)
        return (shape[0], *spatial, self.filters)

    def load_from(self, layer: keras.layers.Conv2D) -> None:
        """Takes an unsplit `keras.layers.Conv2D`'s kernel and bias (it must have this layer's
        filters, kernel size and input channels)."""
        if not isinstance(layer, keras.layers.Conv2D) or layer.data_format != "channels_last":
            raise ValueError(f"ParallelConv2D.load_from takes a channels-last "
                             f"keras.layers.Conv2D, got {layer!r}.")
        kernel = layer.kernel
        expected = (*self.kernel_size, sum(k.shape[2] for k in self.kernels)
                    if self.split == "input" else self.kernels[0].shape[2], self.filters)
        if tuple(kernel.shape) != expected:
            raise ValueError(f"{layer.name}'s kernel has shape {tuple(kernel.shape)}, this "
                             f"layer's blocks make {expected}.")
        axis = 3 if self.split == "output" else 2
        for variable, block in zip(self.kernels, tf.split(kernel, len(self.devices), axis=axis)):
            variable.assign(block)
        if self.use_bias and layer.use_bias:
            for variable, block in zip(self.biases, tf.split(layer.bias, len(self.biases))):
                variable.assign(block)

    def get_config(self):
        return {**super().get_config(), "filters": self.filters,
                "kernel_size": self.kernel_size, "strides": self.strides,
                "padding": self.padding, "dilation_rate": self.dilation_rate,
                "activation": keras.activations.serialize(self.activation),
                "use_bias": self.use_bias, "devices": list(self.devices), "split": self.split,
                "gather_output": self.gather_output, "input_is_parallel": self.input_is_parallel,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer)}
