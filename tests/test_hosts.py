"""Jobs on hosts that share nothing but the network: 3 emulated hosts, each with its own /tmp,
home and working directory; the launcher on this machine starts every worker through an ssh
stand-in (so the chief is not on the launcher's host) and talks to the job only through the
workers' standard streams; `train.output_dir` is the one shared directory. A kill -9 of every
worker, then a preemption notice, each resume exactly; the elastic launcher shrinks and grows."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import ROOT, worker_env
from tests.jobs import final_weights, launcher_command, wait_for_backup
from tests.test_resume import ELASTIC_JOB, _assert_same_training, _elastic_command, _pid_of_worker
from tfdist.tools import emulated, launch

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("tc") or not shutil.which("nsenter"),
                       reason="needs root, iproute2 and nsenter for the emulated hosts"),
]

SSH = f"{sys.executable} {emulated.__file__} ssh"  # ssh's stand-in: enters an emulated host


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """3 share-nothing hosts; `shared` is the only directory they all see."""
    shared = tmp_path_factory.mktemp("shared")
    with emulated.EmulatedCluster(3, "1gbit", shared=[shared]) as cluster:
        yield cluster, shared


def _launch(cluster, hostfile, out, *extra, min_workers="2"):
    hostfile.write_text("".join(f"{a} slots=1\n" for a in cluster.addresses))
    return [sys.executable, "-m", "tfdist.launch", "--elastic", "--hostfile", str(hostfile),
            "--min-workers", min_workers, "--ssh", SSH, "--timeout", "500", "--",
            sys.executable, "-m", "tfdist.tools.cli", "train", *ELASTIC_JOB,
            "--set", f"train.output_dir={out}", *extra]


def _left_on(cluster) -> list[str]:
    """The command lines of the processes still running on the emulated hosts, other than
    those that hold the hosts' namespaces."""
    left = []
    for ns in cluster.namespaces:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
        for pid in pids.split():
            with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
                words = f.read().decode(errors="replace").split("\0")
                if words[:2] != ["sleep", "2147483647"] and "unshare" not in words[0]:
                    left.append(f"{ns}: {' '.join(words)}")
    return left


def _signal_after(launcher, *, line: str, pids) -> float:
    """Reads the launcher's output until `line`, then SIGTERMs `pids()`: when it was sent."""
    deadline = time.monotonic() + 300
    for text in launcher.stdout:  # the chief's line per epoch, through the launcher
        if line in text:
            break
        assert time.monotonic() < deadline, f"{line!r} did not come in time"
    else:
        pytest.fail(f"the job ended before {line!r}: {launcher.communicate()[1][-3000:]}")
    for pid in pids():
        os.kill(pid, signal.SIGTERM)
    return time.monotonic()


# Each launch on these hosts costs about 20 s (two workers import TensorFlow and trace their
# step): the notice reaches a worker and the launcher here, and each algorithm's state through a
# notice is tested on local workers (tests/test_resume.py).
@pytest.mark.parametrize("name, target", [("dense", "worker 1"), ("zero2", "launcher"),
                                          ("local_sgd", None), ("powersgd", None)],
                         ids=["dense-notice-to-worker-1", "zero2-notice-to-the-launcher",
                              "local_sgd", "powersgd"])
def test_a_kill_9_of_every_worker_then_the_same_command_equals_a_run_never_stopped(
        hosts, uninterrupted, name, target):
    """2 workers on 2 remote hosts, a backup every 4 steps, one launch command run until it ends:
    1. both workers are SIGKILLed as soon as both have written the backup of step 16 (wherever
       their next steps have got to): the launcher fails, naming the kill;
    2. (where `target` is given) the same command resumes from the newest backup both hold; in
       epoch 4 a SIGTERM (a preemption notice) goes to `target`: every worker backs up at one
       step and all exit with 76 within the grace period;
    3. the same command resumes from the newest backup both hold and ends with the weights of
       the job never stopped on this machine (rtol 1e-5), every epoch's examples trained on
       once."""
    cluster, shared = hosts
    out = shared / f"stopped-{name}"
    command = launcher_command(out, name, "--hosts", ",".join(cluster.addresses[:2]), "--ssh",
                               SSH, extra=("--set", "train.checkpoint_steps=4"))

    def start():
        return subprocess.Popen(command, cwd=ROOT, env=worker_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)

    launcher = start()
    try:
        wait_for_backup(launcher, *(out / "backup" / f"process-{i}" / "step-16" / "meta.json"
                                    for i in (0, 1)))
        pids = [_pid_of_worker(str(out), i) for i in (0, 1)]
        assert None not in pids, pids
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        _, err = launcher.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode != 0 and "exited with 137" in err, err[-3000:]

    if target is not None:
        _notice(start, out, target)
    # a kill while an old backup was being removed leaves its "step-N.removing" folder behind
    steps = [{int(p.parent.name.removeprefix("step-"))
              for p in (out / "backup" / f"process-{i}").glob("step-*/meta.json")
              if p.parent.name.removeprefix("step-").isdigit()} for i in (0, 1)]
    newest = max(steps[0] & steps[1])
    assert newest >= (36 if target else 16), steps  # epoch 4 or later after a notice

    again = subprocess.run(command, cwd=ROOT, env=worker_env(), capture_output=True, text=True,
                           timeout=450)
    assert again.returncode == 0, again.stderr[-3000:]
    summary, weights = final_weights(out)
    reference_summary, reference = uninterrupted(name)
    assert summary["resumed_from_step"] == newest
    assert summary["examples_per_epoch"] == reference_summary["examples_per_epoch"]
    assert len(set(summary["examples_per_epoch"])) == 1 and len(summary["examples_per_epoch"]) == 6
    for a, b in zip(reference, weights, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    assert not (out / "backup").exists()


def _notice(start, out, target: str) -> None:
    """Starts the job again; in epoch 4 a SIGTERM goes to `target`: every worker backs up at one
    step and all exit with 76 within the grace period."""
    launcher = start()
    try:
        noticed = _signal_after(launcher, line="Epoch 4/6", pids=lambda: [
            launcher.pid if target == "launcher" else
            _pid_of_worker(str(out), int(target.split()[1]))])
        _, err = launcher.communicate(timeout=120)
        seconds = time.monotonic() - noticed
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == launch.PREEMPTED_EXIT, err[-3000:]
    assert "[launch] preempted: every worker backed up at the same step and exited with 76" \
        in err, err[-3000:]
    assert seconds < launch.PREEMPTION_GRACE
    newest = [max(int(p.name.removeprefix("step-"))
                  for p in (out / "backup" / f"process-{i}").glob("step-*")) for i in (0, 1)]
    assert newest[0] == newest[1] and 36 <= newest[0] < 72, newest  # epoch 4 or later


def test_the_elastic_launcher_shrinks_and_grows_on_hosts_that_share_nothing(hosts,
                                                                          elastic_reference):
    """The job on 3 remote hosts, reading the digits record set on the shared storage; worker 1
    is SIGKILLed after the backup of step 5: the launcher restarts on 2, the hostfile still
    offers 3 slots, so the job grows back to 3 at its next backup, step 10 of the epoch's 12
    (the offer reaches the chief on another host through its standard input); it ends with
    the weights of the same job on the digits arrays never stopped (on this machine: the same
    computation), every epoch's examples trained on once."""
    cluster, shared = hosts
    out, records = shared / "elastic", shared / "digits"
    subprocess.run([sys.executable, "-m", "tfdist.tools.cli", "data", "convert", "--from",
                    "digits", "--out", str(records)], check=True, cwd=ROOT, env=worker_env(),
                   capture_output=True, timeout=120)
    command = _launch(cluster, shared / "hosts-b.txt", out, "--set", "data.name=records",
                      "--set", f"data.path={records}", "--set", "train.checkpoint_steps=5")
    launcher = subprocess.Popen(command, cwd=ROOT, env=worker_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for_backup(launcher, out / "backup" / "process-1" / "step-5" / "meta.json")
        os.kill(_pid_of_worker(str(out), 1), signal.SIGKILL)
        out_text, err = launcher.communicate(timeout=500)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 0, out_text[-6000:] + err[-4000:]
    assert _left_on(cluster) == []  # every worker of both rounds, stopped or not, has gone
    assert "[launch] worker 1 exited with 137" in err  # its remote shell's status for SIGKILL
    assert "[launch] elastic: 1 worker(s) lost; restarting on 2 workers" in err
    assert "the job grows from 2 to 3 workers at its next backup" in err
    assert "[launch] elastic: resizing from 2 to 3 workers" in err
    summary, weights = final_weights(out)
    reference_summary, reference = elastic_reference
    assert summary["world_size"] == reference_summary["world_size"] == 3
    assert summary["resumed_from_step"] % 12, summary["resumed_from_step"]  # grown mid-epoch
    assert summary["examples_per_epoch"] == reference_summary["examples_per_epoch"] == [576] * 3
    for a, b in zip(reference, weights, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
    assert not (out / "backup").exists()


def test_an_elastic_job_whose_output_dir_is_not_shared_is_refused_before_training(hosts,
                                                                                  tmp_path):
    """train.output_dir on each host's private /tmp: every worker stops at the start with one
    line naming the directory and the fix; no step is trained."""
    cluster, shared = hosts
    done = subprocess.run(_launch(cluster, shared / "hosts-c.txt", "/tmp/private-run"),
                          cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout[-6000:] + done.stderr[-3000:]
    assert ("BackupAndRestore(elastic=True) needs a directory every process of the job sees, "
            "and /tmp/private-run/backup is not shared") in done.stdout + done.stderr
    assert "Put it on storage every host mounts at the same path" in done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert "Epoch 1/3" not in done.stdout


@pytest.mark.multiprocess
def test_a_resize_policy_moves_the_job_and_says_why(tmp_path, elastic_reference):
    """train.resize_policy=throughput on the digits record set: after 6 measured steps on 3
    workers the job is moved to 2 mid-epoch (does the third worker help?), measured again, and
    settles; each move printed with its reason; no example lost or repeated, the weights of
    the same job on the digits arrays never stopped (each size reads only its slices)."""
    records = tmp_path / "digits"
    subprocess.run([sys.executable, "-m", "tfdist.tools.cli", "data", "convert", "--from",
                    "digits", "--out", str(records)], check=True, cwd=ROOT, env=worker_env(),
                   capture_output=True, timeout=120)
    out = tmp_path / "resized"
    result = subprocess.run(
        [*_elastic_command(out, "--max-workers", "3"), "--set", "train.resize_policy=throughput",
         "--set", "train.resize_every=6", "--set", "data.name=records", "--set",
         f"data.path={records}"], capture_output=True, text=True, cwd=ROOT,
        env=worker_env(), timeout=450)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"\[launch\] elastic: resizing from 3 to 2 workers \(3 workers run at "
                     r"\d+ examples/s; trying 2 to see whether the last worker helps\)",
                     result.stderr), result.stderr[-3000:]
    settled = re.findall(r"\[tfdist\] elastic: (.*)", result.stdout)
    assert len(settled) >= 2, result.stdout[-3000:]  # one decision per size measured
    summary = _assert_same_training(out, elastic_reference)
    assert summary["world_size"] in (2, 3)


def _cut_in_epoch_2(cluster, out, *extra) -> tuple[subprocess.Popen, list[str]]:
    """The dense job on 2 remote hosts, a backup every 4 steps, `--max-restarts 1`, with
    worker 1's link taken down once epoch 2 begins: (the launcher, the `ip link set` command
    of that link, to bring it up with "up")."""
    command = launcher_command(out, "dense", "--hosts", ",".join(cluster.addresses[:2]),
                               "--ssh", SSH, "--max-restarts", "1",
                               extra=("--set", "train.checkpoint_steps=4",
                                      "--set", "model.options={pause: 0.3}", *extra))
    launcher = subprocess.Popen(command, cwd=ROOT, env=worker_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    link = ["ip", "-n", cluster.bridge_namespace, "link", "set", "port1"]
    try:
        _signal_after(launcher, line="Epoch 2/6", pids=list)
        subprocess.run([*link, "down"], check=True)
    except BaseException:
        os.killpg(launcher.pid, signal.SIGKILL)
        raise
    return launcher, link


def test_a_link_down_for_20_s_restarts_the_job_from_its_backup_to_the_same_weights(
        hosts, uninterrupted):
    """2 workers on 2 remote hosts, a backup every 4 steps, `--max-restarts 1`: worker 1's link
    goes down for 20 s in epoch 2 (longer than a gRPC connection survives, shorter than
    engine.heartbeat_seconds). The workers stop, each saying in one line whom it lost, with no
    traceback; the launcher says in one line that it restarts them; the job resumes from its
    newest backup and ends, exit 0, on the weights of the job never stopped (rtol 1e-6)."""
    cluster, shared = hosts
    out = shared / "blink"
    launcher, link = _cut_in_epoch_2(cluster, out)
    try:
        time.sleep(20)
        subprocess.run([*link, "up"], check=True)
        rest, err = launcher.communicate(timeout=400)
    finally:
        subprocess.run([*link, "up"], check=False)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 0, err[-3000:]
    restarts = [line for line in err.splitlines() if "restarting every worker" in line]
    assert len(restarts) == 1 and "(restart 1 of 1)" in restarts[0], err[-3000:]
    said = rest + err  # the workers' lines, as the launcher passes them on
    assert "lost contact with worker" in said and "Traceback" not in said, said[-3000:]
    summary, weights = final_weights(out)
    reference_summary, reference = uninterrupted("dense")
    assert summary["resumed_from_step"] is not None and summary["resumed_from_step"] >= 12
    assert summary["examples_per_epoch"] == reference_summary["examples_per_epoch"]
    for a, b in zip(reference, weights, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


def test_a_link_down_for_good_stops_the_job_within_its_timeout_naming_the_worker(hosts):
    """2 workers on 2 remote hosts, `--max-restarts 1`, engine.heartbeat_seconds 15 and
    engine.timeout_seconds 30: worker 1's link goes down in epoch 2 and stays down. The job
    is restarted once; the restart cannot gather the workers and stops after the timeout, worker
    0 naming worker 1 in one line, with no traceback; nothing hangs."""
    cluster, shared = hosts
    launcher, link = _cut_in_epoch_2(cluster, shared / "cut", "--set",
                                     "engine.heartbeat_seconds=15", "--set",
                                     "engine.timeout_seconds=30")
    try:
        cut = time.monotonic()
        rest, err = launcher.communicate(timeout=300)
        seconds = time.monotonic() - cut
    finally:
        subprocess.run([*link, "up"], check=False)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 1, err[-3000:]
    # Found lost within the heartbeat, restarted, stopped after the timeout (plus start-ups).
    assert seconds < 15 + 30 + 60, seconds
    restarts = [line for line in err.splitlines() if "restarting every worker" in line]
    assert len(restarts) == 1 and "(restart 1 of 1)" in restarts[0], err[-3000:]
    said = rest + err
    assert "[worker 0] tfdist train: worker 1 did not join the job within " \
        "engine.timeout_seconds (30 s): stopped before training." in said, said[-3000:]
    assert "Traceback" not in said
