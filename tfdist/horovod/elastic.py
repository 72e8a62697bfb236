"""Elastic Horovod for Keras 3: a state object, callbacks and the `run` decorator.

Under `horovodrun --min-np A --max-np B --host-discovery-script S`, ranks may die and hosts may
join while the job runs. Horovod's own Keras state and callbacks (`hvd.elastic.KerasState`) are
written for tf.keras and fail on Keras 3; these work with Keras 3 models and tfdist optimizers:

    import tfdist.horovod as thvd
    from tfdist.horovod import elastic

    thvd.init()
    model.compile(tfdist.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=...)
    state = elastic.KerasState(model, epoch=0, batch=0)

    @elastic.run
    def train(state):
        step = state.epoch * steps_per_epoch + state.batch   # global batches done, committed
        data = tfdist.data.shard_batches(tfdist.data.global_batches(x, y, 48, start=step),
                                         thvd.rank(), thvd.size())
        model.fit(data, epochs=epochs, steps_per_epoch=steps_per_epoch,
                  callbacks=[tfdist.callbacks.StartAt(step, steps_per_epoch),
                             *elastic.callbacks(state)])

    train(state)

How it goes: `callbacks(state)` record the epoch and the batch and commit the state (a copy of
every model and optimizer variable in host memory) every `batches_per_commit` batches. When a
rank dies, the others' next collective fails: `run` restores the last commit, re-initialises
Horovod on the ranks left, broadcasts rank 0's state and calls `train` again, which goes on from
the committed step with the same global batches re-sliced over the new ranks (nothing lost or
trained twice). When a host joins, every rank stops at its next commit, and the newcomer gets rank
0's state. Keras' compiled step is built again after each reset (the number of ranks is part of
it). Variables that differ between ranks (error-feedback residuals, local SGD's models) take rank
0's values at a reset; ZeRO's shards are refused (they are each rank's own).

A model built at its first batch (a `Sequential` without `Input`, as in Horovod's examples)
works too: the variables are broadcast from rank 0 and committed when `fit` starts, by whichever
of these callbacks `fit` is given (every rank starts `fit` after a reset, a rank that has just
joined included, so the broadcasts pair up).
"""

from __future__ import annotations

import functools

import keras
import tensorflow as tf
from horovod.common.elastic import ObjectState, run_fn
from horovod.common.exceptions import HorovodInternalError

from tfdist.callbacks.start import SkippedSteps
from tfdist.comm import HorovodEngine, activate
from tfdist.comm.horovod import import_horovod, wait_for_the_others_at_exit
from tfdist.horovod.callbacks import broadcast_variables, build_or_verify_optimizer, built_like_the_others

__all__ = ["CommitState", "CommitStateCallback", "KerasState", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "UpdateState", "callbacks", "run"]


class KerasState(ObjectState):
    """The training state Horovod keeps in memory, commits and broadcasts: every variable of
    `model` and of its optimizer, plus the keyword values (e.g. `epoch=0, batch=0`), exposed as
    attributes.

    Args:
        model: A compiled Keras model (built, or built here by its optimizer's first use).
        **kwargs: Python values kept with it (numbers, strings), as `hvd.elastic.ObjectState`.
    """

    def __init__(self, model: keras.Model, **kwargs):
        hvd = import_horovod()
        if getattr(model, "optimizer", None) is None:
            raise ValueError("KerasState needs a compiled model (model.compile(optimizer=...)).")
        sharded = getattr(model.optimizer, "sharded_variables", None)
        if sharded is not None and list(sharded()):
            raise ValueError("KerasState cannot keep a ZeRO optimizer's state: its shards are "
                             "each rank's own and cannot be re-cut when ranks come and go. Use "
                             "tfdist.DistributedOptimizer, or BackupAndRestore(elastic=True) "
                             "under the TF_CONFIG elastic launcher.")
        self.model = model
        self._values: list | None = None
        self._variables_synced = True  # False from a sync until the variables follow
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, **kwargs)
        self.register_reset_callbacks([self._after_reset])

    def _variables(self) -> list:
        if not self.model.built:
            return []  # built by `fit`: see `_on_fit_start`
        optimizer = self.model.optimizer
        if not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        seen, out = set(), []
        for v in [*self.model.variables, *optimizer.variables]:
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
        return out

    def save(self) -> None:
        """Copies every variable to host memory (a commit)."""
        self._values = [v.numpy() for v in self._variables()] or None
        super().save()

    def restore(self) -> None:
        """Puts the last commit back (after a rank died mid-step)."""
        if self._values is not None:
            for v, value in zip(self._variables(), self._values, strict=True):
                v.assign(value)
        super().restore()

    def sync(self) -> None:
        """Every rank takes rank 0's Python values; the variables follow when `fit` starts
        (`_on_fit_start`), when every rank's model is built, a lazily built one included."""
        super().sync()
        self._variables_synced = False

    def _on_fit_start(self) -> None:
        """Called by the state callbacks when `fit` starts: after a sync, every rank takes rank
        0's variables (a model built at its first step on every rank: after that step)."""
        if not self._variables_synced and built_like_the_others(self.model):
            self._sync_variables()

    def _on_batch_end(self) -> None:
        if not self._variables_synced:  # built by the step just done
            self._sync_variables()

    def _sync_variables(self) -> None:
        """Every rank takes rank 0's variables, then commits (the optimizer configurations
        compared first)."""
        build_or_verify_optimizer(self.model)
        broadcast_variables(self._variables(), root_rank=0)
        self._variables_synced = True
        self.save()

    def _after_reset(self) -> None:
        activate(HorovodEngine())  # the new world
        for name in ("train_function", "test_function", "predict_function"):
            setattr(self.model, name, None)  # traced for the old number of ranks


class _StateCallback(keras.callbacks.Callback):
    """A callback that holds the state: when `fit` starts, the state's variables are synced."""

    def __init__(self, state: KerasState):
        super().__init__()
        self.state = state

    def on_train_begin(self, logs=None):
        self.state._on_fit_start()

    def on_train_batch_end(self, batch, logs=None):
        self.state._on_batch_end()


class UpdateState(_StateCallback):
    """Keeps `state.epoch` (the epoch being trained) and `state.batch` (its batches done)."""

    def on_epoch_begin(self, epoch, logs=None):
        if epoch != self.state.epoch:
            self.state.epoch, self.state.batch = epoch, 0

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        self.state.batch = batch + 1

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch, self.state.batch = epoch + 1, 0


class CommitState(_StateCallback):
    """Commits `state` every `batches_per_commit` batches and at each epoch's end; a commit also
    checks for hosts added or removed (every rank stops there together). An epoch's last batch
    is committed by the epoch's end, right after it (its callbacks run first), so that a reset
    never resumes an epoch with no batch left to train (a rank that has just joined would end
    such an epoch with its metrics never built)."""

    def __init__(self, state: KerasState, batches_per_commit: int = 1):
        super().__init__(state)
        if isinstance(batches_per_commit, bool) or not isinstance(batches_per_commit, int) \
                or batches_per_commit < 1:
            raise ValueError(f"batches_per_commit must be an integer >= 1. Received: "
                             f"{batches_per_commit!r}")
        self.batches_per_commit = batches_per_commit

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        last = batch + 1 == (self.params or {}).get("steps")
        if (batch + 1) % self.batches_per_commit == 0 and not last:
            self.state.commit()

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


def callbacks(state: KerasState, batches_per_commit: int = 1) -> list[keras.callbacks.Callback]:
    """The callbacks an elastic `fit` needs, in order: `UpdateState`, then `CommitState`."""
    return [UpdateState(state), CommitState(state, batches_per_commit)]


# -- Horovod's names (horovod.tensorflow.keras.elastic), with Horovod's meaning ----------------
class CommitStateCallback(CommitState):
    """Horovod's `CommitStateCallback(state, batches_per_commit=1)`: `CommitState`."""


class UpdateEpochStateCallback(_StateCallback):
    """Horovod's: `state.epoch` counts epochs across resets, for a `fit` called with
    `epochs=total - state.epoch` after each (Keras' epoch numbers start at 0 in every `fit`)."""

    def __init__(self, state: KerasState):
        super().__init__(state)
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + epoch + 1


class UpdateBatchStateCallback(_StateCallback):
    """Horovod's: `state.batch` counts the batches done in the epoch being trained (0 at its
    end), and a `fit` started after a reset passes over the batches its first epoch had done
    (nothing read, nothing trained: feed `fit` data from there). Horovod keeps the index of the
    last batch done instead, one less, so its resumed epoch trains that batch again."""

    def __init__(self, state: KerasState):
        super().__init__(state)
        self._skipped: SkippedSteps | None = None

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        if self.state.batch:
            self._skipped = SkippedSteps(self.model, self.state.batch)

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        self.state.batch = batch + 1

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0

    def on_train_end(self, logs=None):
        if self._skipped is not None:
            self._skipped.remove()
            self._skipped = None


def run(func):
    """`hvd.elastic.run` for tfdist: calls `func(state, ...)` again after every reset (a rank
    lost or a host added), with Horovod re-initialised, tfdist's engine re-activated and the state
    synchronised from rank 0. A collective that fails because a rank died (TensorFlow reports it
    as an UnknownError or an Aborted/Unavailable error naming Horovod) counts as Horovod's
    internal error: the last commit is restored first."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except (tf.errors.UnknownError, tf.errors.AbortedError, tf.errors.UnavailableError,
                tf.errors.InternalError, tf.errors.FailedPreconditionError) as error:
            if "Horovod" not in error.message:
                raise
            raise HorovodInternalError(error) from error

    def reset():
        hvd = import_horovod()
        hvd.shutdown()
        hvd.init()
        wait_for_the_others_at_exit()

    return run_fn(wrapper, reset)
