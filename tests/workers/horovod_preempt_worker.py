"""A preemption notice under horovodrun: `python horovod_preempt_worker.py OUT MODE` trains 3
epochs of 6 steps on the Horovod ranks with `BackupAndRestore(OUT/backup,
preemption_signals=["SIGTERM"])`; MODE "notice" has rank 1 send itself SIGTERM while step 9
runs (every rank backs up at step 9 and exits with 76), "run" trains (resuming if a backup is
there). Each rank that finishes writes OUT/<MODE>-rank<r>.npz."""

from __future__ import annotations

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfdist  # noqa: E402
import tfdist.horovod as hvd  # noqa: E402
from tfdist.data import global_batches, load_digits, shard_batches  # noqa: E402

if __name__ == "__main__":
    out, mode = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    hvd.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8, 8)), keras.layers.Flatten(),
                              keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(1e-2)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    backup = tfdist.callbacks.BackupAndRestore(os.path.join(out, "backup"), save_freq=1000,
                                               preemption_signals=["SIGTERM"])
    callbacks = [backup, hvd.callbacks.BroadcastGlobalVariables(0)]
    if mode == "notice" and hvd.rank() == 1:
        steps = []

        def notice(batch, logs):
            steps.append(batch)
            if len(steps) == 9:
                os.kill(os.getpid(), signal.SIGTERM)

        callbacks.append(keras.callbacks.LambdaCallback(on_train_batch_begin=notice))
    x, y = load_digits()
    data = shard_batches(global_batches(x, y, 32, seed=1, start=backup.data_start), hvd.rank(),
                         hvd.size())
    model.fit(data, epochs=3, steps_per_epoch=6, verbose=0, callbacks=callbacks)
    np.savez(os.path.join(out, f"{mode}-rank{hvd.rank()}.npz"), *model.get_weights())
