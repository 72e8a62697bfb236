"""`JobEngine`: one object per `engine.name` that owns its part of a `tfdist train` run.

The runner (`tfdist.tools.runner`) is one generic sequence; every step of it that differs
between engines is a method here, which an engine overrides:

    job = ENGINES.lookup(name)().start(config)      # make, and agree on the config (below)
    job.run(body):                                  # body, how this engine's job ends said plainly
        job.agree(workload.data.facts())            # every process loaded the same data
        if job.role != "worker": return job.serve(workload)
        with job.scope():
            model = job.wrap_model(workload.model())            # ZeRO-3 shards it
            optimizer = job.optimizer(workload.inner_optimizer(lr))
            model.compile(optimizer, **job.compile_options()); job.prepare(model, optimizer)
        start, callbacks = job.resume(run, model, optimizer, steps)   # backups, or the servers
        dataset, fed = job.feed(source, warmup)                 # how the global batches arrive
        model.fit(dataset, callbacks=callbacks + fed + job.callbacks())
        summary |= job.report(model, optimizer, steps_run)

The defaults below are synchronous data parallelism through a tfdist optimizer; this module
imports TensorFlow only inside methods, so looking an engine up (to check a config) stays fast.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import typing
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from tfdist.registry import Registry
from tfdist.tools.errors import ConfigError
from tfdist.tools.parts import make_offload, make_parts

Config = dict[str, dict[str, Any]]

# The keys the processes of one job may set differently: where each host keeps its files and
# reads the record set, and how much it prints. Every other key must be the same everywhere.
PER_PROCESS = ("data.path", "optimizer.offload_dir", "train.output_dir", "train.run_name",
               "train.verbose")


class JobEngine:
    """How `tfdist train` runs one `engine.name` (see the module docstring).

    Subclasses set `make` (required) and override the steps that differ. Two class attributes
    are facts the config's checks read before anything runs:

    Attributes:
        devices_are_replicas: Each process trains `engine.devices` replicas (the global batch
            must divide by them).
        tfdist_optimizer: The step runs through a tfdist optimizer that all-reduces: it checks
            the reduced gradients (`optimizer.nan_policy: skip`) and `CommunicationStats` reads
            its counters.
        counts_bytes: `exchanged` counts the bytes as they are sent (else it is a formula).
    """

    devices_are_replicas: ClassVar[bool] = False
    tfdist_optimizer: ClassVar[bool] = True
    counts_bytes: ClassVar[bool] = True

    @dataclasses.dataclass(frozen=True)
    class Options:
        """This engine's own options (`engine.options` in a config): a frozen dataclass whose
        fields have defaults and a type among bool, int, float, str (checked before anything
        runs). The built-in engines take none."""

    config: Config
    options: Any = None  # an `Options`, from `engine.options`
    strategy: Any = None  # the tf.distribute strategy, or None
    engine: Any = None  # the tfdist.comm.Engine this process trains on

    # -- before anything runs --------------------------------------------------------------------
    def check(self, config: Config) -> list[str]:
        """What the config may not combine with this engine: one message per problem, each
        naming the key and the fix. Runs before training starts, after the schema's checks;
        where the library has the rule, ask it (as the parameter servers do) rather than
        restating it."""
        return []

    def make(self, config: Config) -> tuple[Any, Any]:
        """(the tf.distribute strategy or None, the `tfdist.comm.Engine`) this process trains
        on. A ValueError says what is missing (e.g. TF_CONFIG)."""
        raise NotImplementedError(f"{type(self).__name__}.make")

    @classmethod
    def read_options(cls, given: dict[str, Any]):
        """`given` (a config's engine.options) as this engine's `Options`; a ValueError names
        the option and what it takes."""
        fields = {f.name: f for f in dataclasses.fields(cls.Options)}
        unknown = sorted(set(given) - set(fields))
        if unknown:
            takes = ", ".join(fields) or "none"
            raise ValueError(f"{cls.__name__} takes no option {', '.join(map(repr, unknown))}; "
                             f"it takes {takes}")
        hints = typing.get_type_hints(cls.Options)
        for name, value in given.items():
            kind = hints.get(name)
            wrong = kind in (bool, int, float, str) and (
                not isinstance(value, (int, float) if kind is float else kind)
                or (kind is not bool and isinstance(value, bool)))
            if wrong:
                raise ValueError(f"{cls.__name__}'s option {name!r} is a {kind.__name__}; got "
                                 f"{value!r}")
        try:
            return cls.Options(**given)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{cls.__name__}: {e}") from None

    def start(self, config: Config) -> JobEngine:
        """Reads this engine's options and makes this process' strategy and engine (`make`);
        returns self, now the job."""
        self.config = config
        self.options = self.read_options(config["engine"]["options"])
        self.strategy, self.engine = self.make(config)
        self.agree(_setup(config))
        return self

    def agree(self, setup: dict[str, str]) -> None:
        """Stops the job the same way on every process, before anything is built, where its
        processes differ in `setup` (what each says as text: its config but `PER_PROCESS`, and
        the versions it runs, when the engine is made; its data, once loaded): a ConfigError
        naming each key that differs and every process's value. One all-gather over the
        engine's collectives; an engine whose processes run none with each other overrides
        it."""
        differences = self.engine.setup_differences(setup)
        if differences:
            raise ConfigError(_differ(differences))

    # -- the job -----------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.config["engine"]["name"]

    @property
    def world_size(self) -> int:
        return self.engine.world_size

    @property
    def rank(self) -> int:
        return self.engine.process_index

    @property
    def is_chief(self) -> bool:
        return self.engine.is_chief

    @property
    def role(self) -> str:
        """What this process does: "worker" trains; any other role is `serve`d."""
        return "worker"

    def run(self, body: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Runs `body`, this process' whole part of the job, and returns its summary: where an
        engine turns the way its job ends (a peer's message, a notice) into the outcome."""
        return body()

    def serve(self, workload) -> dict[str, Any]:
        """A process of a role other than "worker" (`role`): serves the job until it is over;
        returns its report. `workload` builds the config's model and optimizer
        (`tfdist.tools.workload.Workload`)."""
        raise NotImplementedError(f"{type(self).__name__} has no role {self.role!r}")

    def scope(self):
        """Where the model and optimizer are made: the strategy's scope, if any."""
        return self.strategy.scope() if self.strategy is not None else contextlib.nullcontext()

    # -- the model and the optimizer -------------------------------------------------------------
    def wrap_model(self, model):
        """The model `fit` trains: with `optimizer.zero_stage: 3`, its parameters sharded over
        the replicas (`tfdist.zero.ShardedModel`)."""
        if self.config["optimizer"]["zero_stage"] != 3:
            return model
        from tfdist.zero import ShardedModel

        return ShardedModel(model)

    def plain_model(self, model, build: Callable[[], Any]):
        """The trained model as plain Keras holds it (model.keras): a sharded one gathered
        into `build()`, a fresh copy of the unsharded model."""
        from tfdist.zero import ShardedModel

        return model.load_into(build()) if isinstance(model, ShardedModel) else model

    def optimizer(self, inner):
        """The optimizer around `inner` (the config's Keras optimizer): a
        `DistributedOptimizer` of the config's parts, or a `ZeroOptimizer` with
        `optimizer.zero_stage`. The same classes serve every engine: the optimizer resolves its
        engine when built."""
        from tfdist.optimizers import DistributedOptimizer
        from tfdist.zero import ZeroOptimizer

        opt = self.config["optimizer"]
        if opt["zero_stage"] is None:
            return DistributedOptimizer(inner, *make_parts(self.config),
                                        loss_scale=opt["loss_scale"],
                                        nan_policy=opt["nan_policy"],
                                        fused_update=opt["fused_update"])
        return ZeroOptimizer(inner, stage=opt["zero_stage"],
                             accumulation_steps=opt["accumulation_steps"],
                             offload=make_offload(opt), nan_policy=opt["nan_policy"],
                             fused_update=opt["fused_update"])

    def compile_options(self) -> dict[str, Any]:
        """Keyword arguments of `model.compile` this engine needs (beyond the loss, metrics and
        optimizer)."""
        return {}

    def prepare(self, model, optimizer) -> None:
        """After compiling: what the optimizer must know of the model's non-trainable
        variables (local SGD averages them too; a skipped step leaves BatchNorm's statistics
        as they were)."""
        if getattr(optimizer, "averaging", None) is not None:
            optimizer.average_also(model.non_trainable_variables)
        if getattr(optimizer, "skips_steps", False) and model.non_trainable_variables:
            optimizer.skip_also(model.non_trainable_variables)

    # -- the run -----------------------------------------------------------------------------------
    def resume(self, run, model, optimizer, steps: int) -> tuple[Any, list]:
        """(where the data starts: a global batch or a function giving it once the backup is
        restored, the callbacks that keep the position): the run's backups
        (`run.backup`: train.checkpoint_steps, or a termination notice's in a job of one
        process), with the elastic ones they allow."""
        from tfdist.callbacks import ElasticJoin, ElasticResize

        backup = run.backup(one_process=not self.engine.multi_process)
        if backup is None:
            return 0, []
        callbacks = [backup]
        train = self.config["train"]
        if train["resize_policy"] == "throughput":
            callbacks.append(ElasticResize(backup, run.micro_batch, every=train["resize_every"]))
        if os.environ.get("TFDIST_ELASTIC") == "1":  # grows when the launcher offers workers
            callbacks.append(ElasticJoin(backup))
        return backup.data_start, callbacks

    def feed(self, source, warmup_epochs: float, scale: float) -> tuple[Any, list]:
        """(what `fit` reads, the callbacks that go with it) from `source`
        (`tfdist.tools.workload.Input`: the global batches, or a worker's slice of each); a
        learning-rate warm-up to `scale` times the rate over `warmup_epochs` when > 0. By
        default each of the strategy's input pipelines reads its slice, or the process reads
        every batch."""
        from tfdist.callbacks import LearningRateWarmup
        from tfdist.data import distribute_shards

        warmup = [LearningRateWarmup(warmup_epochs)] if warmup_epochs else []
        if self.strategy is None:
            return source.global_batches(), warmup
        return distribute_shards(self.strategy, source.shard), warmup

    def callbacks(self) -> list:
        """This engine's own callbacks, after the common ones: the tfdist optimizer's
        communication figures in the logs."""
        from tfdist.callbacks import CommunicationStats

        return [CommunicationStats()]

    # -- the report --------------------------------------------------------------------------------
    def exchanged(self, model, optimizer, steps: int, micro_batch: int) -> tuple[float, int, int]:
        """(bytes sent, exchanges, collective calls) by this process over `steps` steps: the
        optimizer's counters."""
        return (optimizer.bytes_sent, optimizer.communication_rounds,
                optimizer.collective_calls)

    def report(self, model, optimizer, steps: int, micro_batch: int,
               run_dir: str) -> dict[str, Any]:
        """This engine's part of summary.json: what it sent over the `steps` steps this process
        ran (global batches of `micro_batch` examples), against a dense all-reduce, and the
        optimizer's own figures."""
        from tfdist import compression
        from tfdist.comm import ring_bytes
        from tfdist.zero import ShardedModel

        unsharded = model.wrapped() if isinstance(model, ShardedModel) else model
        trainable = int(sum(np.prod(v.shape) for v in unsharded.trainable_weights))
        accumulation = self.config["optimizer"]["accumulation_steps"]
        dense = ring_bytes("all_reduce", 4 * trainable, self.world_size) / accumulation
        sent, rounds, calls = self.exchanged(unsharded, optimizer, steps, micro_batch)
        per_step = sent / max(steps, 1)
        return {
            "parameters": int(model.count_params()),
            "bytes_sent_total": sent,
            "bytes_sent_per_step": per_step,
            "bytes_counted": self.counts_bytes,
            "communication_rounds": rounds,
            # Collective calls per training step (= per gradient exchange when synchronous).
            "collectives_per_step": calls / max(steps, 1),
            "averaging_period": (optimizer.averaging_period
                                 if getattr(optimizer, "averaging", None) is not None else None),
            "trainable_parameters": trainable,
            "gradient_bytes_per_round": 4 * trainable,
            "compressor": compression.serialize(getattr(optimizer, "compressor", None)),
            "auto": _auto_report(optimizer),
            # Steps skipped whole for non-finite gradients (optimizer.nan_policy: skip).
            "nonfinite_steps_skipped": _skipped_steps(optimizer),
            "dense_bytes_per_step": dense,
            "bytes_ratio_vs_dense": per_step / dense if dense else None,
            "optimizer_state_bytes": _state_bytes(optimizer) if self.tfdist_optimizer else {},
        }


ENGINES: Registry[JobEngine] = Registry("engine", JobEngine)
register = ENGINES.register


def _setup(config: Config) -> dict[str, str]:
    """What every process of a job must have alike before it starts: the config's keys (but
    `PER_PROCESS`) and the versions of the software it runs."""
    import keras
    import tensorflow as tf

    from tfdist import __version__

    setup = {f"{section}.{key}": json.dumps(value, sort_keys=True)
             for section, values in config.items() for key, value in values.items()
             if f"{section}.{key}" not in PER_PROCESS}
    setup["the software"] = (f"tfdist {__version__}, tensorflow {tf.__version__}, keras "
                             f"{keras.__version__}, python {sys.version.split()[0]}")
    return setup


def _differ(differences: dict[str, dict[int, str]], shown: int = 4) -> str:
    """One line: each differing key (the first `shown`) with its values and the workers of
    each, and the fix."""
    said = []
    for key, values in list(differences.items())[:shown]:
        workers: dict[str, list[int]] = {}
        for worker, text in sorted(values.items()):
            workers.setdefault(text, []).append(worker)
        said.append(f"{key} is " + ", ".join(
            f"{text} on {_workers(ranks)}" for text, ranks in list(workers.items())[:3])
            + (", ..." if len(workers) > 3 else ""))
    more = f" (and {len(differences) - shown} more)" if len(differences) > shown else ""
    return f"the workers differ: {'; '.join(said)}{more}. {same_job('worker')}"


def same_job(task: str) -> str:
    """What to do where the processes of a job differ (`JobEngine.agree`)."""
    return (f"Give every {task} the same config file and --set values, tfdist and TensorFlow, "
            f"and data; only {', '.join(PER_PROCESS)} may differ (each host's own paths and "
            "output).")


def _workers(ranks: list[int], listed: int = 6) -> str:
    if len(ranks) == 1:
        return f"worker {ranks[0]}"
    names = ", ".join(map(str, ranks[:listed]))
    return f"workers {names}" + (f" and {len(ranks) - listed} more" if len(ranks) > listed
                                 else "")


def _state_bytes(optimizer) -> dict[str, int]:
    """Optimizer-state bytes per device (and host/disk when offloaded), as placed."""
    from tfdist.zero import memory_report

    return {device: kinds["optimizer_state"] for device, kinds in
            memory_report(optimizer).items() if kinds["optimizer_state"]}


def _skipped_steps(optimizer) -> int | None:
    """Steps the optimizer skipped for non-finite gradients, where it checks them."""
    from tfdist.optimizers import chain_of
    from tfdist.optimizers.nan_policy import NanPolicy
    from tfdist.zero import ZeroOptimizer

    if isinstance(optimizer, ZeroOptimizer):
        return optimizer.skipped_steps
    chain = chain_of(optimizer)
    policy = chain.part(NanPolicy) if chain is not None else None
    return policy.skipped_steps if policy is not None else None


def _auto_report(optimizer) -> dict[str, Any] | None:
    """compression.name auto: the exchange it picked, with the numbers it picked it on."""
    from tfdist.optimizers import AutoExchange, chain_of

    chain = chain_of(optimizer)
    auto = chain.part(AutoExchange) if chain is not None else None
    return auto.report() if auto is not None else None
