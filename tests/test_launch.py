import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, worker_env
from tfdist.tools.launch import (
    free_ports,
    horovodrun_command,
    main,
    parse_hosts,
    read_hostfile,
    run_processes,
    run_tf_workers,
    tf_config,
)
from tfdist.tools.slurm import task_threads


def test_tf_config_describes_a_loopback_cluster():
    ports = free_ports(3)
    assert len(set(ports)) == 3
    cfg = json.loads(tf_config(1, ports))
    assert cfg["cluster"]["worker"] == [f"127.0.0.1:{p}" for p in ports]
    assert cfg["task"] == {"type": "worker", "index": 1}


def test_the_ports_of_a_local_job_are_held_until_it_ends():
    """host_commands chooses the ports and holds them: another process cannot bind them (nor get
    them from port 0) while the job runs; the job's own servers do (SO_REUSEADDR, as gRPC); they
    are let go when run_processes returns."""
    import errno
    import socket

    from tfdist.tools import launch

    commands = launch.host_commands([sys.executable, "-c", "pass"], [("127.0.0.1", 2)])
    ports = [json.loads(env["TF_CONFIG"])["cluster"]["worker"][i].rsplit(":", 1)[1]
             for i, (_, env) in enumerate(commands)]
    for port in map(int, ports):
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind(("127.0.0.1", port))
        assert taken.value.errno == errno.EADDRINUSE
        with socket.socket() as server:  # how the job's servers bind: SO_REUSEADDR, listening
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("127.0.0.1", port))
            server.listen()
    assert [r.returncode for r in run_processes(commands, 60)] == [0, 0]
    for port in map(int, ports):
        with socket.socket() as other:
            other.bind(("127.0.0.1", port))  # free again


def test_workers_see_their_own_index():
    code = "import json, os; print('INDEX', json.loads(os.environ['TF_CONFIG'])['task']['index'])"
    results = run_tf_workers([sys.executable, "-c", code], 2, timeout=60)
    assert [r.returncode for r in results] == [0, 0]
    assert ["INDEX 0" in results[0].output, "INDEX 1" in results[1].output] == [True, True]


def test_timeout_kills_the_whole_process_group():
    start = time.monotonic()
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', " \
           "'import time; time.sleep(60)']); print('started', flush=True); time.sleep(60)"
    (result,) = run_processes([([sys.executable, "-c", code], {})], timeout=2)
    assert time.monotonic() - start < 20
    assert result.returncode is None and "started" in result.output


def test_a_worker_behind_a_shell_that_takes_sigterm_as_a_notice_is_stopped_too(tmp_path):
    """ssh runs a remote command under a shell: SIGTERM ends the shell at once while the worker
    (whose handler takes it as a preemption notice) lives on. The launcher stops it all the same,
    so it cannot hold its port against the next start."""
    pid_file = tmp_path / "worker.pid"
    worker = (f"import os, signal, time; signal.signal(signal.SIGTERM, lambda *_: None); "
              f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)")
    shell = f"{sys.executable} -c {shlex.quote(worker)}; exit $?"
    (result,) = run_processes([(["sh", "-c", shell], {})], timeout=3)
    assert result.returncode is None  # stopped by the launcher
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_remote_worker_whose_launcher_is_gone_hangs_up():
    """A worker reached over ssh reads its notices on standard input; when that closes (the
    launcher or its ssh session is gone), it ends by SIGHUP, as under a real ssh session."""
    code = ("import time; from tfdist.callbacks.channel import launcher_channel; "
            "launcher_channel().listen(); print('listening', flush=True); time.sleep(120)")
    worker = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT,
                              env={**worker_env(), "TFDIST_NOTICES": "stdin"},
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "listening"
        worker.stdin.close()
        assert worker.wait(timeout=30) == -signal.SIGHUP
    finally:
        worker.kill()


def test_one_failure_stops_the_others_and_sets_the_exit_code(capsys):
    code = ("import json, os, sys, time\n"
            "i = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
            "sys.exit(3) if i == 1 else time.sleep(120)\n")
    start = time.monotonic()
    assert main(["--workers", "2", "--timeout", "100", "--", sys.executable, "-c", code]) == 3
    assert time.monotonic() - start < 60
    assert "worker 1 exited with 3" in capsys.readouterr().err


def test_bad_worker_count():
    with pytest.raises(ValueError, match="num_workers"):
        run_tf_workers(["true"], 0, timeout=1)


@pytest.mark.parametrize("options, error", [
    (["--workers", "2", "--timeout", "-5"], "--timeout must be > 0 seconds. Received: -5.0"),
    (["--workers", "2", "--timeout", "0"], "--timeout must be > 0 seconds. Received: 0.0"),
    (["--workers", "2", "--port", "99999"], r"--port must be a TCP port, in \[1, 65535\]"),
    (["--hosts", "node1:4", "--port", "65534"],
     "--port 65534: a host's tasks take ports 65534 to 65537, past 65535"),
    (["--workers", "2", "--data-hosts", "data-0"],
     "--data-hosts starts a tf.data service for `tfdist train`"),
    (["--workers", "2", "--data-hosts", "data-0", "--data-port", "65500"],
     r"--data-port must be in \[1, 65279\]"),
    (["--horovod", "-np", "2", "--data-hosts", "data-0"],
     "--data-hosts starts a tf.data service for TF_CONFIG workers"),
])
def test_a_bad_option_is_named_before_anything_starts(options, error, capsys, tmp_path,
                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main([*options, "--", "touch", "started"])
    assert stop.value.code == 2 and not os.path.exists("started")
    assert re.search(error, capsys.readouterr().err)


def test_hosts_and_hostfiles_are_read_like_horovodrun_reads_them(tmp_path):
    assert parse_hosts("node1:2, node2") == [("node1", 2), ("node2", 1)]
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two nodes\nnode1 slots=4\nnode2:2  # spare\nnode3\n")
    assert read_hostfile(hostfile) == [("node1", 4), ("node2", 2), ("node3", 1)]
    with pytest.raises(ValueError, match="'node1:x' is not host or host:slots"):
        parse_hosts("node1:x")
    hostfile.write_text("node1 slots=4\nnode2 slots=zero\n")
    with pytest.raises(ValueError, match=r"hosts:2: 'node2 slots=zero' is not `host slots=N`"):
        read_hostfile(hostfile)


FAKE_SSH = """#!/bin/bash
# Stands in for ssh: drops the options, "logs in" to the host (the last but one argument) by
# running the remote command (the last one) here.
echo "ssh to ${@: -2:1}"
exec bash -c "${@: -1}"
"""


def test_remote_hosts_get_ssh_sessions_with_tf_config_and_the_working_directory(tmp_path, capfd,
                                                                                 monkeypatch):
    ssh = tmp_path / "ssh"
    ssh.write_text(FAKE_SSH)
    ssh.chmod(0o755)
    (port,) = free_ports(1)
    code = ("import json, os; c = json.loads(os.environ['TF_CONFIG']); "
            "print('TASK', c['task']['index'], c['cluster']['worker'], os.getcwd(), "
            "os.environ.get('TF_NUM_INTRAOP_THREADS'))")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.2 slots=2\n127.0.0.3\n")
    monkeypatch.delenv("TF_NUM_INTRAOP_THREADS", raising=False)
    assert main(["--hostfile", str(hostfile), "--port", str(port), "--ssh", str(ssh),
                 "--timeout", "60", "--", sys.executable, "-c", code]) == 0
    out = capfd.readouterr().out
    workers = [f"127.0.0.2:{port}", f"127.0.0.2:{port + 1}", f"127.0.0.3:{port}"]
    # the two tasks of 127.0.0.2 share its cores (its `nproc`, evaluated there); one task alone
    # keeps TensorFlow's default
    half = str(max(1, len(os.sched_getaffinity(0)) // 2))
    for rank, (host, threads) in enumerate([("127.0.0.2", half), ("127.0.0.2", half),
                                            ("127.0.0.3", None)]):
        assert f"[worker {rank}] ssh to {host}" in out
        assert f"[worker {rank}] TASK {rank} {workers} {os.getcwd()} {threads}" in out


def test_workers_on_one_machine_share_its_cores_unless_told_otherwise(monkeypatch):
    """Each TensorFlow process sizes its thread pool to every core it may use: N local workers
    get TF_NUM_INTRAOP_THREADS = cores / N (at least 1); a value already set is kept; SLURM's
    --cpus-per-task is used as given."""
    from tfdist.tools import launch

    monkeypatch.delenv("TF_NUM_INTRAOP_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    argv = [sys.executable, "-c", "pass"]
    try:
        two = launch.host_commands(argv, [("127.0.0.1", 2)])
        assert [env["TF_NUM_INTRAOP_THREADS"] for _, env in two] == [str(max(1, cores // 2))] * 2
        many = launch.host_commands(argv, [("127.0.0.1", 3 * cores)])
        assert {env["TF_NUM_INTRAOP_THREADS"] for _, env in many} == {"1"}
        (one,) = launch.host_commands(argv, [("127.0.0.1", 1)])
        assert "TF_NUM_INTRAOP_THREADS" not in one[1]
        kept = launch.host_commands(argv, [("127.0.0.1", 2)],
                                    env={**os.environ, "TF_NUM_INTRAOP_THREADS": "7"})
        assert [env["TF_NUM_INTRAOP_THREADS"] for _, env in kept] == ["7", "7"]
    finally:
        launch.release_ports()
    assert task_threads({"SLURM_CPUS_PER_TASK": "4"}) == {"TF_NUM_INTRAOP_THREADS": "4"}
    assert task_threads({"SLURM_CPUS_PER_TASK": "4", "TF_NUM_INTRAOP_THREADS": "2"}) == {}
    assert task_threads({}) == {}


def test_horovodrun_helpers_build_gloo_hostfile_and_elastic_commands(tmp_path, capsys):
    train = ["python", "train.py"]
    assert horovodrun_command(train, 4, hosts=[("a", 2), ("b", 2)], horovodrun="hr") == \
        ["hr", "--gloo", "-np", "4", "-H", "a:2,b:2", *train]
    assert horovodrun_command(train, 4, hostfile="hosts.txt", mpi=True,
                              network_interface="eth0", horovodrun="hr") == \
        ["hr", "--mpi", "-np", "4", "--hostfile", "hosts.txt", "--network-interface", "eth0",
         *train]
    assert horovodrun_command(train, 4, min_np=2, max_np=8, host_discovery_script="d.sh",
                              horovodrun="hr") == \
        ["hr", "--gloo", "-np", "4", "--host-discovery-script", "d.sh", "--min-np", "2",
         "--max-np", "8", *train]
    with pytest.raises(ValueError, match="elastic flags: give --host-discovery-script"):
        horovodrun_command(train, 4, min_np=2, horovodrun="hr")
    with pytest.raises(ValueError, match="-np 4 but the hosts have 2 slots"):
        horovodrun_command(train, 4, hosts=[("a", 2)], horovodrun="hr")
    assert main(["--horovod", "-np", "2", "--dry-run", "--", *train]) == 0
    assert "horovodrun --gloo -np 2 -H localhost:2 python train.py" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--horovod", "--", *train])  # no -np
    assert "--horovod needs -np" in capsys.readouterr().err


def test_the_workers_lost_are_the_killed_or_first_failed_not_their_peers():
    from tfdist.tools.launch import WorkerResult, lost_workers

    peers_failed = [WorkerResult(0, 1, "", 10.5), WorkerResult(1, -9, "", 10.0),
                    WorkerResult(2, 1, "", 10.4)]
    assert [r.rank for r in lost_workers(peers_failed)] == [1]
    first_failed = [WorkerResult(0, 1, "", 13.0), WorkerResult(1, 2, "", 10.0),
                    WorkerResult(2, None, "")]
    assert [r.rank for r in lost_workers(first_failed)] == [1]
    assert lost_workers([WorkerResult(0, 0, "", 1.0), WorkerResult(1, None, "")]) == []


def test_slurm_tasks_get_horovods_ranks_as_horovodrun_computes_them():
    from tfdist.tools.slurm import horovod_environment, horovod_slots

    slots = horovod_slots(["a:7", "a:8", "b:7", "b:8", "c:7"])
    assert [(s["hostname"], s["rank"], s["local_rank"], s["local_size"], s["cross_rank"],
             s["cross_size"]) for s in slots] == [
        ("a", 0, 0, 2, 0, 3), ("a", 1, 1, 2, 0, 2), ("b", 2, 0, 2, 1, 3), ("b", 3, 1, 2, 1, 2),
        ("c", 4, 0, 1, 2, 3)]
    env = horovod_environment(3, ["a:7", "a:8", "b:7", "b:8", "c:7"])
    assert env["HOROVOD_RANK"] == "3" and env["HOROVOD_SIZE"] == "5"
    assert env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "a"
    assert env["HOROVOD_GLOO_RENDEZVOUS_PORT"] == "507"  # task 0's port + 500
    assert env["HOROVOD_CONTROLLER"] == env["HOROVOD_CPU_OPERATIONS"] == "gloo"


def test_the_launchers_start_without_tensorflow():
    """`python -m tfdist.launch` and the emulated cluster's command need no TensorFlow: the
    library loads on first use there (seconds saved at every job start)."""
    import subprocess

    for module in ("tfdist.launch", "tfdist.emulated"):
        done = subprocess.run([sys.executable, "-X", "importtime", "-m", module, "--help"],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
        imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()}
        assert "tfdist" in imported and "tensorflow" not in imported and "keras" not in imported
