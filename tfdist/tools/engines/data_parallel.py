"""Synchronous data parallelism on tf.distribute: one device, a process' devices, TF_CONFIG
workers, and plain Keras' own exchange (the baseline the benchmarks measure tfdist against)."""

from __future__ import annotations

import os

import numpy as np

from tfdist.tools.engines.base import JobEngine, register


def tf_config_tasks() -> int:
    """How many tasks this process' TF_CONFIG names (0 without one)."""
    import json

    try:
        cluster = json.loads(os.environ.get("TF_CONFIG") or "{}").get("cluster", {})
    except (ValueError, AttributeError):
        return 0
    return sum(len(tasks) for tasks in cluster.values()) if isinstance(cluster, dict) else 0


class OneProcess(JobEngine):
    """An engine whose job is this one process: refused where TF_CONFIG makes this process one
    of several (`python -m tfdist.launch --workers N`), which would train N jobs alone."""

    def start(self, config):
        tasks = tf_config_tasks()
        if tasks > 1:
            raise ValueError(
                f"it trains in one process, but TF_CONFIG makes this process one of {tasks} "
                "tasks (python -m tfdist.launch): each would train a job of its own. Set "
                "engine.name=multi_worker for TF_CONFIG workers (parameter_server with ps "
                "tasks), or unset TF_CONFIG to train in this process alone")
        return super().start(config)


@register("single")
class Single(OneProcess):
    """One process, one device: the engine of a world of one."""

    def make(self, config):
        from tfdist.comm import LocalEngine

        return None, LocalEngine()


@register("mirrored")
class Mirrored(OneProcess):
    """One process, `engine.devices` devices: `tf.distribute.MirroredStrategy`."""

    devices_are_replicas = True

    def make(self, config):
        import tensorflow as tf

        from tfdist.comm import DistributeEngine
        from tfdist.devices import local_devices

        strategy = tf.distribute.MirroredStrategy(local_devices(config["engine"]["devices"]))
        return strategy, DistributeEngine(strategy)


@register("multi_worker")
class MultiWorker(JobEngine):
    """One process per TF_CONFIG worker: `tfdist.MultiWorkerMirroredStrategy`."""

    step_logs = "local"  # `engine.step_logs` when null

    def make(self, config):
        import tfdist
        from tfdist.comm import DistributeEngine

        if "TF_CONFIG" not in os.environ:
            raise ValueError("TF_CONFIG is not set: start the workers with `python -m "
                             "tfdist.launch --workers N -- tfdist train ...` (or set TF_CONFIG).")
        strategy = tfdist.MultiWorkerMirroredStrategy(
            timeout_seconds=config["engine"]["timeout_seconds"],
            step_logs=config["engine"]["step_logs"] or self.step_logs,
            heartbeat_seconds=config["engine"]["heartbeat_seconds"])
        return strategy, DistributeEngine(strategy)


@register("keras_multi_worker")
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
        return [f"engine.name: 'keras_multi_worker' is plain Keras data parallelism (the "
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
