"""TensorBoard scalars in the standard (`simple_value`) form, which TensorBoard shows and
`EventAccumulator.Scalars` reads (TF 2's `tf.summary.scalar` writes tensors, which the latter
does not)."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from tensorboard.compat.proto import summary_pb2


class ScalarWriter:
    """Writes standard scalar summaries to an event file in `log_dir`.

    Example:
        ```python
        writer = tfdist.callbacks.ScalarWriter("logs")
        writer.write({"loss": 0.5, "bytes_per_step": 1024.0}, step=1)
        writer.close()
        ```
    """

    def __init__(self, log_dir: str):
        self.log_dir = str(log_dir)
        self._writer = tf.summary.create_file_writer(self.log_dir)

    def write(self, values: dict[str, float], step: int) -> None:
        summary = summary_pb2.Summary(value=[
            summary_pb2.Summary.Value(tag=tag, simple_value=float(value))
            for tag, value in values.items()])
        with self._writer.as_default():
            tf.summary.experimental.write_raw_pb(summary.SerializeToString(), step=int(step))
        self._writer.flush()

    def histogram(self, tag: str, counts: dict[int, int], step: int) -> None:
        """A histogram of integer values (value -> count), one bucket per value."""
        values = sorted(counts)
        total = sum(counts[v] for v in values)
        histo = summary_pb2.HistogramProto(
            min=float(values[0]) if values else 0.0, max=float(values[-1]) if values else 0.0,
            num=float(total), sum=float(sum(v * counts[v] for v in values)),
            sum_squares=float(sum(v * v * counts[v] for v in values)),
            bucket_limit=[v + 0.5 for v in values], bucket=[float(counts[v]) for v in values])
        summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, histo=histo)])
        with self._writer.as_default():
            tf.summary.experimental.write_raw_pb(summary.SerializeToString(), step=int(step))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def numeric(logs: dict | None) -> dict[str, float]:
    """The scalar numbers in Keras `logs`."""
    out = {}
    for key, value in (logs or {}).items():
        array = np.asarray(value)
        if array.ndim == 0 and np.issubdtype(array.dtype, np.number) and np.isfinite(array):
            out[key] = float(array)
    return out


class ScalarLog(keras.callbacks.Callback):
    """Writes every scalar of the epoch logs (loss, metrics, and what other callbacks add: bytes
    per step, collectives per step, test accuracy...) and the learning rate to TensorBoard, as
    standard scalars, at each epoch's end (step = the epoch, counted from 1).

    Put it after the callbacks whose values it should log.

    Args:
        log_dir: The event files' directory.

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))
        with strategy.scope():
            model = build_model()
            model.compile(optimizer=tfdist.DistributedOptimizer(keras.optimizers.Adam()),
                          loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=64, epochs=1, callbacks=[
            tfdist.callbacks.CommunicationStats(), tfdist.callbacks.ScalarLog("logs")])
        ```
    """

    def __init__(self, log_dir: str):
        super().__init__()
        self.log_dir = str(log_dir)
        self._writer: ScalarWriter | None = None

    def on_train_begin(self, logs=None):
        self._writer = ScalarWriter(self.log_dir)

    def on_epoch_end(self, epoch, logs=None):
        values = numeric(logs)
        lr = getattr(self.model.optimizer, "learning_rate", None)
        if lr is not None and "learning_rate" not in values:
            values["learning_rate"] = float(keras.ops.convert_to_numpy(lr))
        if self._writer is not None and values:
            self._writer.write(values, epoch + 1)

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.close()
            self._writer = None
