"""The 2-worker job that the preemption and kill -9 tests stop and start again, once per algorithm,
and how to read a finished run: one definition, so that every such test compares with the same
uninterrupted run (conftest's session fixture `uninterrupted` runs each algorithm once)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import keras

# 6 epochs of 12 steps of about 30 ms (tests/workers/slow_model.py): a notice or a kill lands
# mid-training. No periodic backup unless a test asks for one (train.checkpoint_steps 1000).
JOB = ["--set", "engine.name=multi_worker", "--set", "model.name=tests.workers.slow_model:build",
       "--set", "train.epochs=6", "--set", "train.steps_per_epoch=12",
       "--set", "train.checkpoint_steps=1000", "--set", "data.global_batch_size=32"]
# The state each one carries through a stop: the optimizer's; ZeRO's shards; local SGD's local
# models between averaging rounds; PowerSGD's Q and error-feedback residuals.
ALGORITHMS = {
    "dense": [],
    "zero2": ["--set", "optimizer.zero_stage=2", "--set", "optimizer.accumulation_steps=2"],
    "local_sgd": ["--set", "averaging.period=5"],
    "powersgd": ["--set", "compression.name=powersgd", "--set", "compression.min_size=64"],
}


def train_command(out: Path | str, name: str, *extra: str) -> list[str]:
    """`tfdist train` of ALGORITHMS[name] writing its run under `out`."""
    return [sys.executable, "-m", "tfdist.tools.cli", "train", *JOB, *ALGORITHMS[name],
            "--set", f"train.output_dir={out}", *extra]


def launcher_command(out: Path | str, name: str, *where: str, extra: tuple[str, ...] = ()
                     ) -> list[str]:
    """`tfdist.launch` of that job on 2 local workers, or on the hosts `where` gives."""
    return [sys.executable, "-m", "tfdist.launch", *(where or ("--workers", "2")),
            "--timeout", "400", "--", *train_command(out, name, *extra)]


def final_weights(output_dir: Path) -> tuple[dict, list]:
    """(summary.json, the weights of model.keras) of the one run under `output_dir`."""
    (summary,) = output_dir.glob("*/summary.json")
    model = keras.saving.load_model(summary.parent / "model.keras", compile=False)
    return json.loads(summary.read_text()), model.get_weights()


def wait_for_backup(process: subprocess.Popen, *files: Path, timeout: float = 300,
                    poll: float = 0.01) -> None:
    """Returns once every one of `files` (a backup's meta.json) exists; fails the test if
    `process` ends first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while not all(f.exists() for f in files):
        assert process.poll() is None, "the run ended before the backup"
        assert time.monotonic() < deadline, "no backup in time"
        time.sleep(poll)
