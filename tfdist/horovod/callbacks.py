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
from tfdist.comm.horovod import import_horovod


def built(model: keras.Model) -> bool:
    """Whether the model has its variables (a `Sequential` without an `Input`, or a subclassed
    model, gets them at its first step)."""
    return bool(model.built and model.variables)


def built_like_the_others(model: keras.Model) -> bool:
    """Whether every rank's model has its variables, after building this rank's if another
    rank's is built (a rank that has just joined an elastic job holds a lazily built model
    that the others built at their first step). False: no rank's model is built yet (it will be
    at the first step, on every rank). A collective: every rank calls it at the same point."""
    mine = (built(model), model.get_build_config() if built(model) else None)
    ranks = import_horovod().allgather_object(mine)
    if not any(is_built for is_built, _ in ranks):
        return False
    if not mine[0]:
        config = next((c for is_built, c in ranks if is_built and c), None)
        if config is None:
            raise ValueError("this rank's model is not built and the other ranks' models have no "
                             "build configuration to build it from: give the model an "
                             "`keras.Input` (or build it) before `fit`.")
        model.build_from_config(config)
    return True


def build_or_verify_optimizer(model: keras.Model) -> None:
    """Builds the model's optimizer (a tfdist optimizer's build compares the ranks' optimizer
    configurations), or, already built, compares them again: a rank that has just joined an
    elastic job builds while the others verify, and their collectives pair up."""
    optimizer = model.optimizer
    if optimizer is None:
        return
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    elif getattr(optimizer, "verify_model", False) and hasattr(optimizer, "verify_workers"):
        optimizer.verify_workers(model.trainable_variables)


def broadcast_variables(variables: list, root_rank: int = 0) -> None:
    """Every rank's `variables` take `root_rank`'s values: eager broadcasts paired by their
    order (Horovod's own `broadcast_variables` names its ops after the variables, and a rank
    that has just built its optimizer names the slots differently: measured, "sgd/..._momentum"
    there and "distributed_optimizer/sgd/..." where the first step built them, so the ranks
    would wait for each other forever)."""
    comm = HorovodEngine().communicator()
    values = comm.broadcast([tf.convert_to_tensor(v) for v in variables], root=root_rank)
    for variable, value in zip(variables, values, strict=True):
        variable.assign(value)


def verify_same_job(callback: keras.callbacks.Callback) -> None:
    """Raises on every rank, before the first step, if the ranks' models, optimizer
    configurations (built here; a tfdist optimizer compares its parts when built) or `fit`
    calls (steps per epoch, epochs) differ: such ranks would otherwise wait for each other in
    different collectives forever. A model built lazily is checked after its first step."""
    engine, model = HorovodEngine(), callback.model
    engine.verify_same_model(model.variables)
    build_or_verify_optimizer(model)
    params = callback.params or {}
    engine.verify_same_setup({"steps per epoch": int(params.get("steps") or -1),
                              "epochs": int(params.get("epochs") or -1)})


class BroadcastGlobalVariables(keras.callbacks.Callback):
    """At the start of training, copies `root_rank`'s model and optimizer state to every rank
    (except ZeRO's shards, which are each rank's own).

    It first builds the optimizer (so its state exists and a resumed optimizer is broadcast too)
    and checks that every rank has the same model and the same `fit` (steps per epoch, epochs),
    raising a clear error on every rank if not. A model that is built at its first step (a
    `Sequential` without an `Input`) is broadcast after that step, as Horovod's callback does.

    Args:
        root_rank: The rank whose state wins. Defaults to 0.
    """

    def __init__(self, root_rank: int = 0):
        super().__init__()
        self.root_rank = root_rank
        self._done = False

    def on_train_begin(self, logs=None):
        self._done = False
        if built_like_the_others(self.model):
            self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if not self._done:  # a model built at its first step: as Horovod does, after it
            self._broadcast()

    def _broadcast(self) -> None:
        self._done = True
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
        broadcast_variables([v for v in variables if id(v) not in own], self.root_rank)


class MetricAverage(keras.callbacks.Callback):
    """Averages the epoch's logged metrics over ranks, so every rank reports the global values.

    Put it before callbacks that read the metrics (checkpointing, early stopping, TensorBoard).
    Ranks whose models, optimizer configurations or `fit` (steps per epoch, epochs) differ are
    refused at the start (else a rank would wait here for ranks still training).
    """

    def on_train_begin(self, logs=None):
        self._verified = built_like_the_others(self.model)
        if self._verified:
            verify_same_job(self)

    def on_train_batch_end(self, batch, logs=None):
        if not self._verified:  # a model built at its first step
            self._verified = True
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


# -- Horovod's Keras callback names and arguments (horovod.tensorflow.keras.callbacks) -----------
class BroadcastGlobalVariablesCallback(BroadcastGlobalVariables):
    """Horovod's name for `BroadcastGlobalVariables(root_rank)` (`device` is Horovod's and has
    no effect here)."""

    def __init__(self, root_rank: int = 0, device: str = ""):
        super().__init__(root_rank)


class MetricAverageCallback(MetricAverage):
    """Horovod's name for `MetricAverage()` (`device` has no effect here)."""

    def __init__(self, device: str = ""):
        super().__init__()


def _refuse_momentum_correction(model: keras.Model, momentum_correction: bool) -> None:
    inner = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    if momentum_correction and float(getattr(inner, "momentum", 0.0) or 0.0) > 0.0:
        raise ValueError(
            "momentum_correction=True (Horovod's default) rescales SGD's momentum when the "
            "learning rate changes; tfdist's callbacks do not: pass momentum_correction=False "
            "(the plain schedule), or use an optimizer without momentum.")


class LearningRateWarmupCallback(_LearningRateWarmup):
    """Horovod's warm-up: from `initial_lr / size` to `initial_lr` (the learning rate already
    scaled by the number of ranks) over `warmup_epochs`, updated every batch.

    Args:
        initial_lr: The learning rate at the end of the warm-up.
        warmup_epochs: Epochs of warm-up. Defaults to 5.
        momentum_correction: Horovod's momentum rescaling; refused (with the alternative) for
            an optimizer with momentum, since tfdist does not do it.
        steps_per_epoch: Batches per epoch; default: `fit`'s.
        verbose: Print the learning rate at each epoch's end of the warm-up.
    """

    def __init__(self, initial_lr: float, warmup_epochs: float = 5,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0):
        size = float(HorovodEngine().world_size)
        super().__init__(warmup_epochs, base_lr=float(initial_lr) / size, scale=size,
                         steps_per_epoch=steps_per_epoch, verbose=verbose)
        self.momentum_correction = momentum_correction

    def on_train_begin(self, logs=None):
        _refuse_momentum_correction(self.model, self.momentum_correction)
        super().on_train_begin(logs)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Horovod's schedule: from `start_epoch` to `end_epoch` the learning rate is
    `initial_lr * multiplier` (a number, or a function of the epoch; with `staircase=False`
    the epoch is fractional and the rate changes every batch).

    Args:
        initial_lr: The learning rate the multiplier scales.
        multiplier: A number, or `f(epoch) -> factor`.
        start_epoch: First epoch it applies to. Defaults to 0.
        end_epoch: Epoch it stops applying at (exclusive); None: to the end.
        staircase: Change once per epoch (True) or every batch (False). Defaults to True.
        momentum_correction: As `LearningRateWarmupCallback`.
        steps_per_epoch: Batches per epoch; default: `fit`'s.
    """

    def __init__(self, initial_lr: float, multiplier, start_epoch: int = 0,
                 end_epoch: int | None = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None):
        super().__init__()
        if not callable(multiplier) and not isinstance(multiplier, (int, float)):
            raise ValueError(f"`multiplier` must be a number or a function of the epoch. "
                             f"Received: {multiplier!r}")
        self.initial_lr, self.multiplier = float(initial_lr), multiplier
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase, self.momentum_correction = staircase, momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self._epoch = 0

    def on_train_begin(self, logs=None):
        _refuse_momentum_correction(self.model, self.momentum_correction)
        self.steps_per_epoch = self.steps_per_epoch or (self.params or {}).get("steps")
        if not self.staircase and not self.steps_per_epoch:
            raise ValueError("LearningRateScheduleCallback(staircase=False) needs "
                             "`steps_per_epoch` (or `fit` with a known number of steps).")

    def _applies(self, epoch: float) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _set(self, epoch: float) -> None:
        if not self._applies(epoch):
            return
        factor = self.multiplier(epoch) if callable(self.multiplier) else self.multiplier
        self.model.optimizer.learning_rate = self.initial_lr * float(factor)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if self.staircase:
            self._set(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if not self.staircase:
            self._set(self._epoch + batch / self.steps_per_epoch)
