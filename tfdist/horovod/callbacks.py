"""Keras 3 callbacks for the Horovod engine.

Horovod's own Keras callbacks rely on `optimizer.lr`, `K.get_value` and variable `.ref()`, which
Keras 3 no longer has; these use only Keras 3 public API and `horovod.tensorflow` ops.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tfdist.callbacks.lr_warmup import LearningRateWarmup as _LearningRateWarmup
from tfdist.comm import HorovodEngine


def verify_same_job(callback: keras.callbacks.Callback) -> None:
    """Raises on every rank, before the first step, if the ranks' models, optimizer
    configurations (built here; a tfdist optimizer compares its parts when built) or `fit`
    calls (steps per epoch, epochs) differ: such ranks would otherwise wait for each other in
    different collectives forever."""
    engine, model = HorovodEngine(), callback.model
    engine.verify_same_model(model.variables)
    optimizer = model.optimizer
    if optimizer is not None and not optimizer.built:
        optimizer.build(model.trainable_variables)
    params = callback.params or {}
    engine.verify_same_setup({"steps per epoch": int(params.get("steps") or -1),
                              "epochs": int(params.get("epochs") or -1)})


class BroadcastGlobalVariables(keras.callbacks.Callback):
    """At the start of training, copies `root_rank`'s model and optimizer state to every rank
    (except ZeRO's shards, which are each rank's own).

    It first builds the optimizer (so its state exists and a resumed optimizer is broadcast too)
    and checks that every rank has the same model and the same `fit` (steps per epoch, epochs),
    raising a clear error on every rank if not.

    Args:
        root_rank: The rank whose state wins. Defaults to 0.
    """

    def __init__(self, root_rank: int = 0):
        super().__init__()
        self.root_rank = root_rank

    def on_train_begin(self, logs=None):
        engine = HorovodEngine()
        comm = engine.communicator()
        if not 0 <= self.root_rank < comm.world_size:
            raise ValueError(
                f"`root_rank` must be in [0, {comm.world_size}). Received: root_rank={self.root_rank}"
            )
        model = self.model
        optimizer = model.optimizer
        verify_same_job(self)
        variables = list(model.variables) + (list(optimizer.variables) if optimizer else [])
        own = {id(v) for holder in (model, optimizer)  # ZeRO: each rank's own shards stay
               for v in getattr(holder, "sharded_variables", list)()}
        variables = [v for v in variables if id(v) not in own]
        values = comm.broadcast([tf.convert_to_tensor(v) for v in variables], root=self.root_rank)
        for var, value in zip(variables, values):
            var.assign(value)


class MetricAverage(keras.callbacks.Callback):
    """Averages the epoch's logged metrics over ranks, so every rank reports the global values.

    Put it before callbacks that read the metrics (checkpointing, early stopping, TensorBoard).
    Ranks whose models, optimizer configurations or `fit` (steps per epoch, epochs) differ are
    refused at the start (else a rank would wait here for ranks still training).
    """

    def on_train_begin(self, logs=None):
        verify_same_job(self)

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        comm = HorovodEngine().communicator()
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        local = tf.constant([float(logs[k]) for k in keys], dtype=tf.float64)
        (mean,) = comm.all_reduce([local], op="mean")
        for k, v in zip(keys, mean.numpy()):
            logs[k] = float(v)


class LearningRateWarmup(_LearningRateWarmup):
    """Gradual warm-up to the linearly scaled learning rate (Goyal et al. 2017) over Horovod ranks.

    Same as `tfdist.callbacks.LearningRateWarmup` with `scale` defaulting to the number of ranks.
    """

    def _default_scale(self) -> float:
        return float(HorovodEngine().world_size)
