"""The benchmarks' own engine: plain Keras data parallelism, the baseline tfdist is measured
against. It is an engine from a file, as a user's is (docs/guides/extending.md): the suites name
it `engine.name=tfdist.tools.bench.baselines:KerasMultiWorker`."""

from __future__ import annotations

import numpy as np

from tfdist.tools.engines.data_parallel import MultiWorker


class KerasMultiWorker(MultiWorker):
    """The baseline tfdist is measured against: Keras' own gradient all-reduce under the
    multi-worker strategy (with only the keras#20585 fix), no tfdist optimizer."""

    step_logs = "averaged"
    tfdist_optimizer = False
    counts_bytes = False

    def check(self, config):
        comp, avg, opt = config["compression"], config["averaging"], config["optimizer"]
        extras = [name for name, on in (
            ("compression.name", comp["name"] != "none" or comp["error_feedback"]),
            ("averaging.period", avg["period"] is not None),
            ("optimizer.zero_stage", opt["zero_stage"] is not None),
            ("optimizer.accumulation_steps", opt["accumulation_steps"] > 1)) if on]
        if not extras:
            return []
        return [f"engine.name: {config['engine']['name']!r} is plain Keras data parallelism (the "
                f"baseline); {', '.join(extras)} need(s) a tfdist engine: use 'multi_worker'"]

    def optimizer(self, inner):
        return inner

    def callbacks(self):
        return []

    def exchanged(self, model, optimizer, steps, micro_batch):
        """Keras' own exchange is not counted as it runs: its formula (`keras_exchange`)."""
        per_step, calls = keras_exchange(model, micro_batch // self.world_size,
                                         self.world_size)
        return per_step * steps, steps, calls * steps


def keras_exchange(model, replica_batch: int, world_size: int) -> tuple[float, int]:
    """What Keras' own exchange on a tf.distribute strategy sends per worker and step, and in
    how many collective calls; it is not counted as it runs, so this is a formula. TF's
    CollectiveAllReduce all-reduces the dense gradients in one batched call. An embedding's
    gradient is rows (tf.IndexedSlices): it all-gathers them in three calls, the row counts,
    the rows and their int32 indices (tensorflow/python/distribute/cross_device_utils.py). A
    table's rows per step: the ids its layer looks up, its input's size per example (the first
    call's) times the replica's batch."""
    from tfdist.comm import ring_bytes
    from tfdist.plan import embedding_rows

    if world_size <= 1:
        return 0.0, 0
    dense, gathered, calls = 0, 0.0, 0
    for v, rows in zip(model.trainable_variables, embedding_rows(model, replica_batch),
                       strict=True):
        size = int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
        if rows:
            row_bytes = size // v.shape[0] + 4
            gathered += ring_bytes("all_gather", rows * row_bytes + 4, world_size)
            calls += 3
        else:
            dense += size
    calls += int(dense > 0)
    return ring_bytes("all_reduce", dense, world_size) + gathered, calls
