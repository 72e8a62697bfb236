"""A Horovod rank training tests/test_sparse_exchange.py's embedding model on its half of each
global batch with tfdist.DistributedOptimizer(SGD-momentum); writes OUT/rank<r>.npz (weights)
and OUT/rank<r>.json (bytes per step, whether the rows travelled as rows)."""

from __future__ import annotations

import json
import os
import sys

import keras
import numpy as np

import tfdist
import tfdist.horovod as thvd
from tests import test_sparse_exchange as job
from tests.workers import common


def main(out: str) -> None:
    thvd.init()
    rank, size = thvd.rank(), thvd.size()
    x, y = job._data()
    part = job.BATCH // size
    mine = np.concatenate([np.arange(i * job.BATCH + rank * part, i * job.BATCH + (rank + 1) * part)
                           for i in range(job.STEPS)])
    model = job._build()
    model.compile(optimizer=tfdist.DistributedOptimizer(job._sgd()),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x[mine], y[mine], batch_size=part, epochs=1, shuffle=False, verbose=0,
              callbacks=[thvd.callbacks.BroadcastGlobalVariables(0)])
    common.save_weights(model, os.path.join(out, f"rank{rank}.npz"))
    chain = tfdist.optimizers.chain_of(model.optimizer)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"bytes_per_step": model.optimizer.bytes_sent / job.STEPS,
                   "sparse": chain.sparse_exchange}, f)


if __name__ == "__main__":
    main(sys.argv[1])
