"""Horovod worker for the callback tests: ranks start from *different* weights and data."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    out = sys.argv[1]
    import keras

    import tfdist.horovod as thvd
    from tests.workers import common
    from tfdist.data import global_batches, load_digits, shard_batches

    thvd.init()
    rank = thvd.rank()
    keras.utils.set_random_seed(100 + rank)  # deliberately different initial weights
    model = common.build_model("mlp", (8, 8, 1), 10, (16,))
    opt = thvd.DistributedOptimizer(keras.optimizers.SGD(0.01))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    x, y = load_digits()
    data = shard_batches(global_batches(x, y, 32, seed=0), rank, thvd.size())
    lrs = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda b, logs: lrs.append(float(opt.learning_rate.numpy())))
    history = model.fit(data, epochs=3, steps_per_epoch=4, verbose=0, callbacks=[
        thvd.callbacks.BroadcastGlobalVariables(0),
        thvd.callbacks.MetricAverage(),
        thvd.callbacks.LearningRateWarmup(warmup_epochs=2),
        record,
    ])
    common.save_weights(model, os.path.join(out, f"rank{rank}.npz"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"history": history.history, "lrs": lrs}, f)


if __name__ == "__main__":
    main()
