"""Model parallelism across the parallel branches of a block (Inception-style): each branch, a
Keras layer or model of its own, lives and runs on a device of its own, and the branch outputs are
merged on the first device.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfdist.devices import chosen_devices, on_device

__all__ = ["ParallelBranches"]

_MERGES = ("concat", "add", None)


@keras.saving.register_keras_serializable(package="tfdist")
class ParallelBranches(keras.layers.Layer):
    """Runs `branches` (Keras layers or models, all taking the same input) on `devices`, branch i
    on `devices[i % len(devices)]`, forward and backward; their weights are created there.

    Args:
        branches: The branches, e.g. the 1x1, 3x3, 5x5 and pooling towers of an Inception block.
        devices: The devices (default: one per branch, as many as this process has).
        merge: "concat" (on `axis`), "add", or None for the list of branch outputs.
        axis: The concatenation axis.

    Example:
        ```python
        devices = tfdist.devices.local_devices(2)
        branches = tfdist.tensor_parallel.ParallelBranches(
            [keras.layers.Conv2D(16, 1), keras.layers.Conv2D(16, 3, padding="same")], devices=devices)
        print(branches(x[:4]).shape)  # each branch on its device, concatenated: (4, 8, 8, 32)
        ```
    """

    def __init__(self, branches, devices=None, merge: str | None = "concat", axis: int = -1,
                 **kwargs):
        super().__init__(**kwargs)
        self.branches = list(branches)
        if not self.branches or not all(isinstance(b, keras.layers.Layer)
                                        for b in self.branches):
            raise ValueError(f"branches must be a non-empty list of Keras layers, got "
                             f"{branches!r}.")
        if merge not in _MERGES:
            raise ValueError(f"merge={merge!r} is not one of {_MERGES}.")
        available = len(tf.config.list_logical_devices("GPU")
                        or tf.config.list_logical_devices("CPU"))
        self.devices = chosen_devices(devices, min(len(self.branches), available),
                                      type(self).__name__)
        self.merge = merge
        self.axis = axis
        self.supports_jit = False

    def device_of(self, index: int) -> str:
        return self.devices[index % len(self.devices)]

    def build(self, input_shape):
        for i, branch in enumerate(self.branches):
            if not branch.built:
                with tf.device(self.device_of(i)):
                    branch.build(input_shape)

    def call(self, inputs, training=None):
        outs = []
        for i, branch in enumerate(self.branches):
            def run(x, branch=branch):
                return branch(x, training=training)
            outs.append(on_device(self.device_of(i), run, inputs))
        if self.merge is None:
            return outs
        with tf.device(self.devices[0]):
            return tf.concat(outs, axis=self.axis) if self.merge == "concat" else tf.add_n(outs)

    def compute_output_shape(self, input_shape):
        shapes = [tuple(b.compute_output_shape(input_shape)) for b in self.branches]
        if self.merge is None:
            return shapes
        if self.merge == "add":
            return shapes[0]
        axis = self.axis % len(shapes[0])
        total = sum(s[axis] for s in shapes) if all(s[axis] for s in shapes) else None
        return (*shapes[0][:axis], total, *shapes[0][axis + 1:])

    def load_from(self, layers) -> None:
        """Takes the weights of unplaced branches, one layer per branch, in order (for example
        `[model.get_layer(name) for name in ...]` of a functional model)."""
        layers = list(layers)
        if len(layers) != len(self.branches):
            raise ValueError(f"load_from got {len(layers)} layers for {len(self.branches)} "
                             "branches: give one per branch, in order.")
        for branch, layer in zip(self.branches, layers):
            branch.set_weights(layer.get_weights())

    def get_config(self):
        return {**super().get_config(),
                "branches": [keras.saving.serialize_keras_object(b) for b in self.branches],
                "devices": list(self.devices), "merge": self.merge, "axis": self.axis}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["branches"] = [keras.saving.deserialize_keras_object(b)
                              for b in config["branches"]]
        return cls(**config)
