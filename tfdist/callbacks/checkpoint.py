"""`ModelCheckpoint` for multi-process jobs: every process saves, one file is written."""

from __future__ import annotations

import os
import shutil
import tempfile

import keras
import numpy as np
import tensorflow as tf

from tfdist.comm import resolve


def process_role(model: keras.Model) -> tuple[bool, bool]:
    """(chief, multi_process) for the job `model` trains in: TF_CONFIG workers (the strategy's
    chief, usually worker 0), Horovod ranks (rank 0), or one process (the chief)."""
    engine = resolve(getattr(model, "distribute_strategy", None))
    return engine.is_chief, engine.multi_process


class ModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """`keras.callbacks.ModelCheckpoint` that works in a multi-process job.

    Pass it to `fit` on every process (TF_CONFIG worker or Horovod rank), not on rank 0 alone:
    every process saves at the same points, so whatever the save gathers across processes (a
    `tfdist.ZeroOptimizer`'s shards of the optimizer state) is gathered, and only the chief
    (worker 0 / rank 0) writes `filepath`; the others write to a temporary directory that is
    removed as soon as their save returns. With `save_best_only`, every process takes the chief's
    value of `monitor`, so they agree on when to save. In a single process it is exactly
    `keras.callbacks.ModelCheckpoint`.

    Args: those of `keras.callbacks.ModelCheckpoint`.

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))
        with strategy.scope():
            model = build_model()
            model.compile(optimizer=tfdist.DistributedOptimizer(keras.optimizers.Adam()),
                          loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=64, epochs=2, callbacks=[
            tfdist.callbacks.ModelCheckpoint("ckpt/epoch{epoch}.keras")])
        ```
    """

    def __init__(self, filepath, *args, **kwargs):
        super().__init__(filepath, *args, **kwargs)
        self.chief_filepath = self.filepath
        self._chief = True
        self._multi_process = False

    def set_model(self, model):
        super().set_model(model)
        self._chief, self._multi_process = process_role(model)
        self.filepath = self.chief_filepath

    def _saving(self, save) -> None:
        """Runs Keras' hook `save`; a process other than the chief saves into a temporary
        directory that is gone when the hook returns (or raises)."""
        if self._chief:
            save()
            return
        scratch = tempfile.mkdtemp(prefix="tfdist-checkpoint-")
        self.filepath = os.path.join(scratch, os.path.basename(self.chief_filepath))
        try:
            save()
        finally:
            self.filepath = self.chief_filepath
            shutil.rmtree(scratch, ignore_errors=True)

    def _agreed(self, logs):
        """`logs` with the chief's value of the monitored quantity."""
        if not (self.save_best_only and self._multi_process and logs
                and self.monitor in logs):
            return logs
        engine = resolve(self.model.distribute_strategy)
        value = tf.constant(float(np.asarray(logs[self.monitor])), tf.float64)
        chiefs = engine.run(lambda comm: comm.broadcast([value], root=0)[0])
        return {**logs, self.monitor: float(chiefs)}

    def on_train_batch_end(self, batch, logs=None):
        if self.save_freq == "epoch":  # Keras saves nothing here
            super().on_train_batch_end(batch, logs)
            return
        logs = self._agreed(logs)
        self._saving(lambda: super(ModelCheckpoint, self).on_train_batch_end(batch, logs))

    def on_epoch_end(self, epoch, logs=None):
        logs = self._agreed(logs)
        self._saving(lambda: super(ModelCheckpoint, self).on_epoch_end(epoch, logs))
