"""TF_CONFIG `ps` and `worker` tasks: workers push gradients to parameter servers
(`engine.staleness`: synchronous, bounded or asynchronous), which hold the weights, each
worker's step count and the checkpoints.

Everything of this way of running is here: the servers' serving (the `ps` role), a worker
joining them (a restarted worker goes on at the step the servers hold for it), the workers' own
checkpoints of their non-trainable variables, the end of the job told by the servers, and
termination notices (`tfdist.tools.ps_notices`).

Like every engine module, it imports TensorFlow only inside methods.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

from tfdist.tools.engines.base import JobEngine, register, same_job
from tfdist.tools.errors import ConfigError
from tfdist.tools.parts import make_compressor


@register("parameter_server")
class ParameterServer(JobEngine):
    """TF_CONFIG `ps` and `worker` tasks: workers push gradients to the parameter servers
    (`engine.staleness`: synchronous, bounded or asynchronous)."""

    tfdist_optimizer = False
    start_step = 0  # the step the servers held for this worker when it joined
    setup: dict = {}  # what this task must have alike with the others (`agree`)

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

    def agree(self, setup):
        """Kept for the servers: a worker gives its setup to each server when it joins, and a
        difference stops both in one line (`tfdist.ps.SetupMismatch`)."""
        self.setup = {**self.setup, **setup}

    @property
    def role(self):
        return "ps" if self.engine.cluster.is_ps else "worker"

    def run(self, body):
        """A task that ended after a notice exits as preempted; a worker that comes back after
        the job finished without it is told so by the servers and returns {"job_over": True}."""
        import tensorflow as tf

        from tfdist.ps.optimizer import SERVER_GONE
        from tfdist.ps.server import JOB_OVER
        from tfdist.tools import ps_notices as notices

        try:
            return body()
        except tf.errors.OpError as e:
            # A worker may see its servers go (they had the notice first) before its own
            # notice arrives: it waits for it a little.
            if notices.NOTICED.is_set() or (notices.LISTENING.is_set() and SERVER_GONE in str(e)
                                            and notices.NOTICED.wait(notices.NOTICE_WAIT)):
                notices.exit_preempted()
            if JOB_OVER not in str(e):
                raise
            said = re.search(re.escape(JOB_OVER) + r".*?\(update \d+\)", str(e))
            print(f"{said.group(0) if said else JOB_OVER}; exiting", flush=True)
            return {"job_over": True}

    # -- the ps role ---------------------------------------------------------------------------
    def serve(self, workload):
        """Builds the model as the workers do (same seed) and serves this task's shard of the
        variables, with the config's optimizer, until the workers are done."""
        from tfdist.ps import SetupMismatch, serve
        from tfdist.tools import epilogue
        from tfdist.tools import ps_notices as notices

        config, cluster = self.config, self.engine.cluster
        engine, comp = config["engine"], config["compression"]
        every = config["train"]["checkpoint_steps"]
        model = workload.model()
        self._listen(raising=True)
        try:
            report = serve(model, workload.inner_optimizer(
                               config["optimizer"]["learning_rate"] * workload.scale),
                           staleness=engine["staleness"], cluster=cluster,
                           worker_timeout=engine["worker_timeout"],
                           scale_lr_by_staleness=engine["scale_lr_by_staleness"],
                           delay_compensation=engine["delay_compensation"],
                           compressor=make_compressor(comp), min_compress_size=comp["min_size"],
                           compress_1d=comp["compress_1d"], checkpoint_dir=self._checkpoints(),
                           checkpoint_every=every, setup=self.setup)
            epilogue.begin(config["train"]["preemption_signals"])  # inside: a notice just before
        except notices.Notice:
            notices.exit_preempted()
        except SetupMismatch as e:
            raise ConfigError(f"{e}. {same_job('task')}") from None
        if every:  # the last task out removes train.output_dir/backup
            from tfdist.tools.run_files import backup_directory

            with contextlib.suppress(OSError):
                backup_directory(config).rmdir()
        return {"engine": self.name, "role": "ps", "task_index": cluster.task_index, **report}

    def _listen(self, raising: bool) -> None:
        """This task's answer to train.preemption_signals, with checkpoints
        (`tfdist.tools.ps_notices`)."""
        from tfdist.tools import ps_notices as notices

        if self.config["train"]["checkpoint_steps"]:
            notices.listen(self.config["train"]["preemption_signals"], raising)

    def _checkpoints(self) -> str | None:
        """Where the job's tasks checkpoint (train.checkpoint_steps), or None."""
        from tfdist.tools.run_files import backup_directory

        if not self.config["train"]["checkpoint_steps"]:
            return None
        return str(backup_directory(self.config) / "ps")

    # -- the worker role ------------------------------------------------------------------------
    def optimizer(self, inner):
        from tfdist.ps import ParameterServerOptimizer

        comp = self.config["compression"]
        return ParameterServerOptimizer(float(inner.learning_rate), cluster=self.engine.cluster,
                                        compressor=make_compressor(comp),
                                        min_compress_size=comp["min_size"],
                                        compress_1d=comp["compress_1d"], setup=self.setup)

    def compile_options(self):
        return {"jit_compile": False}  # the step calls the servers

    def resume(self, run, model, optimizer, steps):
        """Joins the servers now: a worker started again, or a job resumed from the servers'
        checkpoints, goes on at the step the servers hold for this worker."""
        from tfdist.callbacks import StartAt
        from tfdist.ps import SetupMismatch
        from tfdist.ps.checkpoint import WorkerCheckpoint
        from tfdist.tools import ps_notices as notices

        run.keep_backups()  # the servers checkpoint; the run directory is found again
        self.run_dir = run.path
        self._listen(raising=False)
        try:
            start = self.start_step = optimizer.join(model.trainable_variables)
        except SetupMismatch as e:
            raise ConfigError(f"{e}. {same_job('task')}") from None
        directory = self._checkpoints()
        callbacks = []
        own = (WorkerCheckpoint(directory, self.config["train"]["checkpoint_steps"], self.rank)
               if directory else None)
        if own is not None:
            own.set_model(model)
            callbacks.append(own)
        callbacks.append(notices.StopOnNotice())  # after `own`: the step in flight is saved
        if start:
            callbacks.append(StartAt(start, steps))
            restored = own is not None and own.restore(start)
            print(f"worker {self.rank}: resuming at step {start} (the parameter servers' count "
                  f"of its pushes); {'its' if restored else 'no'} checkpoint of the model's "
                  "non-trainable variables there", flush=True)
        return start, callbacks

    def feed(self, source, warmup_epochs, scale):
        """Each worker reads its slice of the global batches; the chief's FinishCallback
        collects the servers' report when the workers are done."""
        from tfdist.callbacks import LearningRateWarmup
        from tfdist.ps import FinishCallback
        from tfdist.tools.run_files import TENSORBOARD

        self.finish = FinishCallback(
            log_dir=str(Path(self.run_dir) / TENSORBOARD) if self.is_chief else None)
        callbacks = [self.finish]
        if warmup_epochs:
            callbacks.append(LearningRateWarmup(warmup_epochs, scale=scale))
        return source.shard(self.rank, self.world_size), callbacks

    def callbacks(self):
        return []  # the optimizer counts its pushes itself

    def report(self, model, optimizer, steps, micro_batch, run_dir):
        """A worker's counters start with this process (the servers held the rest): per-step
        figures are over the steps it ran; the servers' counters, seen from the chief at the
        end (staleness)."""
        return {**super().report(model, optimizer, steps - self.start_step, micro_batch,
                                 run_dir),
                "parameter_server": self.finish.report,
                "resumed_from_step": self.start_step or None}
