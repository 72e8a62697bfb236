"""`Pipeline`: a Keras layer that runs its stages on their own devices, micro-batch by micro-batch.

The batch is split into M equal micro-batches; stage j (a list of layers) runs on `devices[j]`.
Every task of the schedule (the forward or backward of one micro-batch on one stage, see
`schedule.py`) is built in the schedule's order, its forward and backward ops under the stage's
device, each after the previous task of its stage. In a `tf.function` (as under `model.fit`) the
stages then run concurrently wherever the data allows, which is the pipeline.

Gradients: the whole pipeline is one `tf.custom_gradient`. Its backward runs the schedule's
backward tasks, each with its own tape: stage j's backward kernels are built under `devices[j]`
(a plain `tf.device` would pin only the forward). With re-materialization a stage keeps only its
inputs from the forward and recomputes itself in the backward, restoring its non-trainable state
(random seeds, batch-norm statistics) first, so the recomputation is the forward exactly.

Used as a layer inside any model, the backward can only start once the model's loss has seen every
micro-batch, so both schedules hold M micro-batches. `PipelineModel` puts the compiled loss on
the last stage instead and runs the schedule's forwards and backwards interleaved: with
`schedule="1f1b"` stage j then holds at most min(K - j, M) micro-batches of activations.

Boundaries: one pipeline per process (combine with the Horovod engine for data parallelism across
pipelines, not with MirroredStrategy); micro-batches must divide the batch; BatchNormalization
computes its statistics per micro-batch.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfdist.devices import check_devices, default_devices
from tfdist.pipeline import schedule as schedules
from tfdist.pipeline.balance import split
from tfdist.pipeline.executor import ScheduleRun
from tfdist.pipeline.skip import Pop, Stash, route_skips
from tfdist.pipeline.stats import PipelineStats

REMAT = ("except_last", "all", "none")


@keras.saving.register_keras_serializable(package="tfdist")
class Pipeline(keras.layers.Layer):
    """Stages of layers on their own devices, run over micro-batches by a schedule.

    Args:
      stages: a list of stages, each a non-empty list of Keras layers (`Stash`/`Pop` included).
      devices: one device per stage; default: the first K logical GPUs, else CPUs.
      num_microbatches: M, the number of equal parts the batch is split into.
      schedule: "gpipe" or "1f1b" (see `tfdist.pipeline.schedule`).
      remat: re-materialize stages in the backward: "except_last" (default, as torchgpipe),
        "all" or "none" (True and False mean "all" and "none").
    """

    def __init__(self, stages, devices=None, num_microbatches: int = 1, schedule: str = "gpipe",
                 remat: str | bool = "except_last", **kwargs):
        super().__init__(**kwargs)
        stages = [list(stage) for stage in stages]
        if not stages:
            raise ValueError("Pipeline needs at least one stage.")
        for j, stage in enumerate(stages):
            if not stage:
                raise ValueError(f"Pipeline stage {j} has no layers: give every stage at least "
                                 "one layer, or remove it (and its device).")
            for layer in stage:
                if not isinstance(layer, keras.layers.Layer):
                    raise TypeError(f"Pipeline stage {j} holds {layer!r}, which is not a Keras "
                                    "layer.")
        k = len(stages)
        if devices is None:
            devices = default_devices(k)
        devices = [str(d) for d in devices]
        if len(devices) != k:
            fix = ("merge stages (tfdist.pipeline.balance_by_size can split the layers into "
                   f"{len(devices)})" if len(devices) < k else "drop the extra devices")
            raise ValueError(f"The pipeline has {k} stages but {len(devices)} devices "
                             f"({devices}): give exactly one device per stage, or {fix}.")
        if remat is True:
            remat = "all"
        elif remat is False:
            remat = "none"
        if remat not in REMAT:
            raise ValueError(f"remat={remat!r} is not one of {REMAT} (or True/False).")
        self.schedule_name = schedule
        self.table = schedules.build(schedule, num_microbatches, k)  # checks M and the name
        self.num_microbatches = num_microbatches
        self.devices = devices
        self.remat = remat
        self.routes = route_skips(stages)
        self._stage_sizes = [len(stage) for stage in stages]
        self.stage_layers = [layer for stage in stages for layer in stage]
        self.stats: PipelineStats | None = None
        self.supports_jit = False  # XLA would compile every stage onto one device

    @classmethod
    def from_sequential(cls, model: keras.Sequential, balance, **kwargs) -> Pipeline:
        """A Pipeline of a Sequential model's layers cut into stages of `balance` layers each
        (e.g. from `balance_by_size(model.layers, k)`); the layers, weights included, are
        shared with the model."""
        if not isinstance(model, keras.Sequential):
            raise TypeError(f"from_sequential takes a keras.Sequential, got {type(model).__name__}"
                            "; pass stages=[[...], ...] for other models.")
        return cls(split(model.layers, balance), **kwargs)

    # -- structure ----------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self._stage_sizes)

    @property
    def stages(self) -> list[list[keras.layers.Layer]]:
        out, start = [], 0
        for size in self._stage_sizes:
            out.append(self.stage_layers[start:start + size])
            start += size
        return out

    def rematerializes(self, j: int) -> bool:
        return self.remat == "all" or (self.remat == "except_last" and j < self.num_stages - 1)

    def _walk_symbolic(self, input_shape):
        """Calls every layer on symbolic tensors (building it under its stage's device); returns
        the output shape."""
        x = keras.KerasTensor(tuple(input_shape))
        skips = {}
        for stage, device in zip(self.stages, self.devices):
            with tf.device(device):
                for layer in stage:
                    if isinstance(layer, Stash):
                        skips[layer.skip] = x
                    elif isinstance(layer, Pop):
                        x = layer([x, skips.pop(layer.skip)])
                    else:
                        x = layer(x)
        return tuple(x.shape)

    def build(self, input_shape):
        check_devices(self.devices)
        self._walk_symbolic(input_shape)
        self.built = True

    def compute_output_shape(self, input_shape):
        return self._walk_symbolic(input_shape)

    # -- running ------------------------------------------------------------------------------
    def _split(self, x) -> list[tf.Tensor]:
        """M micro-batches: equal when M divides the batch; otherwise (a final partial batch of
        `fit`) as even as possible, the first ones one example larger, as torchgpipe chunks."""
        m = self.num_microbatches
        if m == 1:
            return [x]
        batch = x.shape[0]
        if batch is not None and batch % m == 0:
            return tf.split(x, m, axis=0)
        n = tf.shape(x)[0]
        sizes = tf.fill([m], n // m) + tf.cast(tf.range(m) < n % m, tf.int32)
        return tf.split(x, sizes, num=m, axis=0)

    def _check_context(self) -> None:
        replicas = tf.distribute.get_replica_context()  # None: cross-replica, nothing runs
        if replicas is not None and replicas.num_replicas_in_sync > 1:
            raise ValueError("A Pipeline cannot run inside a tf.distribute strategy with "
                             f"{replicas.num_replicas_in_sync} replicas: its stages place "
                             "themselves. For data parallelism across pipelines use the Horovod "
                             "engine (one pipeline per rank).")

    def call(self, inputs, training=None):
        self._check_context()
        xs = self._split(inputs)
        if not training:
            run = ScheduleRun(self, training=False, keep=False)
            return tf.concat(run.forward_all(xs), axis=0)
        return self._differentiable(inputs, xs)

    def _differentiable(self, inputs, xs):
        run = ScheduleRun(self, training=True, keep=True)
        owner = {id(v.value): v for v in self.trainable_variables}

        @tf.custom_gradient
        def pipeline(x):
            del x  # the micro-batches were split from it outside
            with tf.device(self.devices[-1]):
                y = tf.concat(run.forward_all(xs), axis=0)

            def grad(dy, variables=None):
                with tf.device(self.devices[-1]):
                    dys = self._split(dy)
                dxs, dvars = run.backward_all(dys, needs_dx=inputs.dtype.is_floating)
                dx = None
                if dxs:
                    with tf.device(self.devices[0]):
                        dx = tf.concat(dxs, axis=0)
                var_grads = [dvars.get(id(owner[id(v)])) if id(v) in owner else None
                             for v in variables or []]
                return dx, var_grads

            return y, grad

        out = pipeline(inputs)
        self.stats = run.stats()
        return out

    def forward_backward(self, x, y, loss_fn, sample_weight=None):
        """Runs the whole schedule with the loss on the last stage, forwards and backwards
        interleaved as the schedule says.

        `loss_fn(y_true, y_pred, sample_weight)` is the mean loss over one micro-batch. Returns the
        loss over the batch, the predictions and the gradients of `self.trainable_variables`."""
        self._check_context()
        if not self.built:
            self.build(tuple(x.shape))
        xs, ys = self._split(x), self._split(y)
        sws = [None] * self.num_microbatches if sample_weight is None else \
            self._split(sample_weight)
        run = ScheduleRun(self, training=True, keep=True)
        loss, preds, dvars = run.train(xs, ys, sws, loss_fn)
        self.stats = run.stats()
        grads = [dvars.get(id(v)) for v in self.trainable_variables]
        with tf.device(self.devices[-1]):
            return loss, tf.concat(preds, axis=0), grads

    # -- serialization --------------------------------------------------------------------------
    def get_config(self):
        return {
            **super().get_config(),
            "stages": [[keras.saving.serialize_keras_object(layer) for layer in stage]
                       for stage in self.stages],
            "devices": list(self.devices),
            "num_microbatches": self.num_microbatches,
            "schedule": self.schedule_name,
            "remat": self.remat,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["stages"] = [[keras.saving.deserialize_keras_object(layer) for layer in stage]
                            for stage in config["stages"]]
        return cls(**config)
