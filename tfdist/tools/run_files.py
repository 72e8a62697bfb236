"""A run's files: its directory under `train.output_dir`, its backups, and the end of both.

Each run gets a directory of its own under `train.output_dir` (named by `train.run_name`, by
default the run's start time), which the chief fills: `config.yaml` (the resolved config),
`summary.json`, `model.keras` (the trained model, loadable in plain Keras) and `tensorboard/`.
A directory that holds a finished run is never written again. With `train.checkpoint_steps`,
`train.output_dir/backup` holds the backups of the run being trained (`backup/run` names it),
and the same command continues that run in its own directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import keras
import yaml

from tfdist.callbacks import BackupAndRestore
from tfdist.callbacks.backup import remove_folder
from tfdist.tools.errors import ConfigError

SUMMARY, MODEL, CONFIG, TENSORBOARD = "summary.json", "model.keras", "config.yaml", "tensorboard"
BACKUP, RUN_FILE = "backup", "run"  # train.output_dir/backup/run: the run being backed up


ON_NOTICE_ONLY = 2**62  # steps between periodic backups: never; a notice backs up at once


def _say_nothing_saved(signals: list[str]) -> None:
    """Installs handlers of `signals` that say in one line that nothing is saved, then end the
    process as the signal would have."""
    import signal
    import threading

    def said(number, frame):
        print(f"[tfdist] {signal.Signals(number).name} received: nothing is saved (this job "
              "has several processes and no train.checkpoint_steps); set "
              "train.checkpoint_steps to back up and resume after a notice", file=sys.stderr,
              flush=True)
        signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)

    if threading.current_thread() is threading.main_thread():
        for name in signals:
            signal.signal(getattr(signal, name), said)


def backup_directory(config: dict[str, Any]) -> Path:
    """`train.output_dir/backup`: where a job's backups go (train.checkpoint_steps)."""
    return Path(config["train"]["output_dir"]) / BACKUP


def run_directory(config: dict[str, Any]) -> Path:
    """Where the run's files go: `train.output_dir` / `train.run_name` (default: the start time,
    with a suffix if taken). A name that holds a finished run is refused. With
    `train.checkpoint_steps`, an unfinished run backed up in `train.output_dir/backup` is
    continued in its own directory."""
    parent = Path(config["train"]["output_dir"])
    unfinished = backed_up_run(config)
    if unfinished is not None:
        return unfinished
    name = config["train"]["run_name"]
    if name is not None:
        path = parent / name
        if (path / SUMMARY).exists():
            raise ConfigError(f"train.run_name: {path} holds a finished run ({SUMMARY}); choose "
                              "another name, remove it, or leave train.run_name null for a new "
                              "directory per run.")
        return path
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = parent / stamp, 1
    while path.exists():
        n += 1
        path = parent / f"{stamp}-{n}"
    return path


def clear_finished_backups(config: dict[str, Any]) -> None:
    """Removes backups left in `train.output_dir/backup` by a run that finished (stopped after
    its summary was written, before its backups were removed): they must not resume the next
    run. Called by the chief before anything else reads them."""
    directory = backup_directory(config)
    try:
        finished = Path((directory / RUN_FILE).read_text().strip())
    except (OSError, UnicodeDecodeError):
        return
    if not (finished / SUMMARY).exists():
        return
    print(f"[tfdist] removing the backups left by the finished run {finished}", file=sys.stderr,
          flush=True)
    for path in directory.glob("process-*"):
        remove_folder(path)
    (directory / RUN_FILE).unlink(missing_ok=True)


def backed_up_run(config: dict[str, Any]) -> Path | None:
    """The unfinished run whose backups `train.output_dir/backup` holds, if any (periodic ones,
    train.checkpoint_steps, or one a termination notice made)."""
    record = backup_directory(config) / RUN_FILE
    try:
        path = Path(record.read_text().strip())
    except (OSError, UnicodeDecodeError):
        return None
    return None if (path / SUMMARY).exists() or not path.name else path


class RunFiles:
    """The chief writes the run directory; other processes write only what the chief's save
    needs of them (a ZeRO model gathers every process's shards), to a temporary directory
    removed as soon as the save is done."""

    def __init__(self, path: Path, chief: bool):
        self.path = path
        self.chief = chief

    def start(self, config: dict[str, Any]) -> None:
        if self.chief:
            self.path.mkdir(parents=True, exist_ok=True)
            (self.path / CONFIG).write_text(yaml.safe_dump(config, sort_keys=False))

    def save_model(self, model: keras.Model) -> Path:
        """Every process saves (a multi-process save may gather); the chief's file is kept,
        written whole or not at all (a temporary name, then renamed). Returns its path."""
        target = self.path / MODEL
        if not self.chief:
            with tempfile.TemporaryDirectory(prefix="tfdist-run-") as scratch:
                model.save(Path(scratch) / MODEL)
            return target
        partial = target.with_name(f".partial-{MODEL}")
        model.save(partial)
        os.replace(partial, target)
        return target

    def finish(self, summary: dict[str, Any]) -> None:
        """Writes summary.json (whole or not at all): from then on the run is finished."""
        if self.chief:
            partial = self.path / f".partial-{SUMMARY}"
            with open(partial, "w") as f:
                f.write(json.dumps(summary, indent=2))
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial, self.path / SUMMARY)


class Run:
    """This process' part of one run's files: the directory (`path`; the chief writes it), the
    backups (`backup`), summary.json (`finish`), then the backups' removal (`remove_backups`)."""

    def __init__(self, config: dict[str, Any], chief: bool, micro_batch: int):
        if chief:
            clear_finished_backups(config)
        self.config, self.chief, self.micro_batch = config, chief, micro_batch
        self.path = run_directory(config)
        self.files = RunFiles(self.path, chief)
        self.backed_up: BackupAndRestore | None = None

    def keep_backups(self, always: bool = False) -> Path | None:
        """`train.output_dir/backup`, which the chief makes and marks as this run's: with
        train.checkpoint_steps (or `always`), else None."""
        if not (self.config["train"]["checkpoint_steps"] or always):
            return None
        directory = backup_directory(self.config)
        if self.chief:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / RUN_FILE).write_text(str(self.path))
        return directory

    def backup(self, one_process: bool) -> BackupAndRestore | None:
        """The run's `BackupAndRestore`: every train.checkpoint_steps steps, or, for a job of
        `one_process`, only on a termination notice (train.preemption_signals: backed up at the
        step in flight, exit 76, the same command resumes). A job of several processes without
        train.checkpoint_steps has none (agreeing on a notice's step would cost a collective
        every step): a notice then says in one line that nothing was saved."""
        train = self.config["train"]
        every, signals = train["checkpoint_steps"], train["preemption_signals"]
        if not every and not (one_process and signals):
            if signals:
                _say_nothing_saved(signals)
            return None
        directory = self.keep_backups(always=True)
        requeue = os.environ.get("TFDIST_REQUEUE") == "1" and os.environ.get("SLURM_JOB_ID")
        self.backed_up = BackupAndRestore(
            directory, save_freq=every or ON_NOTICE_ONLY,
            # Under `python -m tfdist.launch --elastic` the job may come back with fewer workers.
            elastic=os.environ.get("TFDIST_ELASTIC") == "1",
            # Periodic backups stay until the run is finished (`remove_backups`); a
            # notice-only one has nothing to keep once training ended.
            delete_checkpoint=not every,
            job=job_identity(self.config), preemption_signals=signals,
            on_preempted=_requeue if requeue else None)
        return self.backed_up

    def finish(self, summary: dict[str, Any]) -> None:
        """Writes summary.json (whole or not at all): from then on the run is finished."""
        self.files.finish(summary)

    def remove_backups(self) -> None:
        """Once the run is finished: its backups go (a run stopped before this removes them
        at its next start, `clear_finished_backups`)."""
        if self.backed_up is not None:
            self.backed_up.remove()
        if (self.config["train"]["checkpoint_steps"] or self.backed_up is not None) \
                and self.chief:
            (directory := backup_directory(self.config)).joinpath(RUN_FILE).unlink(
                missing_ok=True)
            with contextlib.suppress(OSError):
                directory.rmdir()  # the last process out removes it


def _requeue(step: int) -> None:
    """After a preemption backup (`python -m tfdist.launch --slurm --requeue`): puts this SLURM
    job back in the queue, where it starts again and resumes from the backup of `step`."""
    job = os.environ["SLURM_JOB_ID"]
    # Said first: SLURM ends the job's tasks as soon as it takes the job back, this one with them.
    print(f"[tfdist] requeueing SLURM job {job}: it resumes from the backup of step {step}",
          file=sys.stderr, flush=True)
    done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True,
                          timeout=60)
    if done.returncode:
        print(f"[tfdist] could not requeue SLURM job {job} ({done.stderr.strip()}); submit it "
              "again to resume", file=sys.stderr, flush=True)


# Config keys a resumed run may change: they decide neither the data order nor the state.
CARRIED_OVER = frozenset({
    "train.epochs", "train.verbose", "train.evaluate_each_epoch", "train.save_model",
    "train.checkpoint_steps", "train.preemption_signals", "train.output_dir", "train.run_name",
    "train.resize_policy", "train.resize_every", "engine.devices", "engine.timeout_seconds",
    "engine.heartbeat_seconds",
    "engine.step_logs"})


def job_identity(config: dict[str, Any]) -> dict[str, Any]:
    """The config values a backup belongs to (every key but `CARRIED_OVER`; the number of
    workers and replicas is checked by the backup itself)."""
    return {f"{section}.{key}": value for section, values in config.items()
            for key, value in values.items() if f"{section}.{key}" not in CARRIED_OVER}
