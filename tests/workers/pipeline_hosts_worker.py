"""A pipeline whose stages run on other TF_CONFIG workers (one per emulated host).

Worker 0 drives: `cluster_devices(stages=2, replicas=2)` connects it to the 4 workers. It trains
with `fit` (a) one 2-stage pipeline on workers 0 and 1, with GPipe and with 1F1B, and (b) two
such pipelines on workers 0-1 and 2-3 (data x pipeline parallelism), and saves the weights (and
where the last stage's variables live) to argv[1]. The other workers serve their devices and exit
when worker 0 ends.

`python pipeline_hosts_worker.py OUT die`: 2 workers, one pipeline; worker 0 trains without end
and writes OUT once it has trained a while; then worker 1 kills itself (SIGKILL), as a host that
dies under a running job.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import keras
import numpy as np

BATCH, EXAMPLES, FEATURES = 32, 100, 6  # 100 = 3 full batches and a partial one


def layers():
    keras.utils.set_random_seed(3)
    return [keras.layers.Dense(16, activation="relu"), keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(12, activation="relu"), keras.layers.Dense(10)]


def data():
    rs = np.random.RandomState(0)
    return rs.randn(EXAMPLES, FEATURES).astype("float32"), rs.randint(0, 10, EXAMPLES)


def train(devices, schedule: str, epochs: int = 2):
    from tfdist.pipeline import Pipeline, PipelineModel

    ls = layers()
    model = PipelineModel(Pipeline([ls[:2], ls[2:]], devices=devices, num_microbatches=4,
                                   schedule=schedule), input_shape=(FEATURES,))
    model.compile(keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data()
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return model


def replica_weights(pipe, r: int) -> list[np.ndarray]:
    return [v.numpy() for stage in pipe.replica_stages(r) for layer in stage
            for v in layer.trainable_variables]


def die_when_driver_trains(flag: str) -> None:
    def watch():
        while not os.path.exists(flag):
            time.sleep(0.2)
        time.sleep(1)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()


class _Started(keras.callbacks.Callback):
    def __init__(self, flag: str):
        super().__init__()
        self.flag = flag

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            open(self.flag, "w").close()


def main(out: str, die: bool) -> None:
    from tfdist.pipeline import Pipeline, PipelineModel, cluster_devices

    if die:
        if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 1:
            die_when_driver_trains(out)
        devices = cluster_devices(stages=2)  # the serving worker stops here
        ls = layers()
        model = PipelineModel(Pipeline([ls[:2], ls[2:]], devices=devices, num_microbatches=4),
                              input_shape=(FEATURES,))
        model.compile("sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(*data(), batch_size=BATCH, epochs=10**6, verbose=0, callbacks=[_Started(out)])
        return
    grid = cluster_devices(stages=2, replicas=2)  # the serving workers stop here
    saved = {}
    for schedule in ("gpipe", "1f1b"):
        model = train(grid[0], schedule)
        saved.update({f"{schedule}_{i}": w for i, w in enumerate(model.get_weights())})
        kernel = model.pipeline.stages[1][0].kernel
        saved[f"{schedule}_device"] = np.array(kernel.value.device)
    model = train(grid, "1f1b")
    for r in range(2):
        saved.update({f"hybrid{r}_{i}": w
                      for i, w in enumerate(replica_weights(model.pipeline, r))})
    saved["hybrid_device"] = np.array(model.pipeline.replica_stages(1)[1][0].kernel.value.device)
    np.savez(out, **saved)
    print("DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], die=sys.argv[2:] == ["die"])
