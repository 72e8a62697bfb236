"""Horovod ranks that disagree: `steps` (rank 1 runs fewer steps per epoch) or `compressor`
(rank 1 compresses with top-k, rank 0 sends dense)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    mode = sys.argv[1]
    import keras

    import tfdist.horovod as thvd
    from tests.workers import common
    from tfdist.data import global_batches, load_digits, shard_batches

    thvd.init()
    rank = thvd.rank()
    model = common.build_model("mlp", (8, 8, 1), 10, (16,))
    compressor = {"name": "topk", "ratio": 0.1} if mode == "compressor" and rank == 1 else None
    model.compile(optimizer=thvd.DistributedOptimizer(keras.optimizers.SGD(0.01),
                                                      compressor=compressor),
                  loss="sparse_categorical_crossentropy")
    x, y = load_digits()
    data = shard_batches(global_batches(x, y, 32, seed=0), rank, thvd.size())
    steps = 3 if mode == "steps" and rank == 1 else 4
    model.fit(data, epochs=2, steps_per_epoch=steps, verbose=0,
              callbacks=[thvd.callbacks.MetricAverage()])


if __name__ == "__main__":
    main()
