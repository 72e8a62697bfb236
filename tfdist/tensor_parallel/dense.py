"""Operator-level model parallelism: one Dense layer's kernel split over devices (Megatron-LM).

`ColumnParallelDense` splits the kernel by output units: device d computes `x @ W[:, d-th
block] + b[d-th block]` (and the activation), and the blocks are concatenated, or handed on
unconcatenated with `gather_output=False`. `RowParallelDense` splits the kernel by input features:
device d multiplies its slice of the input by its block of rows, and the partial products are
summed before the bias and the activation. A column layer with `gather_output=False` followed by
a row layer with `input_is_parallel=True` is Megatron's MLP: one sum per pair, no gather between.

Each device's forward and backward kernels run on that device (`split.py`); a layer with n
devices holds n kernel blocks, each where it is used.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfdist.arguments import check_bool, check_int
from tfdist.devices import chosen_devices
from tfdist.tensor_parallel.split import add_kernel_blocks, split_inputs, split_outputs

__all__ = ["ColumnParallelDense", "RowParallelDense"]


class _Parallel(keras.layers.Layer):
    def __init__(self, units: int, devices=None, activation=None, use_bias: bool = True,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros", **kwargs):
        super().__init__(**kwargs)
        check_int("units", units, 1)
        self.units = units
        self.devices = chosen_devices(devices, 2, type(self).__name__)
        self.activation = keras.activations.get(activation)
        self.use_bias = check_bool("use_bias", use_bias)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.supports_jit = False  # XLA would compile every block onto one device

    def _blocks(self, full_shape, axis: int) -> list:
        """One kernel block per device, initialized as slices of one full kernel."""
        return add_kernel_blocks(self, self.devices, self.kernel_initializer(full_shape), axis)

    def load_from(self, layer: keras.layers.Dense) -> None:
        """Takes an unsplit `keras.layers.Dense`'s kernel and bias."""
        if not isinstance(layer, keras.layers.Dense):
            raise ValueError(f"{type(self).__name__}.load_from takes a keras.layers.Dense, got "
                             f"{layer!r}.")
        self._load(layer.kernel, layer.bias if layer.use_bias else None)

    def get_config(self):
        return {**super().get_config(), "units": self.units, "devices": list(self.devices),
                "activation": keras.activations.serialize(self.activation),
                "use_bias": self.use_bias,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer)}


def _indivisible(what: str, value: int, n: int, devices) -> ValueError:
    return ValueError(f"{what}={value} is not divisible by the {n} devices {devices}: use a "
                      f"multiple of {n}, or {n}'s divisor as the number of devices.")


@keras.saving.register_keras_serializable(package="tfdist")
class ColumnParallelDense(_Parallel):
    """Dense with the kernel's output units split over `devices`.

    Example:
        ```python
        devices = tfdist.devices.local_devices(2)
        inputs = keras.Input((8, 8, 1))
        h = tfdist.tensor_parallel.ColumnParallelDense(128, devices, activation="relu",
                                                       gather_output=False)(keras.layers.Flatten()(inputs))
        outputs = tfdist.tensor_parallel.RowParallelDense(10, devices, input_is_parallel=True)(h)
        mlp = keras.Model(inputs, outputs)  # Megatron's MLP: one all-reduce in the forward
        mlp.compile(tfdist.devices.place_slots(keras.optimizers.Adam()),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        mlp.fit(x, y, batch_size=64, epochs=1)
        ```
    """

    def __init__(self, units: int, devices=None, gather_output: bool = True, **kwargs):
        super().__init__(units, devices, **kwargs)
        self.gather_output = gather_output
        n = len(self.devices)
        if units % n:
            raise _indivisible("units", units, n, self.devices)

    def build(self, input_shape):
        n = len(self.devices)
        self.kernels = self._blocks((input_shape[-1], self.units), axis=1)
        self.biases = []
        if self.use_bias:
            for d, device in enumerate(self.devices):
                with tf.device(device):
                    self.biases.append(self.add_weight(
                        name=f"bias_{d}", shape=(self.units // n,),
                        initializer=self.bias_initializer))

    def call(self, inputs):
        return split_outputs(tf.matmul, self.devices, inputs, self.kernels, self.biases,
                             self.activation, self.gather_output)

    def compute_output_shape(self, input_shape):
        n = len(self.devices)
        if self.gather_output:
            return (*input_shape[:-1], self.units)
        return [(*input_shape[:-1], self.units // n)] * n

    def _load(self, kernel, bias=None) -> None:
        """Sets the blocks from a full Dense kernel and bias (`dense.get_weights()`)."""
        for d, block in enumerate(tf.split(kernel, len(self.devices), axis=1)):
            self.kernels[d].assign(block)
        if bias is not None and self.use_bias:
            for d, block in enumerate(tf.split(bias, len(self.devices))):
                self.biases[d].assign(block)

    def get_config(self):
        return {**super().get_config(), "gather_output": self.gather_output}


@keras.saving.register_keras_serializable(package="tfdist")
class RowParallelDense(_Parallel):
    """Dense with the kernel's input features split over `devices`; takes a whole input, or
    the per-device list a `ColumnParallelDense(gather_output=False)` hands on.

    Example:
        ```python
        devices = tfdist.devices.local_devices(2)
        layer = tfdist.tensor_parallel.RowParallelDense(10, devices)  # a whole input, split inside
        print(layer(np.ones((4, 64), "float32")).shape)
        ```
    """

    def __init__(self, units: int, devices=None, input_is_parallel: bool = False, **kwargs):
        super().__init__(units, devices, **kwargs)
        self.input_is_parallel = input_is_parallel

    def build(self, input_shape):
        n = len(self.devices)
        if self.input_is_parallel:
            if len(input_shape) != n:
                raise ValueError(f"RowParallelDense(input_is_parallel=True) on {n} devices got "
                                 f"{len(input_shape)} inputs: give one input per device.")
            features = sum(shape[-1] for shape in input_shape)
        else:
            features = input_shape[-1]
            if features % n:
                raise _indivisible("input features", features, n, self.devices)
        self.kernels = self._blocks((features, self.units), axis=0)
        if self.use_bias:
            with tf.device(self.devices[0]):
                self.bias = self.add_weight(name="bias", shape=(self.units,),
                                            initializer=self.bias_initializer)

    def call(self, inputs):
        return split_inputs(tf.matmul, self.devices, inputs, self.kernels,
                            self.bias if self.use_bias else None, self.activation,
                            self.input_is_parallel)

    def compute_output_shape(self, input_shape):
        shape = input_shape[0] if self.input_is_parallel else input_shape
        return (*shape[:-1], self.units)

    def _load(self, kernel, bias=None) -> None:
        """Sets the blocks from a full Dense kernel and bias (`dense.get_weights()`)."""
        for d, block in enumerate(tf.split(kernel, len(self.devices), axis=0)):
            self.kernels[d].assign(block)
        if bias is not None and self.use_bias:
            self.bias.assign(bias)

    def get_config(self):
        return {**super().get_config(), "input_is_parallel": self.input_is_parallel}
