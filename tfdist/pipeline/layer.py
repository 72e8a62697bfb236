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

Data parallelism across pipelines: give `devices` one row of K devices per replica. Replica r
runs its own copy of the layers (replica 0's weights copied at build) on its share of the batch;
each copy of a variable gets the sum of every replica's gradient, added on that copy's device, so
the copies stay equal and training equals data parallelism over the unsplit model. Non-trainable
state (batch-norm statistics) is each replica's own. Rows may sit on other hosts
(`cluster_devices`). Or combine with the Horovod engine (one pipeline per rank); not with a
MirroredStrategy. Micro-batches must divide the batch; BatchNormalization computes its statistics
per micro-batch.
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
      devices: one device per stage, or one such row per data-parallel replica (devices of
        this process, or of other TF_CONFIG workers: `tfdist.pipeline.cluster_devices`);
        default: the first K logical GPUs, else CPUs.
      num_microbatches: M, the number of equal parts the batch is split into.
      schedule: "gpipe" or "1f1b" (see `tfdist.pipeline.schedule`).
      remat: re-materialize stages in the backward: "except_last" (default, as torchgpipe),
        "all" or "none" (True and False mean "all" and "none").

    Example:
        ```python
        stages = [[keras.layers.Flatten(), keras.layers.Dense(128, activation="relu")],
                  [keras.layers.Dense(10)]]
        pipe = tfdist.pipeline.Pipeline(stages, devices=tfdist.devices.local_devices(2),
                                        num_microbatches=4, schedule="gpipe")
        model = keras.Sequential([keras.Input((8, 8, 1)), pipe])  # a layer in any model
        model.compile(tfdist.devices.place_slots(keras.optimizers.Adam()),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=64, epochs=1)
        ```
    """

    def __init__(self, stages, devices=None, num_microbatches: int = 1, schedule: str = "gpipe",
                 remat: str | bool = "except_last", **kwargs):
        super().__init__(**kwargs)
        if not isinstance(stages, (list, tuple)) or not all(
                isinstance(stage, (list, tuple)) for stage in stages):
            raise TypeError(f"Pipeline(stages={stages!r}): give a list of stages, each a list of "
                            "Keras layers, e.g. Pipeline([[Dense(64)], [Dense(10)]]).")
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
        grid = _device_grid(devices, k)
        if remat is True:
            remat = "all"
        elif remat is False:
            remat = "none"
        if remat not in REMAT:
            raise ValueError(f"remat={remat!r} is not one of {REMAT} (or True/False).")
        self.schedule_name = schedule
        self.table = schedules.build(schedule, num_microbatches, k)  # checks M and the name
        self.num_microbatches = num_microbatches
        self.device_grid = grid  # one row of stage devices per data-parallel replica
        self.devices = grid[0] if len(grid) == 1 else grid  # as given, for the config
        self.remat = remat
        self.routes = route_skips(stages)
        self._stage_sizes = [len(stage) for stage in stages]
        self.stage_layers = [layer for stage in stages for layer in stage]
        # Replicas 1..R-1 run their own copies of the layers (equal weights from build on).
        self.replica_layers = [_copy_layer(layer, r) for r in range(1, len(grid))
                               for layer in self.stage_layers]
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
    def num_replicas(self) -> int:
        return len(self.device_grid)

    @property
    def stages(self) -> list[list[keras.layers.Layer]]:
        return self.replica_stages(0)

    def replica_stages(self, replica: int) -> list[list[keras.layers.Layer]]:
        """The stages of data-parallel replica `replica` (0: the layers given)."""
        n = len(self.stage_layers)
        layers = self.stage_layers if replica == 0 else \
            self.replica_layers[(replica - 1) * n:replica * n]
        out, start = [], 0
        for size in self._stage_sizes:
            out.append(layers[start:start + size])
            start += size
        return out

    def rematerializes(self, j: int) -> bool:
        return self.remat == "all" or (self.remat == "except_last" and j < self.num_stages - 1)

    def _walk_symbolic(self, input_shape, replica: int = 0):
        """Calls every layer of a replica on symbolic tensors (building it under its stage's
        device); returns the output shape."""
        x = keras.KerasTensor(tuple(input_shape))
        skips = {}
        for stage, device in zip(self.replica_stages(replica), self.device_grid[replica]):
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
        check_devices([d for row in self.device_grid for d in row])
        for r in range(self.num_replicas):
            self._walk_symbolic(input_shape, r)
        for r in range(1, self.num_replicas):  # every replica starts from replica 0's weights
            for layer, copy in zip(self.stage_layers, sum(self.replica_stages(r), [])):
                copy.set_weights(layer.get_weights())
        self.built = True

    def compute_output_shape(self, input_shape):
        return self._walk_symbolic(input_shape)

    # -- running ------------------------------------------------------------------------------
    def _split(self, x, parts: int | None = None) -> list[tf.Tensor]:
        """`parts` (default M) pieces along the batch: equal when they divide it; otherwise (a
        final partial batch of `fit`) as even as possible, the first ones one example larger, as
        torchgpipe chunks."""
        m = self.num_microbatches if parts is None else parts
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
                             "themselves. For data parallelism across pipelines give `devices` "
                             "one row per replica, or use the Horovod engine (one pipeline per "
                             "rank).")

    def _runs(self, training: bool, keep: bool) -> list[ScheduleRun]:
        return [ScheduleRun(self, training=training, keep=keep, replica=r)
                for r in range(self.num_replicas)]

    def _sum_over_replicas(self, runs: list[ScheduleRun], dvars: list[dict]) -> dict:
        """The all-reduce of data parallelism: each replica's copy of a variable gets the sum of
        every replica's gradient for it, added on that copy's device (the same order on every
        device, so the copies stay equal)."""
        if len(runs) == 1:
            return dvars[0]
        out = {}
        for j in range(self.num_stages):
            for copies in zip(*(run.stage_vars[j] for run in runs)):
                parts = [d.get(id(v)) for d, v in zip(dvars, copies)]
                if any(p is None for p in parts):
                    continue
                for r, v in enumerate(copies):
                    with tf.device(self.device_grid[r][j]):
                        out[id(v)] = tf.add_n(parts)
        return out

    def call(self, inputs, training=None):
        self._check_context()
        parts = self._split(inputs, self.num_replicas)
        if not training:
            outs = []
            for run, part in zip(self._runs(training=False, keep=False), parts):
                outs.append(tf.concat(run.forward_all(self._split(part)), axis=0))
            return outs[0] if len(outs) == 1 else tf.concat(outs, axis=0)
        return self._differentiable(inputs, parts)

    def _differentiable(self, inputs, parts):
        runs = self._runs(training=True, keep=True)
        owner = {id(v.value): v for v in self.trainable_variables}
        xs = [self._split(part) for part in parts]

        @tf.custom_gradient
        def pipeline(x):
            del x  # the micro-batches were split from it outside
            ys = []
            for r, run in enumerate(runs):
                with tf.device(self.device_grid[r][-1]):
                    ys.append(tf.concat(run.forward_all(xs[r]), axis=0))
            y = ys[0] if len(ys) == 1 else tf.concat(ys, axis=0)

            def grad(dy, variables=None):
                dxs, dvars = [], []
                for r, (run, dy_r) in enumerate(zip(runs, self._split(dy, len(runs)))):
                    with tf.device(self.device_grid[r][-1]):
                        dys = self._split(dy_r)
                    dxs_r, dvars_r = run.backward_all(dys, needs_dx=inputs.dtype.is_floating)
                    if dxs_r:
                        with tf.device(self.device_grid[r][0]):
                            dxs.append(tf.concat(dxs_r, axis=0))
                    dvars.append(dvars_r)
                summed = self._sum_over_replicas(runs, dvars)
                dx = None
                if dxs:
                    dx = dxs[0] if len(dxs) == 1 else tf.concat(dxs, axis=0)
                var_grads = [summed.get(id(owner[id(v)])) if id(v) in owner else None
                             for v in variables or []]
                return dx, var_grads

            return y, grad

        out = pipeline(inputs)
        self.stats = runs[0].stats()
        return out

    def forward_backward(self, x, y, loss_fn, sample_weight=None):
        """Runs the whole schedule with the loss on the last stage, forwards and backwards
        interleaved as the schedule says; with several replicas each runs its share of the
        batch and the gradients are summed over replicas (each copy of a variable gets them).

        `loss_fn(y_true, y_pred, sample_weight)` is the mean loss over one micro-batch. Returns the
        loss over the batch, the predictions and the gradients of `self.trainable_variables`."""
        self._check_context()
        if not self.built:
            self.build(tuple(x.shape))
        r_count = self.num_replicas
        xs, ys = self._split(x, r_count), self._split(y, r_count)
        sws = [None] * r_count if sample_weight is None else self._split(sample_weight, r_count)
        runs = self._runs(training=True, keep=True)
        losses, preds, dvars = [], [], []
        for r, run in enumerate(runs):
            scale = None  # one replica: its loss is the batch's
            if r_count > 1:  # each replica's share of the batch: 1/R when they are equal
                batch, n = tf.shape(y)[0], tf.shape(ys[r])[0]
                scale = (1 / r_count if y.shape[0] is not None and y.shape[0] % r_count == 0
                         else tf.cast(n, tf.float32) / tf.cast(tf.maximum(batch, 1), tf.float32))
            mb = self._split(sws[r]) if sws[r] is not None else [None] * self.num_microbatches
            loss, pred, grads = run.train(self._split(xs[r]), self._split(ys[r]), mb, loss_fn,
                                          scale=scale)
            losses.append(loss)
            with tf.device(self.device_grid[r][-1]):
                preds.append(tf.concat(pred, axis=0))
            dvars.append(grads)
        self.stats = runs[0].stats()
        summed = self._sum_over_replicas(runs, dvars)
        grads = [summed.get(id(v)) for v in self.trainable_variables]
        with tf.device(self.device_grid[0][-1]):
            if r_count == 1:
                return losses[0], preds[0], grads
            return tf.add_n(losses), tf.concat(preds, axis=0), grads

    # -- serialization --------------------------------------------------------------------------
    def get_config(self):
        return {
            **super().get_config(),
            "stages": [[keras.saving.serialize_keras_object(layer) for layer in stage]
                       for stage in self.stages],
            "devices": [list(row) for row in self.device_grid] if self.num_replicas > 1
            else list(self.devices),
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


def _device_grid(devices, k: int) -> list[list[str]]:
    """`devices` as rows of K stage devices: one row (a list of devices) or one row per
    data-parallel replica (a list of lists)."""
    devices = list(devices)
    rows = [list(devices)] if not devices or isinstance(devices[0], str | tf.DeviceSpec) \
        else [list(row) for row in devices]
    grid = [[str(d) for d in row] for row in rows]
    for r, row in enumerate(grid):
        if len(row) != k:
            where = f" (replica {r})" if len(grid) > 1 else ""
            fix = ("merge stages (tfdist.pipeline.balance_by_size can split the layers into "
                   f"{len(row)})" if len(row) < k else "drop the extra devices")
            raise ValueError(f"The pipeline has {k} stages but {len(row)} devices{where} "
                             f"({row}): give exactly one device per stage, or {fix}.")
    return grid


def _copy_layer(layer: keras.layers.Layer, replica: int) -> keras.layers.Layer:
    """An unbuilt layer of the same configuration, for another data-parallel replica."""
    config = layer.get_config()
    config["name"] = f"{layer.name}_replica{replica}"
    try:
        return layer.__class__.from_config(config)
    except Exception as error:
        raise ValueError(f"Layer {layer.name!r} ({type(layer).__name__}) cannot be copied for "
                         f"pipeline replica {replica} from its get_config ({error}); give it a "
                         "get_config/from_config pair, or use one replica.") from error
