"""A job whose step `--freeze-step` stalls: on `--freeze-rank` of a Horovod job the process stops
itself (SIGSTOP, continued 40 s later so the test's processes end), or, in a single process, the
step sleeps. Every process runs tfdist.callbacks.Watchdog(timeout=--timeout)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", choices=["single", "horovod"], required=True)
    p.add_argument("--freeze-rank", type=int, default=0)
    p.add_argument("--freeze-step", type=int, default=4)
    p.add_argument("--timeout", type=float, default=8.0)
    p.add_argument("--heartbeats", default=None)
    a = p.parse_args()
    import keras

    import tfdist
    from tests.workers import common
    from tfdist.data import global_batches, load_digits, shard_batches

    rank, size = 0, 1
    if a.engine == "horovod":
        import tfdist.horovod as thvd

        thvd.init()
        rank, size = thvd.rank(), thvd.size()

    class Stall(keras.callbacks.Callback):
        step = 0

        def on_train_batch_begin(self, batch, logs=None):
            self.step += 1
            if self.step != a.freeze_step or rank != a.freeze_rank:
                return
            print(f"rank {rank}: stalling at step {self.step}", flush=True)
            if a.engine == "single":
                time.sleep(60)
                return
            subprocess.Popen(["sh", "-c", f"sleep 40; kill -CONT {os.getpid()}"],
                             start_new_session=True)
            os.kill(os.getpid(), signal.SIGSTOP)

    model = common.build_model("mlp", (8, 8, 1), 10, (16,))
    model.compile(optimizer=tfdist.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                  loss="sparse_categorical_crossentropy")
    x, y = load_digits()
    data = shard_batches(global_batches(x, y, 32, seed=0), rank, size)
    watchdog = tfdist.callbacks.Watchdog(timeout=a.timeout, directory=a.heartbeats)
    model.fit(data, epochs=1, steps_per_epoch=8, verbose=0, callbacks=[watchdog, Stall()])
    print(f"rank {rank}: finished", flush=True)


if __name__ == "__main__":
    main()
