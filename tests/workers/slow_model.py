"""A model for `tfdist train` whose steps take a while (a sleep inside the step, the identity on
the values), so a test can kill a job mid-training at a step of its choosing."""

from __future__ import annotations

import time

import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="tfdist_tests")
class Pause(keras.layers.Layer):
    def __init__(self, seconds: float = 0.03, **kwargs):
        super().__init__(**kwargs)
        self.seconds = seconds

    def call(self, x):
        def pause():
            time.sleep(self.seconds)
            return tf.constant(0.0)

        return x + tf.ensure_shape(tf.py_function(pause, [], tf.float32), [])

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "seconds": self.seconds}


def build(input_shape, num_classes, width=32, pause=0.03):
    inputs = keras.Input(input_shape)
    h = keras.layers.Flatten()(Pause(pause)(inputs))
    h = keras.layers.Dense(width, activation="relu")(h)
    return keras.Model(inputs, keras.layers.Dense(num_classes, activation="softmax")(h))
