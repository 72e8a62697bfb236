"""Decoding off the trainers (`data.service`, `python -m tfdist.launch --data-hosts`): 4 emulated
hosts that share nothing but the network and the record set's directory, 2 trainers (TF_CONFIG
workers) and 2 data hosts running the tf.data service's dispatcher and data workers, started
and stopped by the launcher. Every record the job decodes leaves a trace on the host that
decoded it (`tests/workers/counted_decode.py`), so the test counts where the decoding ran."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, worker_env
from tfdist.tools import emulated

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("tc") or not shutil.which("nsenter"),
                       reason="needs root, iproute2 and nsenter for the emulated hosts"),
]

SSH = f"{sys.executable} {emulated.__file__} ssh"
TRAINERS, DATA = (0, 1), (2, 3)  # the hosts of each role


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """4 share-nothing hosts; `shared` (the only directory they all see) holds the digits
    record set; each host has an empty /tmp/decoded for the traces."""
    shared = tmp_path_factory.mktemp("shared")
    subprocess.run([sys.executable, "-m", "tfdist.tools.cli", "data", "convert", "--from",
                    "digits", "--out", str(shared / "digits")], check=True, cwd=ROOT,
                   env=worker_env(), capture_output=True, timeout=120)
    with emulated.EmulatedCluster(4, "1gbit", shared=[shared]) as cluster:
        yield cluster, shared


def _clear_traces(cluster) -> None:
    for host in range(4):
        subprocess.run(cluster.command(host, ["sh", "-c", "rm -rf /tmp/decoded && mkdir "
                                              "/tmp/decoded"]), check=True, timeout=30)


def _traces(cluster, host: int) -> collections.Counter:
    """How many times each record (by fingerprint) was decoded on `host`."""
    names = subprocess.run(cluster.command(host, ["ls", "/tmp/decoded"]), check=True,
                           capture_output=True, text=True, timeout=60).stdout.split()
    return collections.Counter(name.split("-")[0] for name in names)


def _fingerprints(path) -> dict[str, collections.Counter]:
    """Each split's records by fingerprint, as the decode function names its traces."""
    import tensorflow as tf

    from tfdist.data import RecordSource
    from tfdist.tools.bench.input import fingerprint

    out = {}
    for split in ("train", "test"):
        source = RecordSource(path, split)
        records = source.read(range(len(source)))
        out[split] = collections.Counter(fingerprint(tf.constant(records)).numpy().astype(str))
    return out


def _command(cluster, shared, out, *, service: bool, extra=(), launch=()) -> list[str]:
    trainers = ",".join(cluster.addresses[h] for h in TRAINERS)
    where = ["--hosts", trainers, "--ssh", SSH, "--timeout", "400", *launch]
    if service:
        where += ["--data-hosts", ",".join(cluster.addresses[h] for h in DATA)]
    return [sys.executable, "-m", "tfdist.launch", *where, "--", sys.executable, "-m",
            "tfdist.tools.cli", "train", "--set", "engine.name=multi_worker",
            "--set", "data.name=records", "--set", f"data.path={shared / 'digits'}",
            "--set", "data.decode=tests.workers.counted_decode:decode",
            "--set", f"train.output_dir={out}", "--set", "train.verbose=0", *extra]


def _summary(out) -> dict:
    (summary,) = out.glob("*/summary.json")
    return json.loads(summary.read_text())


def test_the_data_hosts_decode_every_record_and_the_trainers_none(hosts):
    """3 epochs of the digits record set on 2 trainers, read locally, then through the
    service on the 2 data hosts in each mode: the same accuracy band; the trainer hosts decode
    no training record but record 0 (read to check the decode function before training) and
    the test split; both data hosts take part, and together they decode at least the records
    the job trained on. distributed_epoch: the job reads every record (the data hosts split
    the passes, which overlap: one may start the next pass while the other finishes this one,
    so a record may be read a pass or more often than another); parallel_epochs: each data
    host reads every record. Every server is gone after each job."""
    cluster, shared = hosts
    records = _fingerprints(shared / "digits")
    train, test = records["train"], records["test"]
    local = None
    for mode in (None, "distributed_epoch", "parallel_epochs"):
        _clear_traces(cluster)
        out = shared / (mode or "local")
        extra = ("--set", "train.epochs=3") + (("--set", f"data.service_mode={mode}")
                                                if mode else ())
        done = subprocess.run(_command(cluster, shared, out, service=mode is not None,
                                       extra=extra), cwd=ROOT, env=worker_env(),
                              capture_output=True, text=True, timeout=450)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        summary, traces = _summary(out), [_traces(cluster, h) for h in range(4)]
        assert [_ours(cluster, host) for host in range(4)] == [[]] * 4
        if mode is None:
            local = summary
            continue
        assert abs(summary["test_accuracy"] - local["test_accuracy"]) <= 0.04, (summary, local)
        assert summary["test_accuracy"] >= 0.9
        assert f"[launch] tf.data service: dispatcher at {cluster.addresses[DATA[0]]}:5050" \
            in done.stderr
        for host in TRAINERS:
            decoded = traces[host]
            trained_here = sum(n for key, n in decoded.items() if key in train and key not in test)
            assert trained_here <= 1, (mode, host, trained_here)  # record 0, before training
            assert sum(decoded.values()) <= 1 + 2 * sum(test.values())  # and the test split
        on_data = traces[DATA[0]] + traces[DATA[1]]
        assert all(sum(traces[h].values()) > 0 for h in DATA), [len(traces[h]) for h in DATA]
        counts = [on_data[key] for key in train]
        assert sum(counts) >= summary["steps"] * 64
        if mode == "distributed_epoch":
            assert min(counts) >= 1, collections.Counter(counts)
        else:
            for host in DATA:
                assert all(traces[host][key] >= 1 for key in train), host


PARALLEL_PASSES = r"""
import hashlib, sys
import keras
import tensorflow as tf
from tfdist.data import RecordSource
from tfdist.data.records import decode_example
from tfdist.data.service import service_batches
from tfdist.tools.bench.input import DIGITS

keras.utils.set_random_seed(0)  # as on a trainer: TensorFlow's global seed is set
service = tf.data.experimental.service
dispatcher = service.DispatchServer(service.DispatcherConfig(port=5070))
workers = [service.WorkerServer(service.WorkerConfig(dispatcher_address="localhost:5070"))
           for _ in range(2)]
batches = service_batches(RecordSource(sys.argv[1], "train").files, 32,
                          decode_example(DIGITS), "localhost:5070", "parallel_epochs")
for x, _ in batches.take(int(sys.argv[2])):
    print(" ".join(hashlib.sha1(image.tobytes()).hexdigest() for image in x.numpy()))
"""


def test_two_data_workers_in_parallel_epochs_do_not_hand_out_the_same_batches(hosts):
    """parallel_epochs: every data worker runs the same graph, with the trainer's seed; 60
    batches of 32 read from 2 data workers (a dispatcher and both workers on one emulated
    host) hold no batch that repeats half of an earlier one. With one seeded order on both,
    1 to 14 of 40 did."""
    cluster, shared = hosts
    done = subprocess.run(cluster.command(DATA[0], [sys.executable, "-c", PARALLEL_PASSES,
                                                    str(shared / "digits"), "60"]),
                          cwd=ROOT, env=worker_env(), capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    batches = [set(line.split()) for line in done.stdout.splitlines()]
    assert len(batches) == 60 and all(len(b) >= 30 for b in batches), done.stdout[-3000:]
    repeats = [(i, j) for i, b in enumerate(batches) for j in range(i)
               if len(b & batches[j]) >= 16]
    assert repeats == [], repeats


def _ours(cluster, host: int, what: str = "tfdist.tools.cli") -> list[str]:
    """The pids of the processes on emulated `host` whose command line holds `what` (the
    hosts share this machine's process table: other tests' processes are not theirs)."""
    on_host = subprocess.run(["ip", "netns", "pids", cluster.namespaces[host]],
                             capture_output=True, text=True).stdout.split()
    found = []
    for pid in on_host:
        with contextlib.suppress(OSError):
            words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if words[0] != b"sh" and what.encode() in b" ".join(words):
                found.append(pid)
    return found


def _kill(cluster, host: int, role: str) -> None:
    """SIGKILLs the data service's `role` ("dispatcher" or "worker") on emulated `host` (the
    server, not the shell ssh runs it in)."""
    victim = _ours(cluster, host, f"data serve {role}")
    assert len(victim) == 1, victim
    os.kill(int(victim[0]), signal.SIGKILL)


def _wait_for(launcher, line: str) -> None:
    for text in launcher.stdout:
        if line in text:
            return
    pytest.fail(f"the job ended before {line!r}: {launcher.communicate()[1][-3000:]}")


def test_a_data_worker_then_the_dispatcher_killed_are_said_and_the_job_ends(hosts):
    """Under `--max-restarts 1`, backups every 5 steps: a data worker SIGKILLed in epoch 2 of 4
    is said in one line and the trainers go on reading from the other; the dispatcher
    SIGKILLed in epoch 3 is said in one line, stops the job, and the launcher starts it again
    (the data service too) from its last backup; the job exits 0."""
    cluster, shared = hosts
    _clear_traces(cluster)
    out = shared / "killed"
    launcher = subprocess.Popen(
        _command(cluster, shared, out, service=True, launch=("--max-restarts", "1"),
                 extra=("--set", "train.epochs=4", "--set", "train.verbose=2",
                        "--set", "train.checkpoint_steps=5",
                        "--set", "model.name=tests.workers.slow_model:build")),
        cwd=ROOT, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        _wait_for(launcher, "Epoch 2/4")
        _kill(cluster, DATA[1], "worker")
        _wait_for(launcher, "Epoch 3/4")
        _kill(cluster, DATA[0], "dispatcher")
        killed = time.monotonic()
        _, err = launcher.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 0, err[-3000:]
    assert re.search(r"\[launch\] data worker 1 (was killed by SIGKILL \(signal 9\)|exited with "
                     r"137); the job goes on without it\n", err), err[-3000:]
    assert re.search(r"\[launch\] data dispatcher (was killed by SIGKILL \(signal 9\)|exited "
                     r"with 137); the job cannot be served without it and stops\n", err), \
        err[-3000:]
    assert re.search(r"\[launch\] data dispatcher (was killed by SIGKILL \(signal 9\)|exited "
                     r"with 137): restarting every worker \(restart 1 of 1\); the job resumes "
                     r"from its last backup", err), err[-3000:]
    assert _summary(out)["resumed_from_step"] > 0
    assert "Traceback" not in err
    assert _summary(out)["steps"] > 0 and time.monotonic() - killed < 300


def test_a_dispatcher_nobody_answers_stops_the_run_before_training_in_one_line(
        tmp_path, monkeypatch, capsys):
    """data.service naming an address where nothing listens: exit 2 with one line naming the
    address, once the time a starting dispatcher is given has passed (2 s here, 30 s by
    default), before any step."""
    from tfdist.data import service
    from tfdist.tools.cli import main
    from tfdist.tools.launch import free_ports

    assert main(["data", "convert", "--from", "digits", "--out", str(tmp_path / "digits")]) == 0
    monkeypatch.setattr(service, "CONNECT_SECONDS", 2.0)
    (port,) = free_ports(1)
    capsys.readouterr()
    started = time.monotonic()
    assert main(["train", "--set", "data.name=records", "--set",
                 f"data.path={tmp_path / 'digits'}", "--set", f"data.service=127.0.0.1:{port}",
                 "--set", f"train.output_dir={tmp_path / 'out'}"]) == 2
    assert time.monotonic() - started >= 1.0  # it waited for a dispatcher to start
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if "127.0.0.1" in line]
    assert len(lines) == 1 and f"no tf.data dispatcher answers at 127.0.0.1:{port} within 2 s" \
        in lines[0], err
    assert "Traceback" not in err and "Epoch 1" not in out
    assert not any((tmp_path / "out").glob("*/summary.json"))
