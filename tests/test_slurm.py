"""`launch/slurm/train.sbatch` on a real SLURM (slurmctld and one slurmd per emulated host, hosts
that share nothing but the network and one directory): TF_CONFIG workers from SLURM's
environment, and a preemption notice that becomes a backup, a requeue and an exact resume."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import ROOT, horovod_available, worker_env
from tests.jobs import final_weights
from tests.slurm_cluster import Slurm, missing
from tfdist.tools import emulated

pytestmark = [pytest.mark.multiprocess, pytest.mark.skipif(missing() is not None,
                                                           reason=str(missing()))]

JOB = ["--set", "model.name=tests.workers.slow_model:build", "--set", "train.epochs=4",
       "--set", "train.steps_per_epoch=12", "--set", "data.global_batch_size=32"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    shared = tmp_path_factory.mktemp("slurm")
    with emulated.EmulatedCluster(2, "1gbit", shared=[shared]) as cluster:
        cluster_slurm = Slurm(cluster, shared)
        cluster_slurm.start()
        yield cluster_slurm


def _sbatch(slurm: Slurm, name: str, variables: str = "") -> tuple[int, object]:
    out = slurm.shared / name
    job = int(slurm.run(0, (
        f"cd {ROOT} && {variables} OUTPUT_DIR={out} TFDIST_PYTHON={sys.executable} PYTHONPATH={ROOT} "
        f"TF_CPP_MIN_LOG_LEVEL=2 CHECKPOINT_STEPS=1000 sbatch --parsable -N 2 "
        f"--output={slurm.shared}/{name}-%j.out launch/slurm/train.sbatch "
        f"{' '.join(JOB)}")).stdout.strip().split(";")[0])
    return job, out



@pytest.fixture(scope="module")
def straight(slurm):
    """The batch script on 2 nodes, never stopped: (summary, weights, its log)."""
    import tests.workers.slow_model  # noqa: F401 (registers the layer for loading)

    job, out = _sbatch(slurm, "straight")
    state = slurm.wait(job)
    log = (slurm.shared / f"straight-{job}.out").read_text()
    assert state == "COMPLETED", log[-4000:] + slurm.logs()
    return (*final_weights(out), log)


def test_sbatch_trains_the_job_on_two_nodes_as_mirrored_does_on_two_devices(slurm, straight,
                                                                           tmp_path):
    summary, weights, log = straight
    assert summary["engine"] == "multi_worker" and summary["world_size"] == 2
    assert "on host[0-1]" in log
    reference = subprocess.run(
        [sys.executable, "-m", "tfdist.tools.cli", "train", *JOB, "--set",
         "engine.name=mirrored", "--set", "engine.devices=2", "--set",
         f"train.output_dir={tmp_path}"], cwd=ROOT, env=worker_env(), capture_output=True,
        text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    _, expected = final_weights(tmp_path)
    for a, b in zip(expected, weights, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_a_term_notice_backs_up_requeues_and_the_job_resumes_exactly(slurm, straight):
    """`scancel --signal=TERM` mid-training: both tasks back up at one step, the chief requeues
    the job, SLURM starts it again and it resumes from that backup to the weights of the run
    never stopped, every epoch's examples trained on once."""
    job, out = _sbatch(slurm, "preempted")
    log = slurm.shared / f"preempted-{job}.out"
    deadline = time.monotonic() + 300
    while not (log.exists() and "Epoch 2/4" in log.read_text()):
        assert time.monotonic() < deadline, "epoch 2 did not start in time"
        time.sleep(0.2)
    slurm.run(0, f"scancel --signal=TERM {job}")
    while slurm.state(job) != ("PENDING", 1):  # requeued: SLURM holds it for about 2 minutes
        assert time.monotonic() < deadline + 120, slurm.state(job)
        time.sleep(0.2)
    # SLURM holds a requeued job about 2 minutes; the test starts it as soon as its previous
    # run has left the nodes and its old credential is past: slurmd revokes it with a time in
    # whole seconds and refuses a new one from the same second ("Job credential revoked",
    # seen in the clean-clone CI run when the start came 0.2 s after the requeue).
    while slurm.run(0, "sinfo -h -o '%t'", check=False).stdout.split() != ["idle"]:
        assert time.monotonic() < deadline + 120, "the nodes did not come back"
        time.sleep(0.2)
    time.sleep(2)
    slurm.run(0, f"scontrol update JobId={job} StartTime=now")
    state = slurm.wait(job, timeout=600)
    text = log.read_text()
    assert state == "COMPLETED", text[-4000:] + slurm.logs()
    assert slurm.state(job)[1] == 1, text[-4000:]  # requeued once
    assert "[tfdist] preempted (SIGTERM): backed up step" in text
    assert f"[tfdist] requeueing SLURM job {job}" in text
    assert "(restart 1) on host[0-1]" in text
    summary, weights = final_weights(out)
    reference_summary, reference, _ = straight
    assert summary["resumed_from_step"] >= 12
    assert summary["examples_per_epoch"] == reference_summary["examples_per_epoch"]
    for a, b in zip(reference, weights, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not horovod_available(), reason="Horovod is not installed")
def test_sbatch_runs_the_job_as_two_horovod_ranks_without_horovodrun(slurm, straight):
    """HOROVOD=1: each task of the step is a Horovod rank over Gloo (task 0 serves the
    rendezvous); the same weights as the TF_CONFIG workers of the straight run."""
    job, out = _sbatch(slurm, "horovod", "HOROVOD=1")
    state = slurm.wait(job)
    log = (slurm.shared / f"horovod-{job}.out").read_text()
    assert state == "COMPLETED", log[-4000:] + slurm.logs()
    summary, weights = final_weights(out)
    assert summary["engine"] == "horovod" and summary["world_size"] == 2
    for a, b in zip(straight[1], weights, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_sbatch_runs_a_parameter_server_and_a_worker_as_one_device_trains(slurm, tmp_path):
    """PS=1 on 2 nodes: the first task serves, the second trains (staleness 0, one worker): the
    weights of the same job on one device."""
    import tests.workers.slow_model  # noqa: F401 (registers the layer for loading)

    job, out = _sbatch(slurm, "ps", "PS=1")
    state = slurm.wait(job)
    log = (slurm.shared / f"ps-{job}.out").read_text()
    assert state == "COMPLETED", log[-4000:] + slurm.logs()
    assert "parameter server 0: serving" in log
    summary, weights = final_weights(out)
    assert summary["engine"] == "parameter_server" and summary["world_size"] == 1
    reference = subprocess.run(
        [sys.executable, "-m", "tfdist.tools.cli", "train", *JOB, "--set", "engine.name=single",
         "--set", f"train.output_dir={tmp_path}"], cwd=ROOT, env=worker_env(),
        capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    _, expected = final_weights(tmp_path)
    for a, b in zip(expected, weights, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
