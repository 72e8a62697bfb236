"""An emulated multi-host cluster on one machine: network namespaces joined by a bridge, with the
links' bandwidth set by `tc`.

    with EmulatedCluster(hosts=2, bandwidth="100mbit") as cluster:
        results = cluster.run_workers(["python", "train.py"], timeout=600)

    python -m tfdist.emulated up --hosts 2 --bandwidth 100mbit   # holds until Ctrl-C
    python -m tfdist.emulated down                               # removes leftovers

Layout: host i is the namespace `tfd-<pid>-h<i>` with one veth, address 10.213.k.<i+1>/24 (k the
first subnet no other cluster on the machine uses: 0 for the first one); the
other ends hang on a bridge in a namespace of its own (`tfd-<pid>-br`), so nothing is added to
the machine's own network namespace and only addresses inside these namespaces are used. Each
host's link is shaped in both directions by a token-bucket filter (`tbf`) at `bandwidth`; a
`delay` needs the kernel's `netem` qdisc (checked before anything is created).

Hosts that share nothing but the network: each host has its own mount and UTS namespaces, held
by a process started with the cluster: a private /tmp, home directory and /dev/shm (empty
tmpfs), a working directory of its own (`~/work`), the hostname `host<i>` (every host's name in
its /etc/hosts, as a cluster's DNS gives them), and the installed
software (this Python, the virtual environment, the checkout tfdist runs from) visible
read-only, as a container image or an NFS install would be. Every process started on host i
(`command(i, ...)`) enters those namespaces, so processes on one host share its files and
processes on different hosts share none. Storage that every host sees exists only where the job
asks for it: `shared=[paths]` (standing for NFS or a bucket) keeps those directories visible,
read-write, on every host.

A straggler: `slow_host=i, cpu_share=c` runs everything started on host i in a cgroup (v1 `cpu`
controller) whose CFS quota is `c` cores (`c` x a 10 ms period), so host i computes slower while
the others share the rest of the machine.

Clean-up happens on exit from the `with` block and, if this process dies without reaching it
(even by SIGKILL), in a watchdog process that holds a pipe to this one and removes the
namespaces, with every process inside them, when the pipe closes. `down` also removes the
namespaces of owners that are gone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

PREFIX = "tfd-"
SUBNET = "10.213.0"
WORKER_PORT = 23456
CGROUP_CPU = "/sys/fs/cgroup/cpu"  # cgroup v1 cpu controller: a straggler's CPU quota
CFS_PERIOD_US = 10_000  # a short period: the quota is spread finely over a step
HOST_MEMORY_BYTES = 1536 * 2**20  # what one TensorFlow worker needs, for the host-count check
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_bandwidth(text: str) -> int:
    """'100mbit', '1gbit', '10Gbit/s' -> bits per second."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)(?:/s|ps)?\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _RATE_UNITS:
        raise ValueError(f"bandwidth {text!r}: give a number and a unit, one of "
                         f"{', '.join(_RATE_UNITS)} (e.g. 100mbit, 1gbit, 10gbit)")
    bits = float(m.group(1)) * _RATE_UNITS[unit]
    if bits < 10_000:
        raise ValueError(f"bandwidth {text!r}: at least 10kbit")
    return int(bits)


def parse_delay(text: str) -> float:
    """'5ms', '100us', '0.02s' -> seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]+)\s*", str(text))
    if not m or m.group(2) not in _TIME_UNITS:
        raise ValueError(f"delay {text!r}: give a number and a unit, one of "
                         f"{', '.join(_TIME_UNITS)} (e.g. 0.1ms, 5ms)")
    return float(m.group(1)) * _TIME_UNITS[m.group(2)]


def _qdisc_available(kind: str) -> bool:
    """Whether the kernel has the `kind` qdisc (tried on a veth in a scratch namespace)."""
    ns = f"{PREFIX}{os.getpid()}-probe"
    try:
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1")
        args = ["rate", "1mbit", "burst", "32kbit", "latency", "50ms"] if kind == "tbf" else []
        return subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "probe0",
                               "root", kind, *args], capture_output=True).returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {out.stderr.strip()}")


def check_can_emulate(hosts: int, delay: float = 0.0) -> None:
    """Raises, before anything is created, if this machine cannot hold the cluster."""
    if isinstance(hosts, bool) or not isinstance(hosts, int) or hosts < 1:
        raise ValueError(f"hosts={hosts!r}: must be an integer >= 1")
    if hosts > 250:
        raise ValueError(f"hosts={hosts}: at most 250 (one /24 subnet)")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if hosts * HOST_MEMORY_BYTES > memory:
        raise ValueError(f"hosts={hosts}: this machine has {memory / 2**30:.1f} GiB of memory, "
                         f"room for {memory // HOST_MEMORY_BYTES} workers of "
                         f"{HOST_MEMORY_BYTES / 2**30:.1f} GiB; use fewer hosts")
    if os.geteuid() != 0:
        raise PermissionError("An emulated cluster needs root (network namespaces, tc).")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise FileNotFoundError(f"`{tool}` not found: install iproute2.")
    if not _qdisc_available("tbf"):
        raise RuntimeError("This kernel has no tbf qdisc: link bandwidth cannot be set.")
    if delay and not _qdisc_available("netem"):
        raise RuntimeError(f"delay={delay * 1e3:g}ms needs the kernel's netem qdisc "
                           "(sch_netem), which this machine lacks; emulate bandwidth only "
                           "(delay 0) or load sch_netem.")


class EmulatedCluster:
    """`hosts` network namespaces on a bridge, each link shaped to `bandwidth` (and `delay`).

    Args:
        hosts: Number of emulated hosts (one worker each).
        bandwidth: Each host's link rate in each direction, e.g. "100mbit", "1gbit".
        delay: One-way added latency per link, e.g. "5ms" (needs netem), or None.
        slow_host: A host whose processes run under a CPU quota (a straggler), or None.
        cpu_share: The straggler's quota in cores, in (0, this machine's cores].
        shared: Existing directories every host sees, read-write (the job's shared storage);
            nothing else is shared between hosts.

    The hosts share this machine's cores: the workers `run_workers` and `run_horovod_workers`
    start get each host's share as TensorFlow's intra-op threads (`share_cores`), as on a host
    of that many cores.
    """

    def __init__(self, hosts: int, bandwidth: str = "1gbit", delay: str | None = None,
                 slow_host: int | None = None, cpu_share: float | None = None,
                 shared: Sequence[str | os.PathLike] = ()):
        self.shared = [os.path.realpath(p) for p in shared]
        for path in self.shared:
            if not os.path.isdir(path):
                raise ValueError(f"shared={path!r}: not an existing directory; create it first "
                                 "(the hosts' shared storage)")
        self.rate = parse_bandwidth(bandwidth)
        self.delay = parse_delay(delay) if delay else 0.0
        if slow_host is not None:  # the arguments first, then what the machine can do
            check_straggler(hosts, slow_host, cpu_share)
        check_can_emulate(hosts, self.delay)
        self.slow_host, self.cpu_share = slow_host, cpu_share
        self.hosts, self.bandwidth = hosts, bandwidth
        tag = f"{PREFIX}{os.getpid()}-{int(time.time() * 1000) % 100000}"
        self.namespaces = [f"{tag}-h{i}" for i in range(hosts)]
        self.bridge_namespace = f"{tag}-br"
        self.addresses = _addresses(SUBNET, hosts)  # until `up` takes a subnet of its own
        self.cgroup = f"{CGROUP_CPU}/{tag}-slow" if slow_host is not None else None
        self._watchdog: subprocess.Popen | None = None
        self._holders: list[subprocess.Popen] = []  # one per host: its mount and UTS namespaces

    # -- life cycle ----------------------------------------------------------------------------
    def __enter__(self) -> EmulatedCluster:
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        sweep()
        self._start_watchdog()
        try:
            with _subnet_lock():  # two clusters at once (two test processes) get two subnets
                self.addresses = _addresses(_free_subnet(), self.hosts)
                self._create()
        except BaseException:
            self.down()
            raise

    def _create(self) -> None:
        br = self.bridge_namespace
        _ip("netns", "add", br)
        _ip("-n", br, "link", "set", "lo", "up")
        _ip("-n", br, "link", "add", "br0", "type", "bridge")
        _ip("-n", br, "link", "set", "br0", "up")
        for i, (ns, address) in enumerate(zip(self.namespaces, self.addresses)):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"port{i}",
                "netns", br)
            _ip("-n", br, "link", "set", f"port{i}", "master", "br0")
            _ip("-n", br, "link", "set", f"port{i}", "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            self._shape(ns, "eth0")  # host -> bridge: the host's upload
            self._shape(br, f"port{i}")  # bridge -> host: its download
        for i in range(self.hosts):
            self._hold(i)
        if self.cgroup is not None:
            assert self.cpu_share is not None
            os.makedirs(self.cgroup, exist_ok=True)
            with open(f"{self.cgroup}/cpu.cfs_period_us", "w") as f:
                f.write(str(CFS_PERIOD_US))
            with open(f"{self.cgroup}/cpu.cfs_quota_us", "w") as f:
                f.write(str(max(1000, int(self.cpu_share * CFS_PERIOD_US))))

    def _shape(self, ns: str, dev: str) -> None:
        # Burst: 1 ms at the rate (at least 32 kB, so one 64 kB segment offload fits twice);
        # queue: up to 100 ms of data before dropping.
        burst = max(64 * 1024, self.rate // 8 // 1000)
        tbf = ["tbf", "rate", f"{self.rate}bit", "burst", str(burst), "latency", "100ms"]
        if self.delay:
            cmd = ["qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                   "delay", f"{self.delay * 1e6:.0f}us"]
            _tc(ns, *cmd)
            _tc(ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf)
        else:
            _tc(ns, "qdisc", "add", "dev", dev, "root", *tbf)
        # Segment offloads would let one "packet" of 64 kB through the bucket at once.
        subprocess.run(["ip", "netns", "exec", ns, "ethtool", "-K", dev, "tso", "off", "gso",
                        "off", "gro", "off"], capture_output=True)

    def _hold(self, host: int) -> None:
        """Starts the process that holds host `host`'s mount and UTS namespaces (inside its
        network namespace, so the teardown kills it with the rest)."""
        holder = subprocess.Popen(
            ["ip", "netns", "exec", self.namespaces[host], "unshare", "--mount", "--uts",
             "--propagation", "private", "sh", "-c",
             _host_script(host, self.shared, self.addresses)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._holders.append(holder)
        assert holder.stdout is not None
        if holder.stdout.readline().strip() != "ready":
            holder.kill()
            raise RuntimeError(f"emulated host {host}: its private filesystem could not be set "
                               f"up ({holder.communicate()[1].strip()[-500:]})")

    def down(self) -> None:
        """Removes the namespaces (and everything running in them); idempotent."""
        teardown([*self.namespaces, self.bridge_namespace])
        for holder in self._holders:
            with contextlib.suppress(OSError):
                holder.kill()
            holder.wait()
        self._holders = []
        if self.cgroup is not None:
            remove_cgroup(self.cgroup)
        if self._watchdog is not None:
            with contextlib.suppress(OSError):
                assert self._watchdog.stdin is not None
                self._watchdog.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._watchdog.wait(10)
            self._watchdog = None

    def _start_watchdog(self) -> None:
        self._watchdog = subprocess.Popen(
            # The file as a script: the watchdog imports neither tfdist nor TensorFlow.
            [sys.executable, os.path.abspath(__file__), "_watch", *self.namespaces,
             self.bridge_namespace],
            stdin=subprocess.PIPE, start_new_session=True, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)

    # -- running workers -----------------------------------------------------------------------
    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """`argv` run on emulated host `host`: in its network, mount and UTS namespaces and its
        working directory (in the straggler's cgroup on the slow host)."""
        command = ["nsenter", "--target", str(self._holders[host].pid), "--net", "--mount",
                   "--uts", "--wd", "--", *argv]
        if host == self.slow_host:  # joins the cgroup before `ip netns exec` hides /sys's
            command = ["sh", "-c", f'echo $$ > {self.cgroup}/cgroup.procs && exec "$@"', "sh",
                       *command]
        return command

    def tf_config(self, index: int, ps: int = 0) -> str:
        """TF_CONFIG for worker `index` (one per host); with `ps`, parameter server k runs on
        host 0 at port WORKER_PORT + 1 + k, and index -1 - k names it."""
        from tfdist.tools.launch import cluster_config

        servers = [f"{self.addresses[0]}:{WORKER_PORT + 1 + k}" for k in range(ps)]
        workers = [f"{a}:{WORKER_PORT}" for a in self.addresses]
        task = index + ps if index >= 0 else -1 - index
        return cluster_config(task, servers + workers, ps)

    def run_workers(self, argv: Sequence[str] | Callable[[int], Sequence[str]], timeout: float,
                    env: dict | None = None, echo: bool = False,
                    on_line: Callable[[int, str], None] | None = None,
                    ps: int = 0) -> list[Any]:
        """`argv` (or `argv(host)`) as one TF_CONFIG worker per host, and `ps` parameter servers
        on host 0 (after the workers in the results); stops all if one fails
        (tfdist.tools.launch.run_processes)."""
        from tfdist.tools.launch import run_processes, share_cores, with_secret

        base = share_cores(with_secret(dict(os.environ if env is None else env)), self.hosts)
        commands = [(self.command(i, argv(i) if callable(argv) else argv),
                     {**base, "TF_CONFIG": self.tf_config(i, ps)}) for i in range(self.hosts)]
        commands += [(self.command(0, argv(0) if callable(argv) else argv),
                      {**base, "TF_CONFIG": self.tf_config(-1 - k, ps)}) for k in range(ps)]
        labels = [f"worker {i}" for i in range(self.hosts)] + [f"ps {k}" for k in range(ps)]
        return run_processes(commands, timeout, echo=echo, on_line=on_line, labels=labels)

    def run_horovod_workers(self, argv: Sequence[str] | Callable[[int], Sequence[str]],
                            timeout: float, env: dict | None = None, echo: bool = False,
                            on_line: Callable[[int, str], None] | None = None) -> list[Any]:
        """`argv` as one Horovod (Gloo) rank per host: what `horovodrun --gloo` does, without
        its ssh: Horovod's rendezvous server runs on host 0, each rank gets its HOROVOD_*
        variables and talks over its emulated link (eth0)."""
        from tfdist.tools.launch import run_processes, share_cores

        server = subprocess.Popen(
            self.command(0, [sys.executable, "-c", _RENDEZVOUS,
                             ",".join(f"{a}:1" for a in self.addresses), str(self.hosts)]),
            stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert server.stdout is not None
            port = server.stdout.readline().strip()
            if not port.isdigit():
                raise RuntimeError("Horovod's rendezvous server did not start on host 0 "
                                   "(is Horovod installed? launch/build_horovod.sh)")
            base = share_cores(dict(os.environ if env is None else env), self.hosts)
            base.update(HOROVOD_GLOO_RENDEZVOUS_ADDR=self.addresses[0],
                        HOROVOD_GLOO_RENDEZVOUS_PORT=port, HOROVOD_CONTROLLER="gloo",
                        HOROVOD_CPU_OPERATIONS="gloo", HOROVOD_GLOO_IFACE="eth0")
            n = str(self.hosts)
            # Horovod 0.28's process sets open their Gloo device by the host name, not by
            # HOROVOD_GLOO_IFACE: each rank gets a UTS namespace named after its address.
            commands = [(self.command(i, ["unshare", "--uts", "sh", "-c",
                                          f'hostname {self.addresses[i]} && exec "$@"', "sh",
                                          *(argv(i) if callable(argv) else argv)]),
                         {**base, "HOROVOD_HOSTNAME": self.addresses[i], "HOROVOD_RANK": str(i),
                          "HOROVOD_SIZE": n, "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "1",
                          "HOROVOD_CROSS_RANK": str(i), "HOROVOD_CROSS_SIZE": n})
                        for i in range(self.hosts)]
            return run_processes(commands, timeout, echo=echo, on_line=on_line)
        finally:
            server.kill()
            server.wait()

    def tx_bytes(self) -> list[int]:
        """Bytes each host has sent on its link so far (its interface's counter)."""
        counts = []
        for ns in self.namespaces:
            out = subprocess.run(["ip", "-n", ns, "-s", "-j", "link", "show", "dev", "eth0"],
                                 capture_output=True, text=True, check=True).stdout
            counts.append(int(json.loads(out)[0]["stats64"]["tx"]["bytes"]))
        return counts


def _software() -> list[str]:
    """What a host must see read-only to run tfdist: this Python's installation, the virtual
    environment and the checkout (or site-packages) tfdist is imported from."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../tfdist
    paths = {sys.prefix, sys.base_prefix, os.path.dirname(package),
             os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))}
    return sorted({os.path.realpath(p) for p in paths})


def _cgroup_v1() -> list[tuple[str, str]]:
    """(directory name, mount options) of the machine's cgroup v1 hierarchies."""
    found = []
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            _, where, kind, options = line.split()[:4]
            if kind == "cgroup" and where.startswith("/sys/fs/cgroup/"):
                controllers = [o for o in options.split(",")
                               if o not in ("rw", "ro", "relatime", "nosuid", "nodev", "noexec")]
                if controllers:
                    found.append((where.rsplit("/", 1)[1], ",".join(controllers)))
    return found


def _host_script(host: int, shared: Sequence[str], addresses: Sequence[str]) -> str:
    """The shell script that sets up host `host`'s filesystem view (with an /etc/hosts that
    names every host, as a cluster's DNS would), then holds it."""
    home = os.path.realpath(os.path.expanduser("~"))
    keep = [(p, "ro") for p in _software() if p not in shared] + [(p, "rw") for p in shared]
    keep.sort(key=lambda item: len(item[0]))  # parents before children
    lines = ["set -e", f"hostname host{host}", "mount -t tmpfs tfdist-stage /mnt"]
    for k, (path, mode) in enumerate(keep):  # set aside what stays visible ...
        lines.append(f"mkdir -p /mnt/{k} && mount --rbind {shlex.quote(path)} /mnt/{k}")
        if mode == "ro":
            lines.append(f"mount -o remount,bind,ro /mnt/{k}")
    for private in ("/tmp", home, "/dev/shm"):  # ... cover what is the host's own ...
        lines.append(f"mount -t tmpfs tfdist-private {shlex.quote(private)}")
    for k, (path, _) in enumerate(keep):  # ... and put it back
        lines.append(f"mkdir -p {shlex.quote(path)} && mount --move /mnt/{k} "
                     f"{shlex.quote(path)}")
    names = "\\n".join(f"{a} host{i}" for i, a in enumerate(addresses))
    # `ip netns exec` mounted a fresh /sys: give back the machine's cgroup v1 hierarchies
    # (what a host's daemons, SLURM's slurmd among them, expect to find); best effort.
    lines.append("mount -t tmpfs tfdist-cgroup /sys/fs/cgroup 2>/dev/null && { "
                 + " ".join(f"mkdir -p /sys/fs/cgroup/{n} && mount -t cgroup -o {o} cgroup "
                            f"/sys/fs/cgroup/{n} 2>/dev/null;" for n, o in _cgroup_v1())
                 + " true; } || true")
    lines += ["umount /mnt",
              f"printf '127.0.0.1 localhost\\n{names}\\n' > /tmp/.hosts",
              "mount --bind /tmp/.hosts /etc/hosts",
              f"mkdir -p {shlex.quote(home)}/work",
              f"cd {shlex.quote(home)}/work", "echo ready", "exec sleep 2147483647"]
    return "\n".join(lines)


# Horovod's rendezvous (what horovodrun serves): argv = hosts "addr:slots,...", number of ranks.
_RENDEZVOUS = """
import sys, time
from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
from horovod.runner.http.http_server import RendezvousServer
server = RendezvousServer()
port = server.start()
server.init(get_host_assignments(parse_hosts(sys.argv[1]), int(sys.argv[2])))
print(port, flush=True)
time.sleep(10**9)
"""


def check_straggler(hosts: int, slow_host: int, cpu_share: float | None) -> None:
    """Raises, before anything is created, if the straggler cannot be emulated."""
    if isinstance(hosts, bool) or not isinstance(hosts, int):
        raise ValueError(f"hosts={hosts!r}: must be an integer >= 1")
    if isinstance(slow_host, bool) or not isinstance(slow_host, int) or \
            not 0 <= slow_host < hosts:
        raise ValueError(f"slow_host={slow_host!r}: must be a host index in [0, {hosts})")
    cores = os.cpu_count() or 1
    if not isinstance(cpu_share, (int, float)) or not 0 < cpu_share <= cores:
        raise ValueError(f"cpu_share={cpu_share!r}: must be a number of cores in (0, {cores}]")
    if not os.path.exists(f"{CGROUP_CPU}/cpu.cfs_quota_us"):
        raise RuntimeError(f"A straggler needs the cgroup v1 cpu controller ({CGROUP_CPU}), "
                           "which this machine lacks.")


def remove_cgroup(path: str) -> None:
    """Kills what is left in a straggler's cgroup and removes it."""
    for _ in range(50):
        try:
            with open(f"{path}/cgroup.procs") as f:
                pids = f.read().split()
        except FileNotFoundError:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        try:
            os.rmdir(path)
            return
        except OSError:
            time.sleep(0.1)


def _tc(ns: str, *args: str) -> None:
    out = subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True,
                         text=True)
    if out.returncode:
        raise RuntimeError(f"`tc {' '.join(args)}` in {ns} failed: {out.stderr.strip()}")


def namespaces() -> list[str]:
    """tfdist's emulated-cluster namespaces on this machine."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines()
            if line.split() and line.split()[0].startswith(PREFIX)]


def teardown(names: Sequence[str]) -> None:
    """Kills every process in the namespaces, then deletes them (their veths go with them)."""
    present = set(namespaces())
    for ns in names:
        if ns not in present:
            continue
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                              text=True).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _owner_alive(ns: str) -> bool:
    m = re.match(rf"{PREFIX}(\d+)-", ns)
    if not m:
        return False
    try:
        os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(everything: bool = False) -> list[str]:
    """Removes the namespaces (and stragglers' cgroups) of clusters whose owner process is gone
    (all with `everything`)."""
    stale = [ns for ns in namespaces() if everything or not _owner_alive(ns)]
    teardown(stale)
    with contextlib.suppress(OSError):
        for name in os.listdir(CGROUP_CPU):
            if name.startswith(PREFIX) and (everything or not _owner_alive(name)):
                remove_cgroup(f"{CGROUP_CPU}/{name}")
    return stale


def _watch(names: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        sys.stdin.buffer.read()  # returns when the owner closes the pipe or dies
    teardown(names)


def _addresses(subnet: str, hosts: int) -> list[str]:
    return [f"{subnet}.{i + 1}" for i in range(hosts)]


def _address_of(ns: str) -> str | None:
    """The address of the emulated host whose namespace is `ns` (None: not a host's)."""
    out = subprocess.run(["ip", "-n", ns, "-j", "addr", "show", "dev", "eth0"],
                         capture_output=True, text=True).stdout
    try:
        return next((a["local"] for link in json.loads(out or "[]")
                     for a in link.get("addr_info", []) if "local" in a), None)
    except ValueError:
        return None


@contextlib.contextmanager
def _subnet_lock():
    """Held while a cluster picks its subnet and creates its hosts (a machine-wide lock)."""
    import fcntl

    with open(os.path.join("/run/lock" if os.path.isdir("/run/lock") else "/tmp",
                           "tfdist-emulated.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _free_subnet() -> str:
    """The first of SUBNET's /24 neighbours (10.213.0, 10.213.1, ...) no cluster on this
    machine uses: `ssh HOST` finds the host by its address."""
    taken = {address.rsplit(".", 1)[0] for address in map(_address_of, namespaces()) if address}
    base, third = SUBNET.rsplit(".", 1)
    for k in range(int(third), 256):
        if f"{base}.{k}" not in taken:
            return f"{base}.{k}"
    raise RuntimeError(f"every subnet {base}.0-255 is taken by an emulated cluster: remove "
                       "stale ones with `python -m tfdist.emulated down`")


def holder_of(address: str) -> int | None:
    """The pid of the process holding the namespaces of the emulated host at `address`."""
    for ns in namespaces():
        if _address_of(ns) != address:
            continue
        for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                  text=True).stdout.split():
            with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().split(b"\0")[:2] == [b"sleep", b"2147483647"]:
                    return int(pid)
    return None


def _ssh(words: list[str]) -> int:
    """`[options] HOST COMMAND...` as ssh takes them: options are ignored (`-o` with its
    value), COMMAND runs under `sh -c` in the host's namespaces, in its working directory."""
    words = list(words)
    while words and words[0].startswith("-"):
        option = words.pop(0)
        if option in ("-o", "-p", "-l", "-i", "-F", "-J") and words:
            words.pop(0)
    if len(words) < 2:
        print("usage: python -m tfdist.emulated ssh [options] HOST COMMAND", file=sys.stderr)
        return 255
    host, command = words[0], " ".join(words[1:])
    pid = holder_of(host)
    if pid is None:
        print(f"ssh: no emulated host has the address {host}", file=sys.stderr)
        return 255
    os.execvp("nsenter", ["nsenter", "--target", str(pid), "--net", "--mount", "--uts",
                          "--wd", "--", "sh", "-c", command])
    return 255  # not reached


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tfdist.emulated",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="create a cluster and hold it until interrupted")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--bandwidth", default="1gbit")
    up.add_argument("--delay", default=None)
    up.add_argument("--hold", type=float, default=None, help="seconds to hold (default: forever)")
    down = sub.add_parser("down", help="remove clusters whose owner is gone (--all: every one)")
    down.add_argument("--all", action="store_true")
    watch = sub.add_parser("_watch")
    watch.add_argument("names", nargs="*")
    ssh = sub.add_parser("ssh", help="ssh's stand-in for the launcher: `ssh [options] HOST "
                         "COMMAND` runs COMMAND with sh on the emulated host whose address is "
                         "HOST (python -m tfdist.launch --ssh 'python -m tfdist.emulated ssh')")
    ssh.add_argument("words", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["ssh"]:  # ssh's options are not ours: no argparse
        return _ssh(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "_watch":
        _watch(args.names)
        return 0
    if args.command == "down":
        removed = sweep(everything=args.all)
        print(f"removed {len(removed)} namespaces" + (f": {' '.join(removed)}" if removed else ""))
        return 0
    try:
        cluster = EmulatedCluster(args.hosts, args.bandwidth, args.delay)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with cluster:
        for i, (ns, address) in enumerate(zip(cluster.namespaces, cluster.addresses)):
            print(f"host {i}: {address} (ip netns exec {ns} ...)")
        print(f"ready: {args.hosts} hosts, {args.bandwidth} links", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            time.sleep(args.hold if args.hold is not None else 10**9)
    return 0


if __name__ == "__main__":
    sys.exit(main())
