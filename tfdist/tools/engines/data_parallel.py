"""Synchronous data parallelism on tf.distribute: one device, a process' devices, TF_CONFIG
workers."""

from __future__ import annotations

import os

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
