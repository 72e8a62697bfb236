"""Runs one training job from a validated config (what `tfdist train` does).

One generic sequence over the config's engine (`tfdist.tools.engines`), which owns every step
that differs between engines: its processes' roles and serving, the model's wrapping, the
optimizer, where a run resumes, how the global batches reach `fit`, its callbacks and its part
of the summary. The rest is common: what the config trains (`tfdist.tools.workload`), the run's
files and backups (`tfdist.tools.run_files`), and what the run measures of itself
(`tfdist.tools.report`).

Each run gets a directory of its own under `train.output_dir`, which the chief fills:
`config.yaml`, `summary.json`, `model.keras` (the trained model, loadable in plain Keras) and
`tensorboard/`.
"""

from __future__ import annotations

import time
from typing import Any

import keras

from tfdist.callbacks import BackupError
from tfdist.tools import epilogue
from tfdist.tools.engines import ENGINES, JobEngine
from tfdist.tools.errors import ConfigError
from tfdist.tools.report import RunReport
from tfdist.tools.run_files import SUMMARY, Run
from tfdist.tools.workload import Workload


def start_job(config: dict[str, Any]) -> JobEngine:
    """The config's engine, started in this process (its strategy and `tfdist.comm.Engine`)."""
    name = config["engine"]["name"]
    try:
        return ENGINES.lookup(name)().start(config)
    except ConfigError:  # the processes' configs differ (JobEngine.agree)
        raise
    except (ValueError, ImportError) as e:  # ImportError: Horovod not built here, say
        raise ConfigError(f"engine.name is {name!r}: {e}") from None


def train(config: dict[str, Any], progress: bool = True) -> dict[str, Any]:
    """Trains as `config` says; returns the run summary, which the chief also writes, with the
    model and the config, to the run directory (`summary["run_dir"]`). A process of another
    role (a parameter server) returns its report; an engine may end a process' part early
    (`JobEngine.run`). A notice once training is over lets the run finish
    (`tfdist.tools.epilogue`)."""
    started = time.time()
    try:
        job = start_job(config)
        return job.run(lambda: _run(config, job, progress, started))
    finally:
        epilogue.end()
        keras.config.set_dtype_policy("float32")


def _run(config: dict[str, Any], job: JobEngine, progress: bool,
         started: float) -> dict[str, Any]:
    work = Workload(config, job.world_size)
    job.agree(work.data.facts())
    if job.role != "worker":
        return job.serve(work)
    run = Run(config, job.is_chief, work.micro_batch)
    with job.scope():
        model = job.wrap_model(work.model())
        optimizer = job.optimizer(work.inner_optimizer())
        work.compile(model, optimizer, **job.compile_options())
        job.prepare(model, optimizer)
    report = RunReport(config, work, run, job.is_chief, progress, started)
    run.files.start(config)  # the run directory appears once the job is known to be valid
    if job.is_chief and progress:
        print(f"run directory     {run.path}", flush=True)
    start, callbacks = job.resume(run, model, optimizer, work.steps)
    dataset, fed = job.feed(work.input(start), work.warmup_epochs, work.scale)
    try:
        with work.reading():
            history = model.fit(dataset, epochs=config["train"]["epochs"],
                                steps_per_epoch=work.steps, verbose=report.verbosity(),
                                callbacks=callbacks + fed + report.callbacks(job.callbacks()))
    except BackupError as e:
        raise ConfigError(f"{e} (train.output_dir holds the backups)") from None
    report.fitted()
    epilogue.begin(config["train"]["preemption_signals"])
    with work.reading():
        evaluation = work.evaluate(model)
    summary = report.summary(history, evaluation, job)
    summary.update(job.report(model, optimizer, work.steps * config["train"]["epochs"],
                              work.micro_batch, str(run.path)))
    if config["train"]["save_model"]:
        model = job.plain_model(model, work.model)
        # model.keras carries a fresh Keras optimizer of the run's class and settings (its
        # state is in the backups), the run's loss and metrics: plain Keras loads it.
        with job.scope():
            work.compile(model, work.inner_optimizer())
        run.files.save_model(model)
    run.finish(summary)  # the run's results are safe: now its backups may go
    run.remove_backups()
    if job.is_chief:
        summary["summary_path"] = str(run.path / SUMMARY)
    return summary
