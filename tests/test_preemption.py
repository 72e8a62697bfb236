"""Preemption notices on a multi-worker job: a SIGTERM (or SIGUSR1) to any worker, or to the
launcher, makes every worker back up at the same step and exit with PREEMPTED_EXIT; the same
command again resumes there and ends with the weights of a run never stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import numpy as np
import pytest

from tests.conftest import ROOT, worker_env
from tests.jobs import final_weights, launcher_command
from tests.test_resume import _pid_of_worker
from tfdist.tools import launch

pytestmark = pytest.mark.multiprocess

def _preempt(out, name, target):
    """Starts the job; once epoch 2 runs, sends SIGTERM to `target` ("worker 0", "worker 1" or
    "launcher"); returns (launcher exit code, its stderr, seconds from the notice to the end)."""
    launcher = subprocess.Popen(launcher_command(out, name), cwd=ROOT, env=worker_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        assert launcher.stdout is not None
        deadline = time.monotonic() + 300
        for line in launcher.stdout:  # the chief's line per epoch, through the launcher
            if "Epoch 2/6" in line:
                break
            assert time.monotonic() < deadline, "epoch 2 did not start in time"
        else:
            pytest.fail(f"the job ended before epoch 2: {launcher.communicate()[1][-3000:]}")
        pid = (launcher.pid if target == "launcher" else
               _pid_of_worker(str(out), int(target.split()[1])))
        assert pid is not None
        os.kill(pid, signal.SIGTERM)
        noticed = time.monotonic()
        _, err = launcher.communicate(timeout=120)
        return launcher.returncode, err, time.monotonic() - noticed
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)


@pytest.mark.parametrize("name, target", [("dense", "worker 1"), ("zero2", "launcher"),
                                          ("local_sgd", "worker 0"), ("powersgd", "worker 1")])
def test_a_notice_to_one_worker_backs_up_every_worker_at_one_step_and_the_rerun_is_exact(
        tmp_path, uninterrupted, name, target):
    out = tmp_path / "preempted"
    code, err, seconds = _preempt(out, name, target)
    assert code == launch.PREEMPTED_EXIT, err[-3000:]
    assert "[launch] preempted: every worker backed up at the same step and exited with 76" \
        in err, err[-3000:]
    assert seconds < launch.PREEMPTION_GRACE
    steps = [sorted(p.name for p in (out / "backup" / f"process-{i}").iterdir()) for i in (0, 1)]
    assert steps[0] == steps[1] and len(steps[0]) == 1, steps  # one backup: the notice's
    step = int(steps[0][0].removeprefix("step-"))
    assert 12 <= step < 72

    again = subprocess.run(launcher_command(out, name), capture_output=True, text=True, cwd=ROOT,
                           env=worker_env(), timeout=450)
    assert again.returncode == 0, again.stderr[-3000:]
    summary, weights = final_weights(out)
    reference_summary, reference = uninterrupted(name)
    assert summary["resumed_from_step"] == step
    # Every epoch trained on its 12 steps' examples once, across the two runs.
    assert summary["examples_per_epoch"] == reference_summary["examples_per_epoch"]
    assert len(set(summary["examples_per_epoch"])) == 1 and len(summary["examples_per_epoch"]) == 6
    for a, b in zip(reference, weights, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    assert not (out / "backup").exists()
