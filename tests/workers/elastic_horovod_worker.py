"""A Keras 3 job under elastic horovodrun (`tfdist.horovod.elastic`).

`python elastic_horovod_worker.py OUT MODE HOSTS [STYLE]`, MODE "die" or "join":
* die: the rank on host 127.0.0.1 kills itself (SIGKILL) at global step 8, once;
* join: rank 0 adds `127.0.0.1:1` to the discovery file HOSTS at global step 6, where every
  rank waits for Horovod to see it.
STYLE "tfdist" (default) uses tfdist's own names; "horovod" is written as Horovod's elastic Keras
example is (a `Sequential` without `Input`, `hvd.DistributedOptimizer(opt,
backward_passes_per_step=1, ...)`, `hvd.callbacks.MetricAverageCallback`, the three
`hvd.elastic.*Callback`s, `fit(epochs=EPOCHS - state.epoch)`, a checkpoint on rank 0), with only
the import changed and data positioned at the committed step.
Rank 0 writes the final weights and the world sizes it trained at to OUT (npz).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import keras
import numpy as np

import tfdist
import tfdist.horovod as thvd
from tfdist.horovod import elastic

STEPS, EPOCHS, GLOBAL_BATCH, DIE_AT, JOIN_AT = 12, 3, 48, 8, 6


def build(lazy: bool = False) -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([*([] if lazy else [keras.Input((8, 8, 1))]), keras.layers.Flatten(),
                             keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class Fault(keras.callbacks.Callback):
    def __init__(self, state, mode: str, hosts: str, marker: str):
        super().__init__()
        self.state, self.mode, self.hosts, self.marker = state, mode, hosts, marker

    def on_train_batch_end(self, batch, logs=None):
        step = self.state.epoch * STEPS + self.state.batch
        if self.mode == "join" and step == JOIN_AT and thvd.size() < 3:
            if thvd.rank() == 0:
                with open(self.hosts, "a") as f:
                    f.write("127.0.0.1:1\n")
            # Every rank waits here, after this step's commit, until Horovod has seen the new
            # host (`check_host_updates` is a collective: the ranks poll together and raise the
            # reset together), so the reset comes at this step however loaded the machine is.
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                self.state.check_host_updates()
                time.sleep(0.25)
            raise RuntimeError("Horovod did not see the host added to the discovery file")
        if os.path.exists(self.marker):
            return
        if self.mode == "die" and step == DIE_AT and \
                os.environ.get("HOROVOD_HOSTNAME") == "127.0.0.1":
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


def horovod_style(out: str, mode: str, hosts: str) -> None:
    import tfdist.horovod as hvd

    hvd.init()
    x, y = tfdist.data.load_digits()
    model = build(lazy=True)
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, backward_passes_per_step=1,
                                   average_aggregated_gradients=True)
    model.compile(loss=loss(), optimizer=opt, metrics=["accuracy"])
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    sizes = []
    callbacks = [hvd.callbacks.MetricAverageCallback(),
                 hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state),
                 Fault(state, mode, hosts, out + ".fault")]
    if hvd.rank() == 0:
        callbacks.append(keras.callbacks.ModelCheckpoint(out + ".checkpoint-{epoch}.keras"))

    @hvd.elastic.run
    def train(state):
        sizes.append(hvd.size())
        data = tfdist.data.shard_batches(tfdist.data.global_batches(
            x, y, GLOBAL_BATCH, seed=0, start=state.epoch * STEPS + state.batch),
            hvd.rank(), hvd.size())
        state.model.fit(data, steps_per_epoch=STEPS, epochs=EPOCHS - state.epoch,
                        callbacks=callbacks, verbose=0)

    train(state)
    if hvd.rank() == 0:
        np.savez(out, *model.get_weights(), sizes=np.array(sizes))
    print(f"DONE rank {hvd.rank()} of {hvd.size()}; sizes {sizes}", flush=True)


def main(out: str, mode: str, hosts: str) -> None:
    thvd.init()
    x, y = tfdist.data.load_digits()
    model = build()
    model.compile(tfdist.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)),
                  loss=loss())
    state = elastic.KerasState(model, epoch=0, batch=0)
    sizes = []

    @elastic.run
    def train(state):
        sizes.append(thvd.size())
        step = state.epoch * STEPS + state.batch
        data = tfdist.data.shard_batches(
            tfdist.data.global_batches(x, y, GLOBAL_BATCH, seed=0, start=step),
            thvd.rank(), thvd.size())
        model.fit(data, epochs=EPOCHS, steps_per_epoch=STEPS, verbose=0,
                  callbacks=[tfdist.callbacks.StartAt(step, STEPS), *elastic.callbacks(state),
                             Fault(state, mode, hosts, out + ".fault")])

    train(state)
    if thvd.rank() == 0:
        np.savez(out, *model.get_weights(), sizes=np.array(sizes))
    print(f"DONE rank {thvd.rank()} of {thvd.size()}; sizes {sizes}", flush=True)


if __name__ == "__main__":
    (horovod_style if sys.argv[4:5] == ["horovod"] else main)(*sys.argv[1:4])
