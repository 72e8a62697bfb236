"""Resumes that cannot lose work or go wrong, through `tfdist train`: a backup knows the job it
belongs to, a damaged newest backup gives way to the one before, and a kill at any point of the
end of a run leaves a state the same command finishes from without retraining."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

from tests.conftest import ROOT, worker_env
from tests.jobs import wait_for_backup

# 2 epochs of 9 steps on 2 logical devices; a backup every 4 steps (kept: the newest 2).
JOB = ["--set", "model.name=mlp", "--set", "model.hidden=[32]", "--set", "train.epochs=2",
       "--set", "train.steps_per_epoch=9", "--set", "train.checkpoint_steps=4",
       "--set", "data.global_batch_size=32", "--set", "optimizer.name=adam"]
STEPS = 18


FAULT_AT = str(Path(ROOT) / "tests" / "workers" / "fault_at.py")


def _command(out, *extra):
    return [sys.executable, "-m", "tfdist.tools.cli", "train", *JOB, *extra,
            "--set", f"train.output_dir={out}"]


def _train(out, *extra, env=None, timeout=300, fault=None):
    """The job run to its end (`fault`: (kind, point) of tests/workers/fault_at.py)."""
    command = _command(out, *extra)
    if fault is not None:
        command = [sys.executable, FAULT_AT, *fault, *command[4:]]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                          env=env or worker_env(), timeout=timeout)


def _finished(out: Path):
    """(summary, weights) of the one finished run in `out`."""
    (summary,) = out.glob("*/summary.json")
    model = keras.saving.load_model(summary.parent / "model.keras", compile=False)
    return json.loads(summary.read_text()), model.get_weights()


def _same_weights(a, b):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-6)


def _stopped_after_backup(out: Path, step: int, *extra, timeout=240) -> None:
    """Runs the job and SIGKILLs it once the backup of `step` is complete."""
    proc = subprocess.Popen(_command(out, *extra), cwd=ROOT, env=worker_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_for_backup(proc, out / "backup" / "process-0" / f"step-{step}" / "meta.json",
                        timeout=timeout, poll=0.005)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    done = _train(out)
    assert done.returncode == 0, done.stderr[-3000:]
    return _finished(out)


def test_a_changed_job_is_refused_and_a_longer_run_is_carried_over(tmp_path, straight):
    out = tmp_path / "run"
    _stopped_after_backup(out, 8)
    # One run names every change (each run costs a process that imports TensorFlow).
    refused = _train(out, "--set", "data.global_batch_size=64", "--set", "data.seed=7",
                     "--set", "optimizer.name=sgd")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert ("data.global_batch_size was 32 and is now 64; data.seed was 0 and is now 7; "
            "optimizer.name was 'adam' and is now 'sgd'") in refused.stderr, refused.stderr[-3000:]
    assert "Run with the backup's values to resume it, or back up to another directory" \
        in refused.stderr
    assert "Traceback" not in refused.stderr
    # More epochs decide neither the data order nor the state: resumed, then trained on.
    longer = _train(out, "--set", "train.epochs=3")
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert "[tfdist] resuming from the backup of step 8 (epoch 1, step 8 of it done)" in \
        longer.stderr
    summary, _ = _finished(out)
    assert summary["resumed_from_step"] == 8
    assert summary["examples_per_epoch"] == [9 * 32] * 3
    # The resumed epoch's figures count the one step it ran, not the 8 passed over: a dense
    # exchange sends 1.0 of a dense all-reduce in every epoch.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(summary["run_dir"] + "/tensorboard")
    events.Reload()
    ratios = [e.value for e in events.Scalars("bytes_vs_dense")]
    assert ratios[-3:] == pytest.approx([1.0] * 3)


def test_a_damaged_newest_backup_gives_way_to_the_one_before(tmp_path, straight):
    out = tmp_path / "run"
    _stopped_after_backup(out, 8)
    newest = out / "backup" / "process-0" / "step-8"
    largest = max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = largest.read_bytes()
    largest.write_bytes(data[:len(data) // 2])
    done = _train(out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[tfdist] the backup of step 8 is damaged (" in done.stderr
    assert "using the newest intact backup" in done.stderr
    summary, weights = _finished(out)
    assert summary["resumed_from_step"] == 4
    assert summary["examples_per_epoch"] == straight[0]["examples_per_epoch"]
    _same_weights(straight[1], weights)
    assert not (out / "backup").exists()


def test_leftovers_of_a_kill_while_saving_or_removing_are_cleared(tmp_path, straight):
    out = tmp_path / "run"
    _stopped_after_backup(out, 8)
    process = out / "backup" / "process-0"
    (process / "step-12.partial").mkdir()  # killed while writing a backup
    (process / "step-0.removing").mkdir()  # killed while pruning one
    done = _train(out)
    assert done.returncode == 0, done.stderr[-3000:]
    summary, weights = _finished(out)
    assert summary["resumed_from_step"] == 8
    _same_weights(straight[1], weights)
    assert not (out / "backup").exists()


@pytest.mark.parametrize("point", ["trained", "saved_model", "finished"])
def test_a_kill_at_the_end_of_a_run_loses_nothing_and_retrains_nothing(tmp_path, straight,
                                                                       point):
    """SIGKILL after the last step, after model.keras, after summary.json: the same command
    then finishes the run (resumed at its last step, nothing trained again) or, once the run
    was finished, starts a new one from step 0 that no leftover backup leaks into."""
    out = tmp_path / "run"
    killed = _train(out, fault=("kill", point))
    assert killed.returncode == -signal.SIGKILL
    again = _train(out)
    assert again.returncode == 0, again.stderr[-3000:]
    summaries = sorted(out.glob("*/summary.json"))
    if point == "finished":  # the first run was complete: the second is a run of its own
        assert len(summaries) == 2
        assert "[tfdist] removing the backups left by the finished run" in again.stderr
        for path in summaries:
            summary = json.loads(path.read_text())
            assert summary["resumed_from_step"] is None
            model = keras.saving.load_model(path.parent / "model.keras", compile=False)
            _same_weights(straight[1], model.get_weights())
    else:
        summary, weights = _finished(out)
        assert summary["resumed_from_step"] == STEPS  # resumed at the end: nothing retrained
        assert summary["examples_per_epoch"] == straight[0]["examples_per_epoch"]
        assert summary["final_train_loss"] == pytest.approx(straight[0]["final_train_loss"])
        _same_weights(straight[1], weights)
    assert not (out / "backup").exists()


@pytest.mark.parametrize("point", ["trained", "ended"])
def test_a_notice_once_training_is_over_lets_the_run_finish(tmp_path, straight, point):
    """A SIGTERM after the last step (before the test evaluation and model.keras) or as the
    process exits: the run finishes as one never noticed and exits 0, not killed (143) with its
    model unsaved or preempted (76) with nothing to resume."""
    out = tmp_path / "run"
    done = _train(out, fault=("notice", point))
    assert done.returncode == 0, done.stderr[-3000:]
    said = "[tfdist] SIGTERM received after training ended: finishing the run"
    assert (said in done.stderr) == (point == "trained"), done.stderr[-3000:]
    summary, weights = _finished(out)
    assert summary["resumed_from_step"] is None
    assert summary["final_train_loss"] == pytest.approx(straight[0]["final_train_loss"])
    _same_weights(straight[1], weights)
    assert not (out / "backup").exists()


def test_nan_policy_skip_from_the_config_trains_past_a_nan_example(tmp_path):
    """One training example is NaN: with optimizer.nan_policy=skip the run trains its whole
    epoch, skips the step that holds it (counted in summary.json) and ends with finite weights;
    engines without the check refuse 'skip' before anything starts."""
    done = subprocess.run(
        [sys.executable, "-m", "tfdist.tools.cli", "train", "--set", "model.name=mlp",
         "--set", "data.name=tests.workers.nan_data:digits_with_a_nan", "--set",
         "optimizer.nan_policy=skip", "--set", "train.epochs=1", "--set",
         "data.global_batch_size=64", "--set", f"train.output_dir={tmp_path}"],
        capture_output=True, text=True, cwd=ROOT, env=worker_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary, weights = _finished(tmp_path)
    assert summary["nonfinite_steps_skipped"] == 1  # one epoch: the example is in one batch
    assert all(np.isfinite(w).all() for w in weights)
    refused = subprocess.run(
        [sys.executable, "-m", "tfdist.tools.cli", "train", "--set", "engine.name=hogwild",
         "--set", "optimizer.nan_policy=skip"], capture_output=True, text=True, cwd=ROOT,
        env=worker_env(), timeout=120)
    assert refused.returncode == 2
    assert "optimizer.nan_policy: 'skip' is a tfdist optimizer's check" in refused.stderr


def test_a_notice_to_the_default_job_backs_up_without_a_backup_key(tmp_path):
    """No train.checkpoint_steps (the default config's case), one process: a SIGTERM in epoch 1
    backs up the step in flight and exits 76; the same command resumes there and ends on the
    weights of the run never stopped; nothing of the backup is left after it."""
    import tests.workers.slow_model  # noqa: F401 (registers its layer for loading)

    def slow(pause):  # seconds a step sleeps (the model is the same: its pause is the identity)
        return ["--set", "model.name=tests.workers.slow_model:build", "--set",
                f"model.options={{pause: {pause}}}", "--set", "train.checkpoint_steps=null",
                "--set", "train.verbose=2"]

    straight = _train(tmp_path / "straight", *slow(0))
    assert straight.returncode == 0, straight.stderr[-3000:]
    out = tmp_path / "noticed"
    proc = subprocess.Popen(_command(out, *slow(0.2)), cwd=ROOT, env=worker_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        for line in proc.stdout:
            if "Epoch 1/2" in line:
                proc.send_signal(signal.SIGTERM)
                break
        _, err = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 76, err[-3000:]
    assert "[tfdist] preempted (SIGTERM): backed up step" in err, err[-3000:]
    again = _train(out, *slow(0.2))
    assert again.returncode == 0, again.stderr[-3000:]
    summary, weights = _finished(out)
    assert 0 < summary["resumed_from_step"] < STEPS
    _same_weights(_finished(tmp_path / "straight")[1], weights)
    assert not (out / "backup").exists()
