"""The engines `tfdist train` runs a config on: one class per `engine.name`.

A `JobEngine` says how the processes of a job train: the tf.distribute strategy (if any) and the
`tfdist.comm.Engine` each process runs on, which config sections combine with it (checked before
training starts), the optimizer around the config's Keras optimizer, and how the global batches
reach `fit`. The built-in ones are below; the names are the launch layouts a config picks
(`mirrored`: the devices of one process, `multi_worker`: TF_CONFIG workers, ...), each running on
one of the library's engines (`tfdist.comm`: distribute, horovod, local, parameter servers).

An engine of your own is one file: a `tfdist.comm.Engine` subclass (the collectives) and a
`JobEngine` subclass that makes it, named in a config by its import path
(`tfdist train --set engine.name=my_engine:MyJob`) or registered with `@register("name")` in a
module imported first:

    class MyJob(JobEngine):
        def make(self, config):
            return None, MyEngine()      # (strategy or None, tfdist engine)

This module imports TensorFlow only inside methods (`make`, `optimizer`, and a `check` that asks
the library's own rules), so looking an engine up stays fast; a config's values are checked
against the schema before any of them runs.
"""

from __future__ import annotations

from typing import Any, ClassVar

from tfdist.registry import Registry

Config = dict[str, dict[str, Any]]


class JobEngine:
    """How `tfdist train` runs one `engine.name` (see the module docstring).

    Attributes:
        devices_are_replicas: Each process trains `engine.devices` replicas (the global batch
            must divide by them).
        asynchronous: The optimizer pushes to others instead of all-reducing, and counts what it
            sends itself (no `CommunicationStats`; the step is not compiled with XLA).
        tfdist_optimizer: The step runs through a tfdist optimizer that all-reduces: it checks
            the reduced gradients (`optimizer.nan_policy: skip`) and `CommunicationStats` reads
            its counters.
        counts_bytes: The optimizer counts the bytes it sends (else the summary gives the
            formula of Keras' own all-reduce).
    """

    devices_are_replicas: ClassVar[bool] = False
    asynchronous: ClassVar[bool] = False
    tfdist_optimizer: ClassVar[bool] = True
    counts_bytes: ClassVar[bool] = True

    def check(self, config: Config) -> list[str]:
        """What the config may not combine with this engine: one message per problem, each
        naming the key and the fix. Runs before training starts, after the schema's checks;
        where the library has the rule, ask it (as `ParameterServer.check` does) rather than
        restating it."""
        return []

    def make(self, config: Config) -> tuple[Any, Any]:
        """(the tf.distribute strategy or None, the `tfdist.comm.Engine`) this process trains
        on. A ValueError says what is missing (e.g. TF_CONFIG)."""
        raise NotImplementedError(f"{type(self).__name__}.make")

    def optimizer(self, engine, inner, config: Config):
        """The optimizer around `inner` (the config's Keras optimizer), or None for tfdist's
        own from the config (`DistributedOptimizer`, or `ZeroOptimizer` with
        `optimizer.zero_stage`)."""
        return None

    def feed(self, job, batches, warmup_epochs: float) -> tuple[Any, list]:
        """(what `fit` reads, the callbacks that go with it) from `batches()`, the global
        batches; a learning-rate warm-up over `warmup_epochs` when > 0. By default the
        strategy distributes them, or the process reads them all."""
        from tfdist.callbacks import LearningRateWarmup
        from tfdist.data import distribute_batches

        warmup = [LearningRateWarmup(warmup_epochs)] if warmup_epochs else []
        if job.strategy is None:
            return batches(), warmup
        return distribute_batches(job.strategy, batches), warmup


ENGINES: Registry[JobEngine] = Registry("engine", JobEngine)
register = ENGINES.register


def make_compressor(section: dict[str, Any]):
    """The compressor a validated `compression` section describes (None for "none")."""
    from tfdist import compression

    if section["name"] == "none" and not section["error_feedback"]:
        return None
    return compression.get({"name": section["name"], **section["options"],
                            "error_feedback": section["error_feedback"]})


@register("single")
class Single(JobEngine):
    """One process, one device: the engine of a world of one."""

    def make(self, config):
        from tfdist.comm import LocalEngine

        return None, LocalEngine()


@register("mirrored")
class Mirrored(JobEngine):
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
        import os

        import tfdist
        from tfdist.comm import DistributeEngine

        if "TF_CONFIG" not in os.environ:
            raise ValueError("TF_CONFIG is not set: start the workers with `python -m "
                             "tfdist.launch --workers N -- tfdist train ...` (or set TF_CONFIG).")
        strategy = tfdist.MultiWorkerMirroredStrategy(
            timeout_seconds=config["engine"]["timeout_seconds"],
            step_logs=config["engine"]["step_logs"] or self.step_logs)
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

    def optimizer(self, engine, inner, config):
        return inner


@register("horovod")
class Horovod(JobEngine):
    """One process per `horovodrun` rank: the Horovod engine."""

    def make(self, config):
        import tfdist.horovod as thvd
        from tfdist.comm import resolve

        hierarchical = config["averaging"]["intra_period"] is not None
        thvd.init(process_sets="dynamic" if hierarchical else None,
                  cycle_ms=config["engine"]["horovod_cycle_ms"],
                  pack=config["engine"]["horovod_pack"])
        return None, resolve()

    def feed(self, job, batches, warmup_epochs):
        import tfdist.horovod as thvd
        from tfdist.data import shard_batches

        callbacks = [thvd.callbacks.BroadcastGlobalVariables(0), thvd.callbacks.MetricAverage()]
        if warmup_epochs:
            callbacks.append(thvd.callbacks.LearningRateWarmup(warmup_epochs))
        return shard_batches(batches(), job.rank, job.world_size), callbacks


@register("parameter_server")
class ParameterServer(JobEngine):
    """TF_CONFIG `ps` and `worker` tasks: workers push gradients to the parameter servers
    (`engine.staleness`: synchronous, bounded or asynchronous)."""

    asynchronous = True
    tfdist_optimizer = False

    def check(self, config):
        comp, opt, train = config["compression"], config["optimizer"], config["train"]
        extras = [name for name, on in (
            ("compression.name: auto", comp["name"] == "auto"),
            ("compression.name: randomk", comp["name"] == "randomk"),
            ("averaging.period", config["averaging"]["period"] is not None),
            ("optimizer.zero_stage", opt["zero_stage"] is not None),
            ("optimizer.accumulation_steps", opt["accumulation_steps"] > 1),
            ("train.resize_policy", train["resize_policy"] is not None)) if on]
        errors = []
        if extras:
            errors.append(f"engine.name: 'parameter_server' pushes each worker's gradients "
                          f"(plain or compressed) to the servers; {', '.join(extras)} do(es) "
                          "not combine with it: use a compressor the servers can decompress "
                          "alone (not auto or randomk), and leave averaging.period null, "
                          "optimizer.zero_stage null, optimizer.accumulation_steps 1 and "
                          "train.resize_policy null")
        from tfdist.ps.server import check_delay_compensation

        try:  # the servers' own rule
            check_delay_compensation(config["engine"]["delay_compensation"],
                                     config["engine"]["staleness"])
        except ValueError as e:
            errors.append(f"engine.delay_compensation: {e} (engine.staleness in a config)")
        if train["precision"] == "mixed_float16":
            errors.append("train.precision: 'mixed_float16' needs loss scaling, which "
                          "parameter-server training does not do; use float32 or mixed_bfloat16")
        return errors

    def make(self, config):
        from tfdist.ps import ParameterServerEngine

        return None, ParameterServerEngine()

    def optimizer(self, engine, inner, config):
        from tfdist.ps import ParameterServerOptimizer

        comp = config["compression"]
        return ParameterServerOptimizer(float(inner.learning_rate), cluster=engine.cluster,
                                        compressor=make_compressor(comp),
                                        min_compress_size=comp["min_size"],
                                        compress_1d=comp["compress_1d"])


@register("hogwild")
class Hogwild(JobEngine):
    """One process, `engine.devices` replicas updating shared weights without locks."""

    devices_are_replicas = True
    asynchronous = True
    tfdist_optimizer = False

    def check(self, config):
        comp, opt, train = config["compression"], config["optimizer"], config["train"]
        extras = [name for name, on in (
            ("optimizer.name other than sgd", opt["name"] != "sgd"),
            ("optimizer.momentum", bool(opt["momentum"])),
            ("optimizer.weight_decay", bool(opt["weight_decay"])),
            ("compression.name", comp["name"] != "none" or comp["error_feedback"]),
            ("averaging.period", config["averaging"]["period"] is not None),
            ("optimizer.zero_stage", opt["zero_stage"] is not None),
            ("optimizer.accumulation_steps", opt["accumulation_steps"] > 1),
            ("train.checkpoint_steps", bool(train["checkpoint_steps"])),
            ("train.resize_policy", train["resize_policy"] is not None),
            ("train.precision: mixed_float16", train["precision"] == "mixed_float16")) if on]
        if not extras:
            return []
        return [f"engine.name: 'hogwild' is plain SGD whose replicas update shared weights "
                f"without locks; {', '.join(extras)} do(es) not combine with it: use "
                "optimizer.name sgd with momentum 0 and weight_decay 0, no compression, "
                "averaging, ZeRO, accumulation, checkpoints or resize policy, and float32 or "
                "mixed_bfloat16"]

    def make(self, config):
        from tfdist.comm import DistributeEngine
        from tfdist.devices import local_devices
        from tfdist.ps import HogwildStrategy

        strategy = HogwildStrategy(local_devices(config["engine"]["devices"]))
        return strategy, DistributeEngine(strategy)

    def optimizer(self, engine, inner, config):
        from tfdist.ps import HogwildSGD

        return HogwildSGD(float(inner.learning_rate))
