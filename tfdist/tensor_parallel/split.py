"""The two ways a kernel is split over devices, shared by the Dense and Conv2D layers.

* By outputs (Megatron's column split): device d applies `op` to the whole input with its kernel
  block, adds its bias block and the activation; the blocks are concatenated on the first device,
  or handed on as a list.
* By inputs (the row split): device d applies `op` to its slice of the input's last axis with its
  kernel block; the partial results are summed on the first device before the bias and the
  activation.

`op(x, kernel)` is the layer's product (a matmul, a convolution); each block's forward and
gradient run on its device (`on_device`).
"""

from __future__ import annotations

import tensorflow as tf

from tfdist.devices import on_device


def add_kernel_blocks(layer, devices: list[str], full, axis: int) -> list:
    """One weight per device, named kernel_<d>, holding block d of the `full` initial kernel
    split along `axis` (so the split layer starts where the unsplit one would)."""
    blocks = []
    for d, (device, block) in enumerate(zip(devices, tf.split(full, len(devices), axis=axis))):
        with tf.device(device):
            blocks.append(layer.add_weight(
                name=f"kernel_{d}", shape=tuple(block.shape),
                initializer=lambda shape, dtype=None, block=block: tf.cast(block, dtype)))
    return blocks


def split_outputs(op, devices: list[str], inputs, kernels, biases, activation, gather: bool):
    outs = []
    for device, kernel, bias in zip(devices, kernels, biases or [None] * len(devices)):
        def block(x, kernel, *bias):
            y = op(x, kernel)
            return activation(y + bias[0] if bias else y)
        extra = [] if bias is None else [bias.value]
        outs.append(on_device(device, block, inputs, kernel.value, *extra))
    if not gather:
        return outs
    with tf.device(devices[0]):
        return tf.concat(outs, axis=-1)


def split_inputs(op, devices: list[str], inputs, kernels, bias, activation,
                 input_is_parallel: bool):
    parts = list(inputs) if input_is_parallel else None
    if parts is None:
        with tf.device(devices[0]):
            parts = tf.split(inputs, len(devices), axis=-1)
    partial = [on_device(device, op, part, kernel.value)
               for device, part, kernel in zip(devices, parts, kernels)]
    with tf.device(devices[0]):
        y = tf.add_n(partial)
        return activation(y + bias if bias is not None else y)
