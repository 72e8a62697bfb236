"""Scripts written as Horovod's Keras examples are, with only the import changed to
`import tfdist.horovod as hvd` (run under `horovodrun --gloo -np 2`): `python
horovod_style_worker.py OUT` runs, one after another in fresh Keras sessions,

* "mnist": Horovod's examples/tensorflow2/tensorflow2_keras_mnist.py, with the two edits Keras 3
  itself requires (no `experimental_run_tf_function`, `.keras` checkpoints) and the digits set
  standing in for the MNIST download;
* "lazy": a Sequential without an Input, MetricAverageCallback, BroadcastGlobalVariablesCallback
  and DistributedOptimizer(SGD) on the same global batches as the test's MirroredStrategy run;
* "fp16" / "tfdist_fp16": `compression=hvd.Compression.fp16` and tfdist's own FP16 compressor.

Each writes OUT/<job>-rank<r>.npz (weights) and .json (history, bytes sent).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist.horovod as hvd  # noqa: E402 (was: import horovod.tensorflow.keras as hvd)
from tfdist.data import global_batches, load_digits, shard_batches  # noqa: E402

OUT = sys.argv[1] if __name__ == "__main__" else ""  # the test imports its constants too
LAZY_BATCH, LAZY_STEPS = 32, 6


def save(job: str, model, **extra) -> None:
    np.savez(os.path.join(OUT, f"{job}-rank{hvd.rank()}.npz"), *model.get_weights())
    with open(os.path.join(OUT, f"{job}-rank{hvd.rank()}.json"), "w") as f:
        json.dump(extra, f)


def lazy_model() -> keras.Model:  # as in Horovod's examples: no Input layer
    return keras.Sequential([keras.layers.Flatten(), keras.layers.Dense(32, activation="relu"),
                             keras.layers.Dense(10, activation="softmax")])


def mnist() -> None:
    """Horovod's tensorflow2_keras_mnist.py (the comments mark what differs)."""
    gpus = tf.config.experimental.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")

    images, labels = load_digits()  # stands in for tf.keras.datasets.mnist.load_data()
    dataset = tf.data.Dataset.from_tensor_slices(
        (tf.cast(images / 16.0, tf.float32), tf.cast(labels, tf.int64)))
    dataset = dataset.repeat().shuffle(10000).batch(128)

    mnist_model = tf.keras.Sequential([
        tf.keras.layers.Conv2D(32, [3, 3], activation="relu"),
        tf.keras.layers.Conv2D(64, [3, 3], activation="relu"),
        tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation="relu"),
        tf.keras.layers.Dropout(0.5),
        tf.keras.layers.Dense(10, activation="softmax"),
    ])
    scaled_lr = 0.001 * hvd.size()
    opt = tf.optimizers.Adam(scaled_lr)
    opt = hvd.DistributedOptimizer(opt, backward_passes_per_step=1,
                                   average_aggregated_gradients=True)
    mnist_model.compile(loss=tf.losses.SparseCategoricalCrossentropy(), optimizer=opt,
                        metrics=["accuracy"])  # Keras 3: no experimental_run_tf_function
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3, verbose=1),
    ]
    if hvd.rank() == 0:  # Keras 3: .keras files
        callbacks.append(tf.keras.callbacks.ModelCheckpoint(
            os.path.join(OUT, "checkpoint-{epoch}.keras")))
    verbose = 1 if hvd.rank() == 0 else 0
    history = mnist_model.fit(dataset, steps_per_epoch=80 // hvd.size(), callbacks=callbacks,
                              epochs=6, verbose=verbose)
    save("mnist", mnist_model, history=history.history)


def lazy() -> None:
    keras.utils.set_random_seed(0)
    x, y = load_digits()
    model = lazy_model()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    data = shard_batches(global_batches(x, y, LAZY_BATCH, seed=1), hvd.rank(), hvd.size())
    history = model.fit(data, epochs=2, steps_per_epoch=LAZY_STEPS, verbose=0, callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()])
    save("lazy", model, history=history.history)


def fp16(job: str) -> None:
    keras.utils.set_random_seed(0)
    x, y = load_digits()
    model = keras.Sequential([keras.Input((8, 8)), *lazy_model().layers])
    opt = (hvd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                    compression=hvd.Compression.fp16) if job == "fp16" else
           hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compressor="fp16",
                                    min_compress_size=0, compress_1d=True)
           if job == "tfdist_fp16" else
           hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    data = shard_batches(global_batches(x, y, LAZY_BATCH, seed=1), hvd.rank(), hvd.size())
    model.fit(data, epochs=1, steps_per_epoch=LAZY_STEPS, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    save(job, model, bytes_sent=int(opt.bytes_sent))


if __name__ == "__main__":
    hvd.init()
    for run in (mnist, lazy, lambda: fp16("fp16"), lambda: fp16("tfdist_fp16"),
                lambda: fp16("dense")):
        keras.backend.clear_session()
        run()
