"""`PipelineModel`: a model that is one `Pipeline`, with the loss on the last stage."""

from __future__ import annotations

import keras
import tensorflow as tf

from tfdist.devices import place_slots
from tfdist.pipeline.cluster import naming_lost_workers
from tfdist.pipeline.layer import Pipeline


@keras.saving.register_keras_serializable(package="tfdist")
class PipelineModel(keras.Model):
    """A model that is one `Pipeline`, trained with the loss on the last stage.

    `fit` runs the pipeline's schedule with forwards and backwards interleaved (so "1f1b" bounds
    the activations each stage keeps by the number of stages), takes the compiled loss per
    micro-batch (their mean is the batch's mean loss) and applies the summed gradients once per
    batch. With one row of devices per replica (`Pipeline(devices=[row0, row1, ...])`) each
    replica runs its share of the batch and every copy of a variable gets the summed gradients:
    data parallelism across pipelines, equal to a MirroredStrategy over the replicas.

    Give `input_shape` (without the batch axis) to build it at once, as callbacks that read the
    variables when training begins need (e.g. Horovod's broadcast); otherwise it is built by the
    first step. `compile` places the optimizer's slots on their variables' devices. `predict`
    and `evaluate` run the pipeline forward; with stages on other hosts, a host lost during
    `fit`, `evaluate` or `predict` is named in the error. Layer losses (`add_loss`) are not supported here.

    Example:
        ```python
        stages = [[keras.layers.Flatten(), keras.layers.Dense(128, activation="relu")],
                  [keras.layers.Dense(10)]]
        model = tfdist.pipeline.PipelineModel(
            tfdist.pipeline.Pipeline(stages, devices=tfdist.devices.local_devices(2),
                                     num_microbatches=4, schedule="1f1b"), input_shape=(8, 8, 1))
        model.compile(keras.optimizers.Adam(),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=64, epochs=1)
        print(model.pipeline.stats)  # micro-batches and bytes kept per stage (a PipelineStats)
        ```
    """

    def __init__(self, pipeline: Pipeline, input_shape=None, **kwargs):
        super().__init__(**kwargs)
        if not isinstance(pipeline, Pipeline):
            raise TypeError(f"PipelineModel wraps a tfdist.pipeline.Pipeline, got {pipeline!r}.")
        self.pipeline = pipeline
        self.loss_mean = keras.metrics.Mean(name="loss")
        self.input_shape_ = None if input_shape is None else tuple(input_shape)
        if self.input_shape_ is not None:  # built now, so callbacks see every variable
            self.build((None, *self.input_shape_))

    def build(self, input_shape):
        if not self.pipeline.built:
            self.pipeline.build(input_shape)
        self.built = True

    def call(self, inputs, training=None):
        return self.pipeline(inputs, training=training)

    def compile(self, optimizer="rmsprop", *args, **kwargs):
        optimizer = keras.optimizers.get(optimizer)
        super().compile(place_slots(optimizer), *args, **kwargs)

    def compile_from_config(self, config):
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.built:
            self.optimizer.build(self.trainable_variables)

    def fit(self, *args, **kwargs):
        with naming_lost_workers():
            return super().fit(*args, **kwargs)

    def evaluate(self, *args, **kwargs):
        with naming_lost_workers():
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        with naming_lost_workers():
            return super().predict(*args, **kwargs)

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if not self.built:  # without a strategy Keras builds while tracing the first step
            self.build(tuple(x.shape))

        def loss_fn(y_true, y_pred, weight):
            return self.compute_loss(x=None, y=y_true, y_pred=y_pred, sample_weight=weight,
                                     training=True)

        loss, y_pred, grads = self.pipeline.forward_backward(x, y, loss_fn, sample_weight)
        self.optimizer.apply_gradients(zip(grads, self.pipeline.trainable_variables))
        self.loss_mean.update_state(loss, sample_weight=tf.shape(x)[0])
        metrics = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return {**metrics, "loss": self.loss_mean.result()}

    def get_config(self):
        return {**super().get_config(), "input_shape": self.input_shape_,
                "pipeline": keras.saving.serialize_keras_object(self.pipeline)}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["pipeline"] = keras.saving.deserialize_keras_object(config["pipeline"])
        return cls(**config)
