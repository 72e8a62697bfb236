"""What a run measures of itself while it trains, and the summary it ends with.

`RunReport` makes the callbacks every engine's run gets (step times, the cores busy, the global
batches per epoch, the profiled step, the test set after each epoch, TensorBoard's scalars) and
turns what they saw into summary.json's common part; the engine adds its own
(`JobEngine.report`: bytes sent, optimizer state, its servers' figures).
"""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import tfdist
from tfdist.callbacks import ScalarLog, StepTimeline, StepTimer
from tfdist.tools.cpu_load import MachineLoad
from tfdist.tools.errors import ConfigError
from tfdist.tools.run_files import MODEL, TENSORBOARD, Run
from tfdist.tools.workload import EpochEvaluation, Workload

STEP_SPANS_KEPT = 1000  # the steps whose begin and end a run's summary keeps


class RunReport:
    """The callbacks that watch one run (`callbacks`) and the summary made of what they saw
    (`summary`)."""

    def __init__(self, config: dict[str, Any], work: Workload, run: Run, chief: bool,
                 progress: bool, started: float):
        self.config, self.work, self.run = config, work, run
        self.chief, self.progress = chief, progress
        self.started = started  # when `train` was called (time.time())
        self.trained: float | None = None  # when `fit` returned
        self.timeline = _timeline(config, run.path, work.steps, chief)
        self.timer, self.counter, self.load = StepTimer(), BatchCounter(), MachineLoad()
        self.evaluation = (EpochEvaluation(work.data, self.timer, config, announce=chief)
                           if config["train"]["evaluate_each_epoch"] else None)

    def callbacks(self, engines: list) -> list[keras.callbacks.Callback]:
        """The watching callbacks around the engine's own (`engines`): the profiler first (its
        start and stop are not timed), the evaluation and the scalars last (they log what the
        others added)."""
        out: list[keras.callbacks.Callback] = [self.timeline] if self.timeline else []
        out += [self.timer, self.load, self.counter, *engines]
        out += [self.evaluation] if self.evaluation is not None else []
        out += [ScalarLog(str(self.run.path / TENSORBOARD))] if self.chief else []
        return out

    def verbosity(self) -> int:
        """Keras' progress bar on a terminal, one line per epoch otherwise (logs, the
        launcher); nothing but on the chief."""
        if not (self.chief and self.progress):
            return 0
        verbose = self.config["train"]["verbose"]
        return (1 if sys.stdout.isatty() else 2) if verbose is None else verbose

    def fitted(self) -> None:
        """`fit` has returned: the training time ends here."""
        self.trained = time.time()

    def summary(self, history, tested: dict[str, float], job) -> dict[str, Any]:
        """summary.json's common part, after `fit` returned `history` and the test set gave
        `tested`; `job` names the engine and the world."""
        backup, metrics = self.run.backed_up, self.work.metrics
        restored = backup.restored if backup is not None else None
        # The last epoch's logs; a run resumed at its end trains nothing: the backup's.
        last = ({k: v[-1] for k, v in history.history.items() if v} or
                dict((restored or {}).get("epoch_logs") or {}))
        timer = self.timer
        return {
            "engine": job.name,
            "world_size": job.world_size,
            "run_dir": str(self.run.path),
            "test_loss": tested["loss"],
            # The test set's metrics (train.metrics, or the task's); test_accuracy when measured.
            "test_metrics": {name: tested[name] for name in metrics},
            "test_accuracy": tested.get("accuracy"),
            "test_examples": self.work.test_examples(),
            "final_train_loss": last.get("loss"),
            "final_train_metrics": {name: last.get(name) for name in metrics},
            "final_train_accuracy": last.get("accuracy"),
            "steps": self.work.steps * self.config["train"]["epochs"],
            "train_seconds": round((self.trained or time.time()) - self.started, 2),
            "startup_seconds": _startup(self.started, timer),
            # Median over all steps but the first epoch's first (tracing) step.
            "step_ms_median": 1000 * float(np.median(timer.times[1:] or timer.times)),
            # The first steps' [begin, end] (time.time(); at most STEP_SPANS_KEPT): which steps
            # of hosts sharing a clock ran at the same time (the benches' zero-communication
            # limit).
            "step_spans": [[b, b + t] for b, t in
                           zip(timer.began[:STEP_SPANS_KEPT], timer.times[:STEP_SPANS_KEPT])],
            # The machine's cores busy during each epoch's steps after its first (all
            # processes; None without /proc/stat).
            "machine_load": self.load.summary(),
            # train.profile_step's timeline (timeline.json holds its ops' intervals), or None.
            "timeline": _timeline_summary(self.timeline, self.run.path),
            "epoch_log": self.evaluation.log if self.evaluation else None,
            # Global batches the run resumed after (train.checkpoint_steps), or None; the
            # examples trained on in each epoch, all workers, across restarts.
            "resumed_from_step": restored["consumed"] if restored else None,
            # data.name records: the records this process read (its slice of each batch, the
            # prefetch; after a resume, nothing before the resumed step), else None.
            "records_read": (self.work.data.train.records_read if self.work.data.records
                             else None),
            "examples_per_epoch": [b * self.work.micro_batch for b in (
                backup.batches_per_epoch if backup is not None
                else self.counter.batches_per_epoch)],
            "model_path": (str(self.run.path / MODEL) if self.config["train"]["save_model"]
                           else None),
            "versions": {"tfdist": tfdist.__version__, "tensorflow": tf.__version__,
                         "keras": keras.__version__, "python": platform.python_version()},
            "config": self.config,
        }


class BatchCounter(keras.callbacks.Callback):
    """Global batches trained on in each epoch (steps x steps_per_execution)."""

    def __init__(self):
        super().__init__()
        self.batches_per_epoch: list[int] = []

    def on_epoch_begin(self, epoch, logs=None):
        self.batches_per_epoch.append(0)

    def on_train_batch_end(self, batch, logs=None):
        self.batches_per_epoch[-1] = batch + 1


def _process_start() -> float | None:
    """When this process started (`time.time()` scale; Linux's /proc, else None)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _startup(started: float, timer: StepTimer) -> dict[str, float | None]:
    """Where the time before the second step went (seconds): `before_train` from the process'
    start to `train` (interpreter, imports, config; None where /proc is missing), `setup` to
    `fit` (cluster, data, model, compile), `fit_before_first_step` (the dataset's iterator,
    callbacks), `first_step` (tracing, first collectives), and their `total`."""
    process = _process_start()
    parts = {
        "before_train": None if process is None else max(started - process, 0.0),
        "setup": (timer.fit_began or started) - started,
        "fit_before_first_step": ((timer.first_step_began or 0.0) - (timer.fit_began or 0.0)
                                  if timer.first_step_began else None),
        "first_step": timer.times[0] if timer.times else None,
    }
    rounded: dict[str, float | None] = {k: None if v is None else round(v, 3)
                                        for k, v in parts.items()}
    rounded["total"] = round(sum(v for v in parts.values() if v is not None), 3)
    return rounded


def _timeline(config: dict[str, Any], run_dir: Path, steps: int,
              chief: bool) -> StepTimeline | None:
    """train.profile_step's callback, on the chief; refuses a step past the run's end."""
    step = config["train"]["profile_step"]
    if step is None:
        return None
    total = steps * config["train"]["epochs"]
    if step > total:
        raise ConfigError(f"train.profile_step: {step} is past the run's last step ({total} = "
                          f"{steps} steps x {config['train']['epochs']} epochs); use at most "
                          f"{total}.")
    return StepTimeline(step, str(run_dir)) if chief else None


def _timeline_summary(timeline: StepTimeline | None, run_dir: Path) -> dict | None:
    """The profiled step's figures for summary.json; draws timeline.png beside timeline.json."""
    if timeline is None or timeline.result is None:
        return None
    from tfdist.tools.bench.plots import timeline as draw

    draw(timeline.result, run_dir / "timeline.png",
         title=f"step {timeline.step} on the chief")
    return {k: v for k, v in timeline.result.items() if k not in ("intervals", "collectives")}
