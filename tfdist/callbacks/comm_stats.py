"""Communication statistics (bytes sent, collective calls, rounds) in the logs and in
TensorBoard."""

from __future__ import annotations

import time

import keras

from tfdist.callbacks.scalars import ScalarWriter
from tfdist.callbacks.start import skipping
from tfdist.optimizers import Accumulation, chain_of


class StepTimer(keras.callbacks.Callback):
    """Collects the wall time of each training batch (seconds) in `times` and when each began
    (`time.time()`, in `began`: hosts sharing a clock can tell which of their steps ran at the
    same time), and when `fit` began and its first batch began (`fit_began`,
    `first_step_began`): what `fit` spends before its first step (the dataset's iterator,
    callbacks).

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))
        with strategy.scope():
            model = build_model()
            model.compile(optimizer=tfdist.DistributedOptimizer(keras.optimizers.Adam()),
                          loss="sparse_categorical_crossentropy")
        timer = tfdist.callbacks.StepTimer()
        model.fit(x, y, batch_size=64, epochs=1, callbacks=[timer])
        print(f"median step {sorted(timer.times)[len(timer.times) // 2] * 1e3:.1f} ms")
        ```
    """

    def __init__(self):
        super().__init__()
        self.times: list[float] = []
        self.began: list[float] = []
        self._start = self._wall = 0.0
        self.fit_began: float | None = None
        self.first_step_began: float | None = None

    def on_train_begin(self, logs=None):
        if self.fit_began is None:
            self.fit_began = time.time()

    def on_train_batch_begin(self, batch, logs=None):
        self._start, self._wall = time.perf_counter(), time.time()

    def on_train_batch_end(self, batch, logs=None):
        if skipping(self.model):  # a finished step of a resumed epoch: nothing ran
            return
        if self.first_step_began is None:
            self.first_step_began = self._wall
        self.times.append(time.perf_counter() - self._start)
        self.began.append(self._wall)


class CommunicationStats(keras.callbacks.Callback):
    """Adds `bytes_per_step` (bytes this worker sent per training batch, this epoch),
    `collectives_per_step` (collective calls per training batch: per gradient exchange for
    synchronous algorithms), `communication_rounds`, `bytes_vs_dense` (bytes sent / what a dense
    float32 all-reduce at every optimizer step would send for the same batches: 1 for dense
    training, the saving of compression or local SGD otherwise; the same meaning as
    `bytes_ratio_vs_dense` in `tfdist train`'s summary) and `step_seconds` (the epoch's wall
    time per batch) to the epoch logs, and writes them to TensorBoard.

    Args:
        log_dir: Optional TensorBoard log directory (event files under `log_dir/comm`).
        update_freq: Write to TensorBoard every this many batches. Defaults to 10.

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))
        with strategy.scope():
            model = build_model()
            model.compile(optimizer=tfdist.DistributedOptimizer(keras.optimizers.Adam()),
                          loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=64, epochs=1, callbacks=[tfdist.callbacks.CommunicationStats()])
        print(model.history.history["bytes_per_step"])  # bytes this worker sent per step
        ```
    """

    def __init__(self, log_dir: str | None = None, update_freq: int = 10):
        super().__init__()
        if update_freq < 1:
            raise ValueError(f"`update_freq` must be >= 1. Received: update_freq={update_freq}")
        self.log_dir = log_dir
        self.update_freq = update_freq
        self._writer = None
        self._optimizer = None
        self._step = 0
        self._epoch_start_time: float | None = None

    def on_train_begin(self, logs=None):
        self._optimizer = chain_of(self.model.optimizer)
        if self._optimizer is None:
            raise ValueError(
                "CommunicationStats needs a tfdist optimizer (tfdist.DistributedOptimizer, "
                "tfdist.horovod.DistributedOptimizer, or one built under a tfdist strategy such "
                f"as CompressedStrategy). Received: {type(self.model.optimizer).__name__}")
        if self.log_dir:
            self._writer = ScalarWriter(f"{self.log_dir}/comm")

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start_bytes = self._optimizer.bytes_sent
        self._epoch_start_rounds = self._optimizer.communication_rounds
        self._epoch_start_calls = self._optimizer.collective_calls
        self._epoch_batches = 0
        self._epoch_start_time = None

    def on_train_batch_begin(self, batch, logs=None):
        if self._epoch_start_time is None:
            self._epoch_start_time = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if skipping(self.model):  # a finished step of a resumed epoch: nothing ran or was sent
            self._epoch_start_time = None  # the epoch's time starts at its first real step
            return
        self._step += 1
        self._epoch_batches += 1
        if self._writer is not None and self._step % self.update_freq == 0:
            self._writer.write({"bytes_sent": self._optimizer.bytes_sent,
                                "communication_rounds": self._optimizer.communication_rounds},
                               self._step)

    def on_epoch_end(self, epoch, logs=None):
        sent = self._optimizer.bytes_sent - self._epoch_start_bytes
        per_step = sent / max(self._epoch_batches, 1)
        calls = (self._optimizer.collective_calls - self._epoch_start_calls) / max(
            self._epoch_batches, 1)
        dense = self._optimizer.dense_bytes_per_exchange()
        accumulation = self._optimizer.part(Accumulation)
        micro_steps = 1 if accumulation is None else accumulation.current_steps
        # What dense all-reduces would send for the same batches: one per optimizer step.
        ratio = (sent / (dense * self._epoch_batches / micro_steps)
                 if dense and self._epoch_batches else None)
        began = self._epoch_start_time or time.perf_counter()
        step_seconds = (time.perf_counter() - began) / max(self._epoch_batches, 1)
        if logs is not None:
            logs["step_seconds"] = step_seconds
            logs["bytes_per_step"] = per_step
            logs["collectives_per_step"] = calls
            logs["communication_rounds"] = float(self._optimizer.communication_rounds)
            if ratio is not None:
                logs["bytes_vs_dense"] = ratio
        if self._writer is not None:
            self._writer.write({"bytes_per_step": per_step, "collectives_per_step": calls,
                                "step_seconds": step_seconds,
                                **({} if ratio is None else {"bytes_vs_dense": ratio})},
                               self._step)

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.close()
