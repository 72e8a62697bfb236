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

import contextlib
from dataclasses import dataclass, field

import keras
import tensorflow as tf

from tfdist.pipeline import schedule as schedules
from tfdist.pipeline.skip import Pop, Stash, route_skips

__all__ = ["Pipeline", "PipelineModel", "PipelineStats", "place_slots", "default_devices"]

REMAT = ("except_last", "all", "none")


def default_devices(count: int) -> list[str]:
    """The first `count` logical GPUs, or logical CPUs when there are no GPUs."""
    devices = tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")
    if count > len(devices):
        raise ValueError(f"The pipeline has {count} stages but this process has {len(devices)} "
                         f"devices ({', '.join(d.name for d in devices)}): give at most "
                         f"{len(devices)} stages, or create logical devices "
                         "(tf.config.set_logical_device_configuration) before TensorFlow starts.")
    return [d.name for d in devices[:count]]


def _check_devices(devices: list[str]) -> None:
    known = {tf.DeviceSpec.from_string(d.name).to_string() for d in tf.config.list_logical_devices()}
    for device in devices:
        spec = tf.DeviceSpec.from_string(device)
        full = tf.DeviceSpec(job="localhost", replica=0, task=0).make_merged_spec(spec).to_string()
        if full not in known and spec.to_string() not in known:
            raise ValueError(f"Pipeline device {device!r} does not exist in this process; its "
                             f"devices are: {', '.join(sorted(known))}.")


def place_slots(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    """Makes `optimizer` create each slot (momentum, Adam m/v, ...) on its variable's device.

    Outside a strategy Keras creates every slot on the default device; a pipelined model needs
    them next to their stage. Call before the optimizer is built (before `fit`); returns it.
    `PipelineModel.compile` does this itself."""
    if getattr(optimizer, "_tfdist_places_slots", False):
        return optimizer
    create = optimizer.add_variable_from_reference

    def add_variable_from_reference(reference_variable, name=None, initializer="zeros"):
        device = getattr(reference_variable, "value", reference_variable).device
        with tf.device(device):
            return create(reference_variable, name=name, initializer=initializer)

    optimizer.add_variable_from_reference = add_variable_from_reference
    optimizer._tfdist_places_slots = True
    return optimizer


@dataclass
class PipelineStats:
    """What the last built run of the schedule kept for the backward, per stage.

    `peak_microbatches[j]`: the most micro-batches whose forward ran on stage j and whose backward
    had not; `peak_bytes[j]`: the most bytes of tensors stage j kept for them at once (its inputs
    with re-materialization; also every layer's output without), None where shapes are dynamic."""

    schedule: str
    num_microbatches: int
    peak_microbatches: list[int] = field(default_factory=list)
    peak_bytes: list[int | None] = field(default_factory=list)


def _nbytes(tensors) -> int | None:
    total = 0
    for t in tensors:
        if not t.shape.is_fully_defined():
            return None
        total += t.shape.num_elements() * t.dtype.size
    return total


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
        from tfdist.pipeline.balance import split

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
        _check_devices(self.devices)
        self._walk_symbolic(input_shape)
        self.built = True

    def compute_output_shape(self, input_shape):
        return self._walk_symbolic(input_shape)

    # -- running ------------------------------------------------------------------------------
    def _split(self, x) -> list[tf.Tensor]:
        m = self.num_microbatches
        batch = x.shape[0]
        if batch is not None and batch % m:
            raise ValueError(f"Batch size {batch} is not divisible by num_microbatches={m}: use a "
                             f"batch size that is a multiple of {m} (with drop_remainder=True in "
                             "tf.data) or another num_microbatches.")
        if batch is None:
            tf.debugging.assert_equal(
                tf.shape(x)[0] % m, 0,
                message=f"Pipeline: the batch size is not divisible by num_microbatches={m}; "
                        f"use batches that are a multiple of {m} (drop_remainder=True).")
        return tf.split(x, m, axis=0) if m > 1 else [x]

    def _check_context(self) -> None:
        if tf.distribute.has_strategy() and tf.distribute.get_strategy().num_replicas_in_sync > 1:
            raise ValueError("A Pipeline cannot run inside a tf.distribute strategy with "
                             f"{tf.distribute.get_strategy().num_replicas_in_sync} replicas: its "
                             "stages place themselves. For data parallelism across pipelines use "
                             "the Horovod engine (one pipeline per rank).")

    def call(self, inputs, training=None):
        self._check_context()
        xs = self._split(inputs)
        if not training:
            run = _Run(self, training=False, keep=False)
            return tf.concat(run.forward_all(xs), axis=0)
        return self._differentiable(inputs, xs)

    def _differentiable(self, inputs, xs):
        run = _Run(self, training=True, keep=True)
        owner = {id(v.value): v for v in self.trainable_variables}

        @tf.custom_gradient
        def pipeline(x):
            del x  # the micro-batches were split from it outside
            with tf.device(self.devices[-1]):
                y = tf.concat(run.forward_all(xs), axis=0)

            def grad(dy, variables=None):
                with tf.device(self.devices[-1]):
                    dys = tf.split(dy, self.num_microbatches, axis=0)
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
        xs = self._split(x)
        ys = tf.split(y, self.num_microbatches, axis=0) if self.num_microbatches > 1 else [y]
        sws = [None] * self.num_microbatches
        if sample_weight is not None:
            sws = (tf.split(sample_weight, self.num_microbatches, axis=0)
                   if self.num_microbatches > 1 else [sample_weight])
        run = _Run(self, training=True, keep=True)
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


@dataclass
class _Saved:
    """What one forward task keeps for its backward."""

    x: tf.Tensor
    skips_in: dict
    tape: tf.GradientTape | None = None
    y: tf.Tensor | None = None
    skips_out: dict | None = None
    state: list | None = None
    nbytes: int | None = 0


class _Run:
    """One pass of the schedule: the tensors the tasks hand each other and keep."""

    def __init__(self, pipe: Pipeline, training: bool, keep: bool):
        self.pipe, self.training, self.keep = pipe, training, keep
        k = pipe.num_stages
        self.acts: dict = {}  # (micro, stage) -> stage output, until the next stage takes it
        self.skips: dict = {}  # (micro, name) -> stashed tensor, until its Pop's stage takes it
        self.saved: dict = {}  # (micro, stage) -> _Saved
        self.grads: dict = {}  # (micro, stage) -> gradient of the stage's output
        self.skip_grads: dict = {}  # (micro, name) -> gradient of a stashed tensor
        self.var_grads: dict = {}  # id(variable) -> list of per-micro-batch gradients
        self.last: list = [None] * k  # the last tensor each stage produced (orders its tasks)
        self.live, self.live_bytes = [0] * k, [0] * k
        self.peak, self.peak_bytes = [0] * k, [0] * k
        self.bytes_known = True
        self.xs: list = []
        self.input_grads: dict = {}
        self.stage_vars = [[v for layer in stage for v in layer.trainable_variables]
                           for stage in pipe.stages]
        self.stage_state = [[v for layer in stage for v in layer.variables if not v.trainable]
                            for stage in pipe.stages]

    @contextlib.contextmanager
    def _task(self, j: int, tag: str):
        after = [self.last[j]] if self.last[j] is not None else []
        with tf.device(self.pipe.devices[j]), tf.name_scope(f"stage{j}"), \
                tf.name_scope(tag), tf.control_dependencies(after):
            yield

    def _run_stage(self, j, x, skips_in, collect=None):
        local = dict(skips_in)
        for layer in self.pipe.stages[j]:
            if isinstance(layer, Stash):
                local[layer.skip] = x
                continue
            if isinstance(layer, Pop):
                x = layer([x, local.pop(layer.skip)])
            else:
                x = layer(x, training=self.training)
            if collect is not None:
                collect.append(x)
        return x, {name: local[name] for name in self.pipe.routes.outgoing[j]}

    def _taped_stage(self, j, x, skips_in, collect=None):
        """Stage j on (x, skips_in) under a tape that also watches its floating inputs."""
        tape = tf.GradientTape()
        with tape:
            tape.watch([t for t in (x, *skips_in.values()) if t.dtype.is_floating])
            y, skips_out = self._run_stage(j, x, skips_in, collect=collect)
        return tape, y, skips_out

    # -- tasks --------------------------------------------------------------------------------
    def forward(self, i: int, j: int):
        x = self.xs[i] if j == 0 else self.acts.pop((i, j - 1))
        skips_in = {name: self.skips.pop((i, name)) for name in self.pipe.routes.incoming[j]}
        with self._task(j, f"F{i}"):
            if not self.keep:
                y, skips_out = self._run_stage(j, x, skips_in)
            elif self.pipe.rematerializes(j):
                state = [tf.identity(v.value) for v in self.stage_state[j]]
                y, skips_out = self._run_stage(j, x, skips_in)
                saved = _Saved(x, skips_in, state=state)
                saved.nbytes = _nbytes([x, *skips_in.values()])
            else:
                activations: list = []
                tape, y, skips_out = self._taped_stage(j, x, skips_in, collect=activations)
                saved = _Saved(x, skips_in, tape=tape, y=y, skips_out=skips_out)
                saved.nbytes = _nbytes([x, *skips_in.values(), *activations])
            self.last[j] = y
        if self.keep:
            self.saved[(i, j)] = saved
            self._account(j, +1, saved.nbytes)
        for name, tensor in skips_out.items():
            self.skips[(i, name)] = tensor
        return y

    def backward(self, i: int, j: int, needs_dx: bool):
        saved = self.saved.pop((i, j))
        dy = self.grads.pop((i, j))
        names_out = self.pipe.routes.outgoing[j]
        with self._task(j, f"B{i}"):
            if saved.tape is None:  # re-materialize: the forward again, with its own state
                after = [tf.identity(v.value) for v in self.stage_state[j]]
                for v, value in zip(self.stage_state[j], saved.state or []):
                    v.assign(value)
                tape, y, skips_out = self._taped_stage(j, saved.x, saved.skips_in)
                for v, value in zip(self.stage_state[j], after):
                    v.assign(value)
            else:
                tape, y, skips_out = saved.tape, saved.y, saved.skips_out
            inputs = list(saved.skips_in.values())
            if needs_dx or j > 0:
                inputs = [saved.x, *inputs]
            sources = inputs + self.stage_vars[j]
            targets = [y] + [skips_out[name] for name in names_out]
            upstream = [dy] + [self.skip_grads.pop((i, name)) for name in names_out]
            grads = tape.gradient(targets, sources, output_gradients=upstream,
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
            self.last[j] = grads[0] if grads else y
        self._account(j, -1, -saved.nbytes if saved.nbytes is not None else None)
        input_grads, var_grads = grads[:len(inputs)], grads[len(inputs):]
        if needs_dx or j > 0:
            dx, input_grads = input_grads[0], input_grads[1:]
            if j > 0:
                self.grads[(i, j - 1)] = dx
            else:
                self.input_grads[i] = dx
        for name, g in zip(self.pipe.routes.incoming[j], input_grads):
            self.skip_grads[(i, name)] = g
        for v, g in zip(self.stage_vars[j], var_grads):
            self.var_grads.setdefault(id(v), []).append(g)

    def _account(self, j: int, delta: int, nbytes: int | None) -> None:
        self.live[j] += delta
        self.peak[j] = max(self.peak[j], self.live[j])
        if nbytes is None:
            self.bytes_known = False
            return
        self.live_bytes[j] += nbytes
        self.peak_bytes[j] = max(self.peak_bytes[j], self.live_bytes[j])

    # -- whole passes -------------------------------------------------------------------------
    def forward_all(self, xs):
        self.xs = xs
        k = self.pipe.num_stages
        outputs = {}
        for tick in self.pipe.table:
            for task in tick:
                if task.kind == "F":
                    y = self.forward(task.micro, task.stage)
                    if task.stage == k - 1:
                        outputs[task.micro] = y
                    else:
                        self.acts[(task.micro, task.stage)] = y
        return [outputs[i] for i in range(len(xs))]

    def _summed_var_grads(self) -> dict:
        out = {}
        for j, variables in enumerate(self.stage_vars):
            with tf.device(self.pipe.devices[j]):
                for v in variables:
                    parts = self.var_grads.get(id(v))
                    if parts:
                        out[id(v)] = parts[0] if len(parts) == 1 else tf.add_n(parts)
        return out

    def backward_all(self, dys, needs_dx: bool):
        k = self.pipe.num_stages
        for i, dy in enumerate(dys):
            self.grads[(i, k - 1)] = dy
        for tick in self.pipe.table:
            for task in tick:
                if task.kind == "B":
                    self.backward(task.micro, task.stage, needs_dx)
        dxs = [self.input_grads[i] for i in range(len(dys))] if needs_dx else []
        return dxs, self._summed_var_grads()

    def train(self, xs, ys, sample_weights, loss_fn):
        self.xs = xs
        k, m = self.pipe.num_stages, len(xs)
        losses, preds = [], {}
        for tick in self.pipe.table:
            for task in tick:
                i, j = task.micro, task.stage
                if task.kind == "B":
                    self.backward(i, j, needs_dx=False)
                    continue
                y = self.forward(i, j)
                if j < k - 1:
                    self.acts[(i, j)] = y
                    continue
                preds[i] = y
                with self._task(j, f"L{i}"), tf.GradientTape() as tape:
                    tape.watch(y)
                    loss = loss_fn(ys[i], y, sample_weights[i]) / m
                self.grads[(i, j)] = tape.gradient(loss, y)
                losses.append(loss)
        with tf.device(self.pipe.devices[-1]):
            total = tf.add_n(losses)
        return total, [preds[i] for i in range(m)], self._summed_var_grads()

    def stats(self) -> PipelineStats:
        return PipelineStats(self.pipe.schedule_name, self.pipe.num_microbatches,
                             list(self.peak),
                             list(self.peak_bytes) if self.bytes_known else
                             [None] * self.pipe.num_stages)


@keras.saving.register_keras_serializable(package="tfdist")
class PipelineModel(keras.Model):
    """A model that is one `Pipeline`, trained with the loss on the last stage.

    `fit` runs the pipeline's schedule with forwards and backwards interleaved (so "1f1b" bounds
    the activations each stage keeps by the number of stages), takes the compiled loss per
    micro-batch (their mean is the batch's mean loss) and applies the summed gradients once per
    batch. Give `input_shape` (without the batch axis) to build it at once, as callbacks that
    read the variables when training begins need (e.g. Horovod's broadcast); otherwise it is built
    by the first step. `compile` places the optimizer's slots on their variables' devices. `predict` and
    `evaluate` run the pipeline forward. Layer losses (`add_loss`) are not supported here."""

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
