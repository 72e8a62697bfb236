"""The emulated multi-host cluster: network namespaces on a bridge, links shaped by tc."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, worker_env
from tfdist.tools import emulated
from tfdist.tools.emulated import EmulatedCluster, parse_bandwidth, parse_delay

needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="needs root and iproute2 (ip, tc)")

THROUGHPUT = r"""
import socket, sys, time
role, addr = sys.argv[1], sys.argv[2]
if role == "recv":
    s = socket.socket()
    s.bind((addr, 5001)); s.listen(1); c, _ = s.accept(); n, t0 = 0, None
    while True:
        b = c.recv(1 << 20)
        if not b: break
        t0 = t0 or time.time(); n += len(b)
    print(n * 8 / (time.time() - t0) / 1e6)
else:
    s = socket.create_connection((addr, 5001)); end = time.time() + 2
    while time.time() < end: s.sendall(b"x" * 65536)
"""


def own_namespaces() -> list[str]:
    """This process' emulated-cluster namespaces (the other test process makes its own
    meanwhile)."""
    return [ns for ns in emulated.namespaces() if ns.startswith(f"tfd-{os.getpid()}-")]


def test_units_are_required_and_parsed():
    assert parse_bandwidth("100mbit") == 100_000_000
    assert parse_bandwidth("10Gbit/s") == 10**10
    assert parse_delay("0.5ms") == pytest.approx(5e-4)
    with pytest.raises(ValueError, match="'100': give a number and a unit"):
        parse_bandwidth("100")
    with pytest.raises(ValueError, match="'5': give a number and a unit"):
        parse_delay("5")


@needs_netns
def test_bad_input_fails_before_anything_is_created():
    before = own_namespaces()
    with pytest.raises(ValueError, match="hosts=1000"):
        EmulatedCluster(1000, "1gbit")
    with pytest.raises(ValueError, match="hosts=0"):
        EmulatedCluster(0, "1gbit")
    with pytest.raises(ValueError, match="bandwidth 'fast'"):
        EmulatedCluster(2, "fast")
    assert own_namespaces() == before


@needs_netns
def test_link_bandwidth_is_shaped_and_everything_is_removed():
    with EmulatedCluster(2, "100mbit") as cluster:
        names = [*cluster.namespaces, cluster.bridge_namespace]
        assert set(names) <= set(emulated.namespaces())
        recv = subprocess.Popen(cluster.command(1, [sys.executable, "-c", THROUGHPUT, "recv",
                                                    cluster.addresses[1]]),
                                stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)
        subprocess.run(cluster.command(0, [sys.executable, "-c", THROUGHPUT, "send",
                                           cluster.addresses[1]]), timeout=30, check=True)
        mbit = float(recv.communicate(timeout=30)[0])
        # Hosts reach each other only through the shaped bridge, not the machine's network.
        assert subprocess.run(cluster.command(0, ["ip", "-o", "addr"]), capture_output=True,
                              text=True).stdout.count("inet ") == 2  # lo and eth0
    print(f"\nemulated 100mbit link: {mbit:.1f} Mbit/s measured")
    assert 60 <= mbit <= 101, mbit
    assert not set(names) & set(emulated.namespaces())


@needs_netns
def test_a_killed_owner_leaves_nothing_behind():
    """SIGKILL the process holding a cluster with a worker running inside: its watchdog
    removes the namespaces and the worker."""
    owner = subprocess.Popen(
        [sys.executable, "-m", "tfdist.emulated", "up", "--hosts", "2", "--bandwidth", "1gbit"],
        cwd=ROOT, env=worker_env(), stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        lines = []
        for line in owner.stdout:
            lines.append(line)
            if line.startswith("ready"):
                break
        ns = lines[0].split("ip netns exec ")[1].split()[0]
        sleeper = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "300"])
        time.sleep(0.5)
        assert ns in emulated.namespaces()
        owner.kill()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(
                n.startswith(f"tfd-{owner.pid}-") for n in emulated.namespaces()):
            time.sleep(0.2)
        assert not [n for n in emulated.namespaces() if n.startswith(f"tfd-{owner.pid}-")]
        assert sleeper.wait(10) == -signal.SIGKILL
    finally:
        if owner.poll() is None:
            os.killpg(owner.pid, signal.SIGKILL)
        emulated.sweep()


@needs_netns
def test_tf_config_workers_all_reduce_across_emulated_hosts():
    code = ("import tensorflow as tf\n"
            "s = tf.distribute.MultiWorkerMirroredStrategy()\n"
            "v = s.run(lambda: tf.distribute.get_replica_context().all_reduce('sum', "
            "tf.ones([1000])))\n"
            "print('SUM', float(s.experimental_local_results(v)[0][0]))\n"
            "import os; print('THREADS', os.environ.get('TF_NUM_INTRAOP_THREADS'))\n")
    env = worker_env()
    env.pop("TF_NUM_INTRAOP_THREADS", None)
    with EmulatedCluster(2, "1gbit") as cluster:
        results = cluster.run_workers([sys.executable, "-c", code], timeout=120, env=env)
    assert [r.returncode for r in results] == [0, 0], results[0].output[-3000:]
    assert all("SUM 2.0" in r.output for r in results)
    # the two hosts share this machine's cores, each with its half as TensorFlow's threads
    half = max(1, len(os.sched_getaffinity(0)) // 2)
    assert all(f"THREADS {half}" in r.output for r in results)


SPIN = "import time; t = time.process_time(); w = time.time()\n" \
       "while time.process_time() - t < 0.3: pass\nprint(time.time() - w)"


needs_cgroup = pytest.mark.skipif(
    not os.path.exists(f"{emulated.CGROUP_CPU}/cpu.cfs_quota_us"),
    reason="needs the cgroup v1 cpu controller (a straggler's CPU quota)")


@needs_netns
@needs_cgroup
def test_a_straggler_computes_under_its_cpu_quota_and_its_cgroup_is_removed():
    """Host 1 at 0.1 cores needs about 10x the wall time for 0.3 s of CPU work."""
    with EmulatedCluster(2, "1gbit", slow_host=1, cpu_share=0.1) as cluster:
        cgroup = cluster.cgroup
        results = cluster.run_workers([sys.executable, "-c", SPIN], timeout=60)
        assert os.path.isdir(cgroup)
    assert [r.returncode for r in results] == [0, 0]
    fast, slow = (float(r.output.split()[-1]) for r in results)
    assert slow > 4 * fast and slow > 1.5, (fast, slow)
    assert not os.path.exists(cgroup)


def test_a_straggler_that_cannot_be_emulated_is_refused_first():
    with pytest.raises(ValueError, match="slow_host=2: must be a host index in"):
        EmulatedCluster(2, "1gbit", slow_host=2, cpu_share=0.5)
    with pytest.raises(ValueError, match="cpu_share=0: must be a number of cores"):
        EmulatedCluster(2, "1gbit", slow_host=1, cpu_share=0)


@needs_netns
def test_parameter_servers_run_on_host_0_after_the_workers():
    code = "import json, os; print(json.loads(os.environ['TF_CONFIG'])['task'])"
    with EmulatedCluster(2, "1gbit") as cluster:
        results = cluster.run_workers([sys.executable, "-c", code], timeout=60, ps=1)
        config = emulated_config = __import__("json").loads(cluster.tf_config(0, ps=1))
    assert [r.output.strip() for r in results] == [
        "{'type': 'worker', 'index': 0}", "{'type': 'worker', 'index': 1}",
        "{'type': 'ps', 'index': 0}"]
    assert emulated_config["cluster"]["ps"] == [f"{cluster.addresses[0]}:{emulated.WORKER_PORT + 1}"]
    assert config["cluster"]["worker"] == [f"{a}:{emulated.WORKER_PORT}" for a in cluster.addresses]


@needs_netns
def test_hosts_share_nothing_but_the_network_and_the_storage_they_are_given(tmp_path):
    """Each host: its own hostname, /tmp, home and working directory; the software read-only;
    a file written on one host is not on the other, nor on this machine; the shared directory
    is the same on every host. Two processes on one host share its files."""
    code = ("import os, socket, sys\n"
            "h = socket.gethostname(); shared = sys.argv[1]\n"
            "open('/tmp/mine', 'a').write(h + ' '); open(os.path.expanduser('~/note'), 'w').write(h)\n"
            "open(os.path.join(shared, h), 'w').write(h)\n"
            "try:\n    open(os.path.join(os.path.dirname(os.__file__), 'tfdist-probe'), 'w')\n"
            "    writable = True\n"
            "except OSError:\n    writable = False\n"
            "print('SEEN', h, os.getcwd(), open('/tmp/mine').read().split(), writable)\n")
    with EmulatedCluster(2, "1gbit", shared=[tmp_path]) as cluster:
        results = cluster.run_workers([sys.executable, "-c", code, str(tmp_path)], timeout=60,
                                      env=worker_env(), ps=1)  # the ps task: on host 0 too
        again = subprocess.run(cluster.command(1, ["cat", "/tmp/mine"]), capture_output=True,
                               text=True, timeout=30)
        host0 = subprocess.run(cluster.command(0, ["cat", "/tmp/mine"]), capture_output=True,
                               text=True, timeout=30)
    assert [r.returncode for r in results] == [0, 0, 0], results[0].output[-2000:]
    seen = [r.output.split("SEEN ")[1].split() for r in results]
    home = os.path.realpath(os.path.expanduser("~"))
    assert [s[:2] for s in seen] == [["host0", f"{home}/work"], ["host1", f"{home}/work"],
                                     ["host0", f"{home}/work"]]
    assert all(s[-1] == "False" for s in seen)  # the installed software is read-only
    assert seen[1][2:-1] == ["['host1']"]  # host 1's /tmp holds only its own file
    assert again.stdout.split() == ["host1"]  # and keeps it for the next process there
    assert host0.stdout.split() == ["host0", "host0"]  # worker 0 and the ps share host 0
    assert sorted(os.listdir(tmp_path)) == ["host0", "host1"]
    assert not os.path.exists("/tmp/mine")
