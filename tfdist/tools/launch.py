"""Start worker processes (TF_CONFIG or horovodrun) with a hard timeout and clean-up.

Used by the test rig and by `python -m tfdist.launch`:

    python -m tfdist.launch --workers 2 -- tfdist train --set engine.name=multi_worker
    python -m tfdist.launch --hosts node1:2,node2:2 -- .venv/bin/tfdist train ...
    python -m tfdist.launch --hostfile hosts.txt --port 23456 -- .venv/bin/tfdist train ...
    python -m tfdist.launch --elastic --workers 3 --min-workers 2 -- tfdist train ...
    python -m tfdist.launch --ps 1 --workers 2 -- tfdist train --set engine.name=parameter_server
    python -m tfdist.launch --horovod -np 4 --hostfile hosts.txt -- python train.py
    python -m tfdist.launch --horovod -np 4 --min-np 2 --max-np 8 \
        --host-discovery-script ./discover_hosts.sh -- python train.py      # elastic Horovod

TF_CONFIG workers: `--workers N` runs N workers on 127.0.0.1 with free ports; `--hosts` or
`--hostfile` (lines `host slots=N`, `host:N` or `host`, as for horovodrun and MPI) runs
`slots` workers per host, listening on `host:port`, `host:port+1`, ...; workers on this
machine start directly, the others through ssh (`--ssh`, default `ssh -tt -o BatchMode=yes`,
so closing the session stops the remote worker) in the same working directory. Output is
streamed with a `[worker i]` prefix; if one worker fails, the others are stopped; the exit code
is the first failure's (or 0). Every local process runs in its own process group, killed on exit.

Parameter servers (`--ps P`): the first P tasks are "ps" tasks in TF_CONFIG, the others
"worker" tasks (with `--workers N`, N + P local processes; with hosts, the first P slots). A
worker that fails does not stop the others: it is started again with the same task (at most
`--max-restarts` restarts in all, default 3) and resumes at the step the servers hold for it, so
its share of the data is trained on; past that, the servers go on without it. The exit code is
the first parameter server's failure, else the chief's (worker 0).

Elastic (`--elastic --workers N [--min-workers A] [--max-restarts R]`): when workers fail (a
crash, a kill, the OOM killer), the launcher stops the others and starts the job again on the
workers left, with TF_CONFIG rewritten and TFDIST_ELASTIC=1, so `tfdist train` (with
`train.checkpoint_steps`) resumes its last backup at the new size. With `--hostfile F` instead
of `--workers` the job runs on F's slots (at most `--max-workers`) and F is read again every
second: when it offers more slots than the job uses (a host added, or a lost worker's slot
back), the job grows to them at its next backup (workers joining by themselves). A worker
killed by a signal is reported as such (`worker 1 was killed by SIGKILL (signal 9)`, exit code
128 + N); a command that does not exist is reported in one line (exit code 127).

SLURM: `srun python -m tfdist.launch --slurm [--ps P] [--requeue] -- tfdist train ...` runs on
every task of a job step: it writes the task's TF_CONFIG from SLURM's environment and becomes
the command (`tfdist.tools.slurm`); `launch/slurm/train.sbatch` is a batch script that uses it.

Horovod: `--horovod` builds the `horovodrun` command (Gloo by default, `--mpi` for MPI; hosts
from `--hosts`/`--hostfile`; the elastic flags passed through), prints it and runs it under the
same timeout; `--dry-run` only prints it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tfdist.security import SECRET_ENV, SECRET_FILE_ENV, new_secret

PREEMPTED_EXIT = 76  # tfdist.callbacks.PREEMPTED_EXIT: backed up after a preemption notice
PREEMPTION_GRACE = 30.0  # seconds workers get to back up and exit after a notice


@dataclass
class WorkerResult:
    rank: int
    # None: stopped by the launcher (the timeout, or another worker failed); -N: killed by
    # signal N from elsewhere (the OOM killer, kill -9); else the exit status.
    returncode: int | None
    output: str
    ended_at: float | None = None  # time.monotonic() when it was seen to end by itself

    def describe(self) -> str:
        """What happened to the worker, for the launcher's report."""
        if self.returncode is None:
            return "was stopped"
        if self.returncode < 0:
            number = -self.returncode
            with contextlib.suppress(ValueError):
                return f"was killed by {signal.Signals(number).name} (signal {number})"
            return f"was killed by signal {number}"
        return f"exited with {self.returncode}"

    @property
    def exit_code(self) -> int:
        """The shell's number for it: the status, or 128 + the signal."""
        if self.returncode is None:
            return 1
        return 128 - self.returncode if self.returncode < 0 else self.returncode


class CommandNotFound(OSError):
    pass


THREADS_ENV = "TF_NUM_INTRAOP_THREADS"  # read by TensorFlow when its runtime starts


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. a SLURM allocation's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def share_cores(env: dict[str, str], processes: int, cores: int | None = None) -> dict[str, str]:
    """`env` for one of `processes` TensorFlow processes sharing one machine's `cores`: with
    TF_NUM_INTRAOP_THREADS set to their share (at least 1), unless `env` already sets it.

    Each TensorFlow process otherwise sizes its intra-op thread pool to every core it may run
    on, so N processes on one machine run N times as many compute threads as there are cores."""
    if processes <= 1 or THREADS_ENV in env:
        return env
    return {**env, THREADS_ENV: str(max(1, (cores or usable_cores()) // processes))}


_HELD: list[socket.socket] = []  # the ports `held_ports` chose, until `release_ports`


def held_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports that the OS chooses on `host` and that stay held until
    `release_ports()`: each is bound (with SO_REUSEADDR, never listening), so no other process
    gets it from a bind to port 0 or as a connection's source port, while the job's own servers,
    which set SO_REUSEADDR as gRPC does, bind and listen on it."""
    ports = []
    for _ in range(count):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        _HELD.append(s)
        ports.append(s.getsockname()[1])
    return ports


def release_ports() -> None:
    """Lets go of every port `held_ports` holds (once the processes using them have ended)."""
    while _HELD:
        _HELD.pop().close()


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports that are free on `host` right now."""
    with contextlib.ExitStack() as stack:
        socks = []
        for _ in range(count):
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]


def cluster_config(index: int, addresses: list[str], ps: int = 0) -> str:
    """TF_CONFIG for task `index` of the tasks at `addresses` ("host:port" each): the first
    `ps` are parameter servers ("ps"), the others workers."""
    if ps:
        kind, position = ("ps", index) if index < ps else ("worker", index - ps)
        return json.dumps({"cluster": {"ps": addresses[:ps], "worker": addresses[ps:]},
                           "task": {"type": kind, "index": position}})
    return json.dumps({"cluster": {"worker": addresses},
                       "task": {"type": "worker", "index": index}})


def tf_config(index: int, ports: list[int], host: str = "127.0.0.1") -> str:
    """TF_CONFIG for worker `index` of a cluster of len(ports) workers on `host`."""
    return cluster_config(index, [f"{host}:{p}" for p in ports])


def _pump(proc: subprocess.Popen, rank: int, sink: list[str], echo: bool,
          on_line: Callable[[int, str], None] | None, label: str) -> None:
    assert proc.stdout is not None
    for line in iter(proc.stdout.readline, ""):
        line = line.replace("\r\n", "\n")  # ssh -tt sessions end lines with CRLF
        sink.append(line)
        if echo:
            sys.stdout.write(f"[{label}] {line}")
            sys.stdout.flush()
        if on_line is not None:
            on_line(rank, line)


def _kill_group(proc: subprocess.Popen) -> None:
    """Stops the process and everything in its group: SIGTERM, then SIGKILL to what is left
    after 5 s. The whole group, not only its leader: a shell that started the worker (ssh's
    remote command) dies at once on SIGTERM, while the worker takes the signal as a preemption
    notice and would live on, holding its port."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None and not _group_alive(proc.pid):
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (proc.poll() is None or _group_alive(proc.pid)):
            time.sleep(0.05)
    proc.wait()


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # preemption notices, passed to workers
# A process the launcher reaches over ssh gets notices as a line on its standard input
# (`tfdist.callbacks.channel`): a signal to the local ssh client would end the session instead.
NOTICES_ENV = "TFDIST_NOTICES"  # tfdist.callbacks.channel.NOTICES_ENV


def _by_line(env: dict[str, str]) -> bool:
    return env.get(NOTICES_ENV) == "stdin"


@contextlib.contextmanager
def _forwarding(procs: list[subprocess.Popen], noticed: list[float], by_line: list[bool]):
    """While inside: SIGTERM and SIGUSR1 sent to this launcher go to every worker (a preemption
    notice: the workers back up and exit): to its process group, or as a line on its standard
    input where `by_line` says so (a worker over ssh); the time is noted."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(number, frame):
        if not noticed:
            print(f"[launch] {signal.Signals(number).name} received: passing it to the workers "
                  "(they back up at the step in flight and exit)", file=sys.stderr, flush=True)
        noticed.append(time.monotonic())
        for proc, line in zip(procs, by_line):
            if proc.poll() is not None:
                continue
            if line and proc.stdin is not None:
                with contextlib.suppress(OSError, ValueError):
                    proc.stdin.write(json.dumps({"notice": signal.Signals(number).name}) + "\n")
                    proc.stdin.flush()
            else:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, number)

    previous = {number: signal.signal(number, forward) for number in FORWARDED_SIGNALS}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def run_processes(commands: list[tuple[list[str], dict[str, str]]], timeout: float,
                  echo: bool = False, stop_on_failure: bool | frozenset[int] = True,
                  on_line: Callable[[int, str], None] | None = None,
                  labels: list[str] | None = None,
                  restartable: frozenset[int] = frozenset(), max_restarts: int = 0,
                  watch: Callable[[], None] | None = None,
                  grace: float = PREEMPTION_GRACE,
                  on_start: Callable[[int, subprocess.Popen], None] | None = None,
                  servers: frozenset[int] = frozenset(),
                  helpers: frozenset[int] = frozenset(),
                  ) -> list[WorkerResult]:
    """Runs the commands concurrently; returns when all end, one fails, or `timeout` passes.

    Args:
        commands: (argv, environment) per process.
        timeout: Seconds before every process still running is killed.
        echo: Stream output with a `[worker i]` prefix.
        stop_on_failure: Stop the others (after a 10 s grace for their own error reports)
            when one exits non-zero (and is not started again); or the processes whose
            failure does so (e.g. the parameter servers).
        on_line: Called with (rank, line) for every line a process writes, as it comes.
        labels: The echo prefix of each process (default `worker i`).
        restartable: Processes started again (the same command) when they fail, at most
            `max_restarts` times in all; their result is their last run's.
        watch: Called about once a second while the processes run.
        grace: Seconds the processes get to back up and exit after a preemption notice (a
            SIGTERM or SIGUSR1 to this process, passed on to them, or a process that exits
            with PREEMPTED_EXIT) before those still running are killed.
        on_start: Called with (rank, process) for every process started; with it, each
            process's standard input is a pipe the caller may write to (else /dev/null).
        servers: The parameter servers: once every one has exited 0 the job is over; nothing is
            started again, and a process still running (a worker declared lost that came back)
            gets `JOB_OVER_GRACE` seconds to hear it from the servers and exit, then is stopped
            and counted as done.
        helpers: Processes that serve the others until they end (the tf.data service): not
            waited for, stopped once every other process has ended; one that exits is said in
            one line (and stops the job only if it is in `stop_on_failure`).
    """
    procs: list[subprocess.Popen] = []
    over: set[int] = set()  # stopped because the servers had finished the job
    sinks: list[list[str]] = [[] for _ in commands]
    threads = []
    stopped: set[int] = set()
    ended: dict[int, float] = {}
    restarts = 0

    def start(rank: int) -> subprocess.Popen:
        argv, env = commands[rank]
        try:
            proc = subprocess.Popen(
                argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                stdin=subprocess.PIPE if on_start is not None or _by_line(env) else
                subprocess.DEVNULL,
                start_new_session=True,
            )
        except (FileNotFoundError, PermissionError) as e:
            raise CommandNotFound(e.errno, f"cannot run {argv[0]!r}: {e.strerror}") from None
        if on_start is not None:
            on_start(rank, proc)
        label = labels[rank] if labels else f"worker {rank}"
        t = threading.Thread(target=_pump, args=(proc, rank, sinks[rank], echo, on_line, label),
                             daemon=True)
        t.start()
        threads.append(t)
        return proc

    noticed: list[float] = []  # when preemption notices arrived
    over_at: float | None = None  # when the last server exited 0: the job is over
    try:
        with _forwarding(procs, noticed, [_by_line(env) for _, env in commands]):
            for rank in range(len(commands)):
                procs.append(start(rank))
            deadline = time.monotonic() + timeout
            failed_at = None
            critical = (stop_on_failure if isinstance(stop_on_failure, frozenset) else
                        frozenset(range(len(procs)) if stop_on_failure else ()))
            watched = time.monotonic()
            while time.monotonic() < deadline:
                if watch is not None and time.monotonic() - watched >= 1:
                    watched = time.monotonic()
                    watch()
                codes = [p.poll() for p in procs]
                if not noticed and PREEMPTED_EXIT in codes:
                    noticed.append(time.monotonic())  # one was preempted: the others follow
                if noticed:  # preempted: every process backs up and exits; none is restarted
                    if all(c is not None for c in codes) or \
                            time.monotonic() - noticed[0] > grace:
                        break
                    time.sleep(0.1)
                    continue
                if failed_at is None and any(codes[i] not in (None, 0) for i in critical):
                    failed_at = time.monotonic()  # nothing is started again from now on
                if over_at is None and servers and all(codes[i] == 0 for i in servers):
                    over_at = time.monotonic()
                if over_at is not None and time.monotonic() - over_at > JOB_OVER_GRACE:
                    for i, c in enumerate(codes):
                        if c is None:
                            label = labels[i] if labels else f"worker {i}"
                            print(f"[launch] {label}: still running {JOB_OVER_GRACE:g} s after "
                                  "the parameter servers finished the job; stopped",
                                  file=sys.stderr, flush=True)
                            over.add(i)
                    break
                for i in helpers:
                    if codes[i] is not None and i not in ended:
                        label = labels[i] if labels else f"worker {i}"
                        print(f"[launch] {label} {WorkerResult(i, codes[i], '').describe()}"
                              + ("; the job cannot be served without it and stops" if i in critical
                                 else "; the job goes on without it"),
                              file=sys.stderr, flush=True)
                for i, c in enumerate(codes):
                    if c not in (None, 0) and i in restartable and restarts < max_restarts \
                            and failed_at is None and over_at is None:
                        restarts += 1
                        label = labels[i] if labels else f"worker {i}"
                        print(f"[launch] {label} {WorkerResult(i, c, '').describe()}; starting it "
                              f"again (restart {restarts} of {max_restarts})", file=sys.stderr,
                              flush=True)
                        procs[i] = start(i)
                        codes[i] = None
                    if codes[i] is not None:
                        ended.setdefault(i, time.monotonic())
                if all(c is not None for i, c in enumerate(codes) if i not in helpers):
                    break
                if failed_at is not None and time.monotonic() - failed_at > 10:
                    break
                time.sleep(0.1)
    finally:
        stopped = {i for i, p in enumerate(procs) if p.poll() is None}
        for p in procs:
            _kill_group(p)
        for t in threads:
            t.join(5)
        release_ports()
    return [
        WorkerResult(i, 0 if i in over else None if i in stopped else p.returncode,
                     "".join(sinks[i]), ended.get(i))
        for i, p in enumerate(procs)
    ]


def lost_workers(results: list[WorkerResult]) -> list[WorkerResult]:
    """The workers whose failure stopped the job, not those that failed because of it: those
    killed by a signal, else the first to fail (and any within a second of it)."""
    failed = [r for r in results if r.returncode not in (0, None)]
    # Killed by a signal: here (a negative status), or on a remote host, where the shell that
    # ran it reports 128 + the signal.
    killed = [r for r in failed if r.returncode is not None and (
        r.returncode < 0 or 128 < r.returncode <= 128 + 64)]
    if killed or not failed:
        return killed
    first = min(r.ended_at or 0.0 for r in failed)
    return [r for r in failed if (r.ended_at or 0.0) <= first + 1.0]


DEFAULT_PORT = 23456
DATA_PORT = 5050  # the tf.data service's dispatcher (--data-hosts); its data workers next
JOB_OVER_GRACE = 20.0  # seconds a worker may run on after the parameter servers finished
DEFAULT_SSH = "ssh -tt -o BatchMode=yes"
RESIZE_EXIT = 75  # tfdist.callbacks.RESIZE_EXIT: every worker asks to be run at another size
REQUEST_TAG = "[tfdist] elastic request "  # tfdist.callbacks.channel.REQUEST_TAG
MAX_RESIZES = 16


def run_elastic(argv: list[str], workers: int | None, min_workers: int | None,
                max_restarts: int, timeout: float, echo: bool = True,
                max_workers: int | None = None, hostfile: str | None = None,
                port: int = DEFAULT_PORT, ssh: str = DEFAULT_SSH) -> int:
    """Runs `argv` as TF_CONFIG workers (`workers` local ones, or the slots of `hostfile`);
    when workers fail, stops the others and starts the job again on the workers left (at least
    `min_workers`, at most `max_restarts` times), with TF_CONFIG rewritten for the new set and
    TFDIST_ELASTIC=1 (so `tfdist train` resumes its backup at the new size). When every worker
    exits with RESIZE_EXIT (`tfdist.callbacks.ElasticResize`, `ElasticJoin`), it starts the
    job at the size requested (within [min_workers, max_workers]).

    With `hostfile` the job starts on its slots (at most `max_workers`), and the file is read
    again every second: when it offers more slots than the job runs on (a host added, or slots
    back after a loss), the launcher tells the job (TFDIST_ELASTIC_DIR/offer.json), which grows
    at its next backup (`ElasticJoin`). Returns the exit code."""
    offered = _slots(read_hostfile(hostfile)) if hostfile else None
    if workers is None:
        if offered is None:
            raise ValueError("--elastic needs --workers N (local workers) or --hostfile")
        workers = offered if max_workers is None else min(offered, max_workers)
    max_workers = workers if max_workers is None else max_workers
    min_workers = workers if min_workers is None else min_workers
    if not 1 <= min_workers <= workers:
        raise ValueError(f"--min-workers must be in [1, --workers={workers}]. "
                         f"Received: {min_workers}")
    if max_workers < workers:
        raise ValueError(f"--max-workers must be >= --workers={workers}. Received: {max_workers}")
    if max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0. Received: {max_restarts}")
    deadline = time.monotonic() + timeout
    env = {**with_secret(dict(os.environ)), "TFDIST_ELASTIC": "1",
           "TFDIST_ELASTIC_MIN_WORKERS": str(min_workers),
           "TFDIST_ELASTIC_MAX_WORKERS": str(max_workers)}
    job = _ElasticJob(argv, env, min_workers, max_workers, hostfile, port, ssh)
    return job.loop(workers, max_restarts, deadline, echo)


def _slots(hosts: list[tuple[str, int]]) -> int:
    return sum(slots for _, slots in hosts)


class _ElasticJob:
    """The elastic launcher's loop: run, and on a loss, a resize request or an offer of more
    slots, start again at the new size. It talks to the job through what reaches every host
    (`tfdist.callbacks.resize`): the environment of each start, the chief's standard input
    (offers) and standard output (requests); never through a file."""

    def __init__(self, argv, env, min_workers, max_workers, hostfile, port, ssh):
        self.argv, self.env = argv, env
        self.min_workers, self.max_workers = min_workers, max_workers
        self.hostfile, self.port, self.ssh = hostfile, port, ssh
        self.hosts = read_hostfile(hostfile) if hostfile else None
        self.size = 0
        self.offered = 0
        self.measured: dict[int, float] = {}  # examples/s per size, reported by the job
        self.request: dict | None = None  # the chief's resize request of this run
        self.chief: subprocess.Popen | None = None

    def _commands(self, size: int):
        env = {**self.env, "TFDIST_ELASTIC_MEASURED": json.dumps(
            {str(k): v for k, v in self.measured.items()})}
        if self.hosts is None:
            return host_commands(self.argv, [("127.0.0.1", size)], env=env)
        placed, left = [], size
        for host, slots in self.hosts:  # the first `size` slots of the hostfile
            if left:
                placed.append((host, min(slots, left)))
                left -= placed[-1][1]
        if env.get(SECRET_ENV):
            send_secret([h for h, _ in placed], env[SECRET_ENV], self.ssh)
        return host_commands(self.argv, placed, self.port, self.ssh, env=env)

    def _started(self, rank: int, proc: subprocess.Popen) -> None:
        if rank == 0:
            self.chief = proc

    def _on_line(self, rank: int, line: str) -> None:
        """Takes the chief's resize request from its output (checked before it is used)."""
        if rank != 0 or not line.startswith(REQUEST_TAG):
            return
        try:
            self.request = self._checked(json.loads(line[len(REQUEST_TAG):]))
        except (ValueError, TypeError, KeyError) as e:
            self.request = None
            print(f"[launch] elastic: ignoring a malformed resize request from worker 0 ({e}): "
                  f"{line.strip()[:300]}", file=sys.stderr, flush=True)

    def _checked(self, request) -> dict:
        size, reason = request["size"], request["reason"]
        if isinstance(size, bool) or not isinstance(size, int) or \
                not self.min_workers <= size <= self.max_workers:
            raise ValueError(f"size {size!r} is not in [--min-workers={self.min_workers}, "
                             f"--max-workers={self.max_workers}]")
        if not isinstance(reason, str) or len(reason) > 1000:
            raise ValueError("the reason must be a text of at most 1,000 characters")
        measured = {int(k): float(v) for k, v in dict(request.get("measured") or {}).items()}
        if len(measured) > 1024 or any(not 1 <= k <= 1 << 20 or not 0 <= v < 1e12
                                       for k, v in measured.items()):
            raise ValueError("the measurements are not {size: examples per second}")
        return {"size": size, "reason": reason, "measured": measured}

    def _watch(self) -> None:
        """Reads the hostfile again; offers the job the slots it does not use (once each)."""
        try:
            hosts = read_hostfile(self.hostfile)
        except ValueError:
            return  # being rewritten, or gone: keep what we know
        self.hosts = hosts
        offer = min(_slots(hosts), self.max_workers)
        if offer > max(self.size, self.offered) and self.chief is not None:
            self.offered = offer
            with contextlib.suppress(OSError, ValueError):  # the chief may just have ended
                assert self.chief.stdin is not None
                self.chief.stdin.write(json.dumps({"offer": offer}) + "\n")
                self.chief.stdin.flush()
            print(f"[launch] elastic: {self.hostfile} offers {_slots(hosts)} slots; the job "
                  f"grows from {self.size} to {offer} workers at its next backup",
                  file=sys.stderr, flush=True)

    def loop(self, size: int, max_restarts: int, deadline: float, echo: bool) -> int:
        restarts = resizes = 0
        while True:
            self.size, self.offered, self.request, self.chief = size, 0, None, None
            results = run_processes(self._commands(size), max(1.0, deadline - time.monotonic()),
                                    echo=echo, watch=self._watch if self.hostfile else None,
                                    on_line=self._on_line, on_start=self._started)
            wanted = self.request
            if all(r.returncode == RESIZE_EXIT for r in results) and wanted is not None \
                    and resizes < MAX_RESIZES:
                self.measured.update(wanted["measured"])
                resizes += 1
                print(f"[launch] elastic: resizing from {size} to {wanted['size']} workers "
                      f"({wanted['reason']})", file=sys.stderr, flush=True)
                size = wanted["size"]
                continue
            if any(r.returncode == PREEMPTED_EXIT for r in results):
                return _preempted(results)  # a notice, not a loss: the scheduler restarts us
            report(results)
            lost = lost_workers(results)
            if not lost:
                return 0 if all(r.returncode == 0 for r in results) else 1  # done, or timed out
            left = size - len(lost)
            if left < self.min_workers or restarts == max_restarts:
                why = (f"{left} worker(s) left, fewer than --min-workers={self.min_workers}"
                       if left < self.min_workers else f"--max-restarts={max_restarts} reached")
                print(f"[launch] elastic: giving up ({why})", file=sys.stderr, flush=True)
                return lost[0].exit_code
            restarts += 1
            print(f"[launch] elastic: {len(lost)} worker(s) lost; restarting on {left} workers "
                  f"(restart {restarts} of {max_restarts})", file=sys.stderr, flush=True)
            size = left


# Exit codes a restart cannot mend: a mistake in the command or its config, a missing command.
NOT_RESTARTED = (2, 127)


def _restart_reason(results: list[WorkerResult], labels: list[str] | None) -> str | None:
    """What failed, when starting the job again may mend it (a worker that crashed or lost its
    peers: not one stopped by the launcher, a config mistake or a missing command); else None."""
    failed = [(i, r) for i, r in enumerate(results) if r.returncode not in (0, None)]
    if not failed or any(r.returncode in NOT_RESTARTED for _, r in failed):
        return None
    i, first = failed[0]
    name = labels[i] if labels else f"worker {first.rank}"
    more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
    return f"{name} {first.describe()}{more}"


def _preempted(results: list[WorkerResult], labels: list[str] | None = None) -> int:
    """The end of a preempted job: PREEMPTED_EXIT if every process backed up and exited so,
    else the report of those that did not (and their failure's code)."""
    others = [r for r in results if r.returncode != PREEMPTED_EXIT]
    if not others:
        print(f"[launch] preempted: every worker backed up at the same step and exited with "
              f"{PREEMPTED_EXIT}; run the same command again to resume", file=sys.stderr,
              flush=True)
        return PREEMPTED_EXIT
    report(others, labels)
    print(f"[launch] preempted, but {len(others)} process(es) did not back up (above): the job "
          "resumes from its newest backup that every worker completed", file=sys.stderr,
          flush=True)
    failed = [r for r in others if r.returncode not in (0, None)]
    return failed[0].exit_code if failed else PREEMPTED_EXIT


def report(results: list[WorkerResult], labels: list[str] | None = None) -> None:
    for r in results:
        if r.returncode != 0:
            label = labels[r.rank] if labels else f"worker {r.rank}"
            print(f"[launch] {label} {r.describe()}", file=sys.stderr, flush=True)


def run_tf_workers(argv: list[str], num_workers: int, timeout: float,
                   env: dict[str, str] | None = None, echo: bool = False) -> list[WorkerResult]:
    """Runs `argv` as `num_workers` TF_CONFIG workers on 127.0.0.1."""
    if num_workers < 1:
        raise ValueError(f"`num_workers` must be >= 1. Received: num_workers={num_workers}")
    return run_processes(host_commands(argv, [("127.0.0.1", num_workers)], env=env), timeout,
                         echo=echo)


def parse_hosts(text: str) -> list[tuple[str, int]]:
    """'node1:2,node2' -> [('node1', 2), ('node2', 1)]."""
    hosts = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, _, slots = item.partition(":")
        if not name or (slots and not slots.isdigit()) or (slots and int(slots) < 1):
            raise ValueError(f"--hosts: {item!r} is not host or host:slots (slots >= 1), "
                             "e.g. node1:2,node2:2")
        hosts.append((name, int(slots or 1)))
    if not hosts:
        raise ValueError("--hosts: no hosts given, e.g. --hosts node1:2,node2:2")
    return hosts


def read_hostfile(path: str | Path) -> list[tuple[str, int]]:
    """A hostfile as horovodrun and MPI read it: `host slots=N`, `host:N` or `host` per line,
    `#` comments."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"hostfile {p} not found")
    hosts = []
    for number, raw in enumerate(p.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([^\s:]+)(?::(\d+)|\s+slots\s*=\s*(\d+))?", line)
        slots = int(m.group(2) or m.group(3) or 1) if m else 0
        if not m or slots < 1:
            raise ValueError(f"{p}:{number}: {raw.strip()!r} is not `host slots=N`, `host:N` or "
                             "`host` (N >= 1)")
        hosts.append((m.group(1), slots))
    if not hosts:
        raise ValueError(f"hostfile {p} lists no hosts")
    return hosts


def is_local(host: str) -> bool:
    """Whether `host` names this machine (workers there start without ssh)."""
    return host in {"localhost", "127.0.0.1", socket.gethostname(), socket.getfqdn()}


def with_secret(env: dict[str, str]) -> dict[str, str]:
    """`env` with the job's secret (`tfdist.security`): the one it has, else a new one."""
    if env.get(SECRET_ENV) or env.get(SECRET_FILE_ENV):
        return env
    return {**env, SECRET_ENV: new_secret()}


def host_commands(argv: list[str], hosts: list[tuple[str, int]], port: int = DEFAULT_PORT,
                  ssh: str = DEFAULT_SSH, env: dict[str, str] | None = None, ps: int = 0
                  ) -> list[tuple[list[str], dict[str, str]]]:
    """(argv, environment) per task: `slots` tasks per host, TF_CONFIG addresses
    host:port, host:port+1, ...; remote ones wrapped in `ssh host 'cd ... && env ... argv'`
    (only TF_CONFIG and the TF_/TFDIST_/PYTHON variables set here travel with them). The first
    `ps` tasks are parameter servers. Every task gets the job's secret (`with_secret`): local
    ones in their environment, remote ones as a file (`remote_secret_file`), never on the
    command line. Tasks sharing a host share its cores (`share_cores`; on a remote host, its
    `nproc` over its slots) unless TF_NUM_INTRAOP_THREADS is set."""
    base = with_secret(dict(os.environ if env is None else env))
    all_local = all(is_local(h) for h, _ in hosts)
    total = sum(slots for _, slots in hosts)
    local = share_cores(base, sum(slots for h, slots in hosts if is_local(h)))
    ports = held_ports(total) if all_local else None  # released when run_processes ends
    addresses: list[str] = []
    for host, slots in hosts:
        for k in range(slots):
            addresses.append(f"{'127.0.0.1' if all_local else host}:"
                             f"{ports[len(addresses)] if ports else port + k}")
    commands = []
    rank = 0
    for host, slots in hosts:
        for _ in range(slots):
            config = cluster_config(rank, addresses, ps)
            if is_local(host):
                commands.append((argv, {**local, "TF_CONFIG": config}))
            else:
                commands.append(remote_command(argv, host, base, ssh, {"TF_CONFIG": config},
                                               slots))
            rank += 1
    return commands


def remote_command(argv: list[str], host: str, base: dict[str, str], ssh: str,
                   extra: dict[str, str] | None = None, slots: int = 1
                   ) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) running `argv` on `host` through `ssh`, in this working directory,
    with the TF_/TFDIST_/PYTHON variables of `base` and `extra`; the job's secret as a file
    (`remote_secret_file`), never on the command line; notices on standard input (a signal to
    ssh would not reach the process); `slots` processes sharing the host's cores."""
    passed = {k: v for k, v in base.items()
              if k.startswith(("TF_", "TFDIST_", "PYTHON")) and k not in ("TF_CONFIG", SECRET_ENV)}
    passed[NOTICES_ENV] = "stdin"
    if base.get(SECRET_ENV):
        passed[SECRET_FILE_ENV] = remote_secret_file(base[SECRET_ENV])
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted({**passed, **(extra or {})}
                                                                  .items()))
    if slots > 1 and THREADS_ENV not in passed:  # that host's cores, shared
        exports += f" {THREADS_ENV}=$(( $(nproc) / {slots} > 1 ? $(nproc) / {slots} : 1 ))"
    remote = (f"cd {shlex.quote(os.getcwd())} && env {exports} "
              f"{' '.join(shlex.quote(a) for a in argv)}")
    return [*shlex.split(ssh), host, remote], {**base, NOTICES_ENV: "stdin"}


def data_service_commands(hosts: list[str], port: int, ssh: str = DEFAULT_SSH,
                          env: dict[str, str] | None = None
                          ) -> tuple[list[tuple[list[str], dict[str, str]]], str]:
    """The tf.data service of a job: (argv, environment) of its dispatcher (on the first of
    `hosts`, at `port`) and of a data worker on each host (at port + 1 + i), and the
    dispatcher's address for the trainers' data.service."""
    base = dict(os.environ if env is None else env)
    dispatcher = f"{hosts[0]}:{port}"
    serve = [sys.executable, "-m", "tfdist.tools.cli", "data", "serve"]
    roles = [[*serve, "dispatcher", "--port", str(port)]]
    roles += [[*serve, "worker", "--port", str(port + 1 + i), "--dispatcher", dispatcher,
               "--address", host] for i, host in enumerate(hosts)]
    commands = [(argv, base) if is_local(host) else remote_command(argv, host, base, ssh)
                for argv, host in zip(roles, [hosts[0], *hosts], strict=True)]
    return commands, dispatcher


def remote_secret_file(secret: str) -> str:
    """Where a remote host keeps the job's secret (mode 0600, named after its digest, in the
    remote user's home): `send_secret` writes it there."""
    return f"~/.tfdist/job-{hashlib.sha256(secret.encode()).hexdigest()[:16]}.secret"


def send_secret(hosts: list[str], secret: str, ssh: str = DEFAULT_SSH,
                timeout: float = 60) -> None:
    """Writes the job's secret to `remote_secret_file` on each remote host, through ssh's
    standard input (never on a command line; no terminal, so nothing echoes it).

    Raises:
        RuntimeError: a host could not be reached or written to (named).
    """
    path = remote_secret_file(secret)
    command = [part for part in shlex.split(ssh) if part != "-tt"]
    for host in dict.fromkeys(h for h in hosts if not is_local(h)):
        script = (f"umask 077 && mkdir -p ~/.tfdist && cat > {path}.tmp && "
                  f"mv {path}.tmp {path}")
        done = subprocess.run([*command, "-T", host, script], input=secret + "\n", text=True,
                              capture_output=True, timeout=timeout)
        if done.returncode:
            raise RuntimeError(f"could not give the job's secret to {host} over ssh "
                               f"({done.stderr.strip() or f'exit {done.returncode}'}); check "
                               f"`{ssh} {host} true`")


def horovodrun_command(argv: list[str], np: int, hosts: list[tuple[str, int]] | None = None,
                       hostfile: str | None = None, mpi: bool = False,
                       network_interface: str | None = None, min_np: int | None = None,
                       max_np: int | None = None, host_discovery_script: str | None = None,
                       horovodrun: str | None = None) -> list[str]:
    """The horovodrun command line for `argv` on `np` ranks (Gloo unless `mpi`); elastic when
    `host_discovery_script` is given."""
    if np < 1:
        raise ValueError(f"-np must be >= 1. Received: {np}")
    if hosts and hostfile:
        raise ValueError("give --hosts or --hostfile, not both")
    elastic = host_discovery_script is not None
    if (min_np is not None or max_np is not None) and not elastic:
        raise ValueError("--min-np/--max-np are elastic flags: give --host-discovery-script "
                         "(a script printing host:slots lines) as well")
    if elastic and (hosts or hostfile):
        raise ValueError("elastic Horovod finds its hosts with --host-discovery-script; drop "
                         "--hosts/--hostfile")
    if min_np is not None and min_np > np or max_np is not None and max_np < np:
        raise ValueError(f"need min-np <= np <= max-np. Received: min-np={min_np}, np={np}, "
                         f"max-np={max_np}")
    slots = sum(s for _, s in hosts) if hosts else None
    if slots is not None and slots < np:
        raise ValueError(f"-np {np} but the hosts have {slots} slots; add hosts or slots")
    cmd = [horovodrun or horovodrun_path(), "--mpi" if mpi else "--gloo", "-np", str(np)]
    if hosts:
        cmd += ["-H", ",".join(f"{h}:{s}" for h, s in hosts)]
    elif hostfile:
        cmd += ["--hostfile", hostfile]
    elif not elastic:
        cmd += ["-H", f"localhost:{np}"]
    if host_discovery_script is not None:
        cmd += ["--host-discovery-script", host_discovery_script]
        cmd += [f for flag, v in (("--min-np", min_np), ("--max-np", max_np)) if v is not None
                for f in (flag, str(v))]
    if network_interface:
        cmd += ["--network-interface", network_interface]
    return [*cmd, *argv]


def horovodrun_path() -> str:
    """The `horovodrun` beside this Python, or on PATH."""
    beside = Path(sys.executable).with_name("horovodrun")
    found = str(beside) if beside.exists() else shutil.which("horovodrun")
    if not found:
        raise FileNotFoundError(
            "horovodrun not found: build Horovod with launch/build_horovod.sh (see BUILD.md)."
        )
    return found


def run_horovod(argv: list[str], num_ranks: int, timeout: float,
                env: dict[str, str] | None = None, echo: bool = False) -> WorkerResult:
    """Runs `argv` under `horovodrun --gloo -np N -H localhost:N` (one host, loopback)."""
    if num_ranks < 1:
        raise ValueError(f"`num_ranks` must be >= 1. Received: num_ranks={num_ranks}")
    cmd = horovodrun_command(argv, num_ranks, network_interface="lo")
    (result,) = run_processes(
        [(cmd, share_cores(dict(os.environ if env is None else env), num_ranks))], timeout,
        echo=echo)
    return result


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tfdist.launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--workers", type=int, help="number of local TF_CONFIG workers")
    where.add_argument("--hosts", help="host[:slots],... (workers per host)")
    where.add_argument("--hostfile", help="file of `host slots=N` lines")
    p.add_argument("--port", type=int, default=None,
                   help=f"first worker port on each remote host (TF_CONFIG; default "
                        f"{DEFAULT_PORT}; with --slurm, one derived from the job id)")
    p.add_argument("--ssh", default=DEFAULT_SSH, help="command that reaches a remote host")
    p.add_argument("--timeout", type=float, default=3600, help="seconds before all are killed")
    p.add_argument("--ps", type=int, default=0,
                   help="parameter-server tasks: with --workers, this many more local "
                        "processes; with hosts, the first slots")
    data = p.add_argument_group("tf.data service (decoding off the trainers; `tfdist train` "
                                "with data.name records)")
    data.add_argument("--data-hosts", metavar="HOST,...",
                      help="hosts that read and decode for the trainers: a data worker on each, "
                           "the dispatcher on the first; the trainers get data.service")
    data.add_argument("--data-port", type=int, default=DATA_PORT,
                      help=f"the dispatcher's port (the data workers take the next ones; "
                           f"default {DATA_PORT})")
    elastic = p.add_argument_group("elastic TF_CONFIG workers (with --workers or --hostfile)")
    elastic.add_argument("--elastic", action="store_true",
                         help="restart on the workers left when workers fail (tfdist train "
                              "resumes its backup at the new size)")
    elastic.add_argument("--min-workers", type=int, help="elastic: fewest workers to go on with "
                         "(default: --workers)")
    elastic.add_argument("--max-workers", type=int, help="elastic: most workers a resize policy "
                         "or the hostfile's slots may grow the job to (default: --workers, or "
                         "the hostfile's slots)")
    elastic.add_argument("--max-restarts", type=int, default=None,
                         help="restarts before giving up: TF_CONFIG workers (default 0) all "
                              "start again and resume from the last backup when one fails (a "
                              "lost link, a crash); --elastic (default 3) goes on with the "
                              "workers left; with --ps (default 3) a failed worker is started "
                              "again and resumes")
    slurm = p.add_argument_group("SLURM (run by srun on every task of a job step)")
    slurm.add_argument("--slurm", action="store_true",
                       help="this process is one task of a SLURM step: write its TF_CONFIG "
                            "from SLURM's environment (with --ps, the first tasks serve) and "
                            "become the worker command")
    slurm.add_argument("--requeue", action="store_true",
                       help="with --slurm: after a preemption backup, requeue the job "
                            "(scontrol requeue) so it resumes by itself")
    hvd = p.add_argument_group("Horovod (horovodrun)")
    hvd.add_argument("--horovod", action="store_true", help="launch with horovodrun")
    hvd.add_argument("-np", "--np", type=int, help="number of Horovod ranks")
    hvd.add_argument("--mpi", action="store_true", help="MPI instead of Gloo")
    hvd.add_argument("--network-interface", help="NIC(s) for Horovod traffic, e.g. eth0")
    hvd.add_argument("--min-np", type=int, help="elastic: fewest ranks to go on with")
    hvd.add_argument("--max-np", type=int, help="elastic: most ranks to scale up to")
    hvd.add_argument("--host-discovery-script", help="elastic: prints the available host:slots")
    hvd.add_argument("--dry-run", action="store_true", help="print the command, do not run it")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the worker command")
    return p


def _data_service(command: list[str], args, env: dict[str, str]):
    """(the tf.data service's commands, the dispatcher's address) for --data-hosts; said in
    one line."""
    if not 1 <= args.data_port <= 65535 - 256:
        raise ValueError(f"--data-port must be in [1, 65279]. Received: {args.data_port}")
    if not any(a.endswith(("tfdist", "tfdist.tools.cli")) for a in command) or \
            "train" not in command:
        raise ValueError("--data-hosts starts a tf.data service for `tfdist train` (it adds "
                         "--set data.service=...); for a script of your own, start the servers "
                         "with `tfdist data serve` and give it their address")
    hosts = [h.strip() for h in args.data_hosts.split(",") if h.strip()]
    if not hosts:
        raise ValueError("--data-hosts: give at least one host")
    commands, dispatcher = data_service_commands(  # no secret: TensorFlow's servers take none
        hosts, args.data_port, args.ssh, {k: v for k, v in env.items() if k != SECRET_ENV})
    print(f"[launch] tf.data service: dispatcher at {dispatcher}, data workers on "
          f"{', '.join(hosts)}; the trainers read through it (data.service={dispatcher})",
          file=sys.stderr, flush=True)
    return commands, dispatcher


def _horovod_slurm_task(rank: int, addresses: list[str], command: list[str],
                        requeue: bool) -> int:
    """`--slurm --horovod`: this task as a Horovod rank (Gloo), no horovodrun. Task 0 serves the
    rendezvous and runs the command as its child, passing SIGTERM/SIGUSR1/SIGINT on; the others
    become the command."""
    from tfdist.tools.slurm import horovod_environment, serve_rendezvous, task_threads

    env = {**os.environ, **task_threads(os.environ), **horovod_environment(rank, addresses)}
    env.pop("TF_CONFIG", None)
    if requeue:
        env["TFDIST_REQUEUE"] = "1"
    if rank:
        return _become(command, env)
    try:
        server = serve_rendezvous(addresses)
    except OSError as e:
        print(f"[launch] cannot serve Horovod's rendezvous on {addresses[0]}'s node: "
              f"{e.strerror}; pass another --port", file=sys.stderr)
        return 1
    try:
        child = subprocess.Popen(command, env=env)
    except OSError as e:
        print(f"[launch] cannot run {command[0]!r}: {e.strerror}", file=sys.stderr)
        return 127
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    code = child.wait()
    server.shutdown()
    return code if code >= 0 else 128 - code


def _become_slurm_task(parser: argparse.ArgumentParser, args, command: list[str]) -> int:
    """`--slurm`: this task's TF_CONFIG from SLURM's environment, then the command in its
    place (`tfdist.tools.slurm`)."""
    from tfdist.tools.slurm import slurm_cluster, task_threads

    if args.elastic or args.workers or args.hosts or args.hostfile:
        parser.error("--slurm takes its workers from SLURM (srun -N/-n): drop --workers, "
                     "--hosts, --hostfile and --elastic")
    if args.horovod and args.ps:
        parser.error("--slurm --horovod makes every task a Horovod rank: drop --ps")
    if args.ps < 0:
        parser.error(f"--ps must be >= 0. Received: {args.ps}")
    try:
        rank, addresses = slurm_cluster(ps=args.ps, port=args.port)
    except ValueError as e:
        parser.error(str(e))
    if args.horovod:
        return _horovod_slurm_task(rank, addresses, command, args.requeue)
    config = cluster_config(rank, addresses, args.ps)
    env = {**os.environ, **task_threads(os.environ), "TF_CONFIG": config}
    if args.requeue:
        env["TFDIST_REQUEUE"] = "1"
    if args.ps and not (env.get(SECRET_ENV) or env.get(SECRET_FILE_ENV)):
        parser.error(f"--ps under SLURM: set {SECRET_ENV} in the batch script, before srun "
                     "(every task must get the same secret; see launch/slurm/train.sbatch)")
    return _become(command, env)


def _become(command: list[str], env: dict[str, str]) -> int:
    """Replaces this process with `command` (a signal to the task then reaches it); 127 with
    the reason when it cannot run."""
    try:
        os.execvpe(command[0], command, env)
    except OSError as e:
        print(f"[launch] cannot run {command[0]!r}: {e.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the worker command after --")
    if not args.timeout > 0:
        parser.error(f"--timeout must be > 0 seconds. Received: {args.timeout}")
    if args.port is not None and not 1 <= args.port <= 65535:
        parser.error(f"--port must be a TCP port, in [1, 65535]. Received: {args.port}")
    if args.slurm:
        return _become_slurm_task(parser, args, command)
    if args.requeue:
        parser.error("--requeue is for SLURM jobs: use it with --slurm")
    if args.data_hosts and (args.horovod or args.elastic):
        parser.error("--data-hosts starts a tf.data service for TF_CONFIG workers (--workers or "
                     "--hosts); it does not combine with --horovod or --elastic")
    try:
        hosts = (parse_hosts(args.hosts) if args.hosts else
                 read_hostfile(args.hostfile) if args.hostfile else None)
        port = args.port or DEFAULT_PORT
        last = port + max(n for _, n in hosts) - 1 if hosts else port
        if last > 65535 and not args.horovod:
            raise ValueError(f"--port {port}: a host's tasks take ports {port} to {last}, past "
                             "65535; give a lower --port")
        if args.ps and (args.horovod or args.elastic):
            raise ValueError("--ps starts TF_CONFIG parameter servers; it does not combine with "
                             "--horovod or --elastic")
        if args.ps < 0:
            raise ValueError(f"--ps must be >= 0. Received: {args.ps}")
        if args.max_restarts is None:
            args.max_restarts = 3 if args.elastic or args.ps else 0
        if args.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0. Received: {args.max_restarts}")
        if args.horovod and args.max_restarts:
            raise ValueError("--max-restarts restarts TF_CONFIG workers; horovodrun has its own "
                             "(elastic Horovod: --min-np/--max-np)")
        if args.horovod:
            if args.workers is not None:
                raise ValueError("--workers is for TF_CONFIG workers; with --horovod give -np")
            if args.np is None:
                raise ValueError("--horovod needs -np (the number of ranks)")
            cmd = horovodrun_command(
                command, args.np, hosts=hosts if args.hosts else None,
                hostfile=args.hostfile, mpi=args.mpi, network_interface=args.network_interface,
                min_np=args.min_np, max_np=args.max_np,
                host_discovery_script=args.host_discovery_script,
                horovodrun="horovodrun" if args.dry_run else None)
            print(f"[launch] {shlex.join(cmd)}", file=sys.stderr, flush=True)
            if args.dry_run:
                return 0
            local = hosts is None and args.host_discovery_script is None  # all ranks here
            commands = [(cmd, share_cores(dict(os.environ), args.np) if local else
                         dict(os.environ))]
        elif args.elastic:
            if args.hosts:
                raise ValueError("--elastic takes --workers N (local workers) or --hostfile "
                                 "(read again while the job runs), not --hosts")
            try:
                return run_elastic(command, args.workers, args.min_workers, args.max_restarts,
                                   args.timeout, max_workers=args.max_workers,
                                   hostfile=args.hostfile, port=port, ssh=args.ssh)
            except CommandNotFound as e:
                print(f"[launch] {e.strerror}", file=sys.stderr)
                return 127
        else:
            if hosts is None and args.workers is None:
                raise ValueError("say where: --workers N (this machine), --hosts or --hostfile")
            if args.workers is not None and args.workers < 1:
                raise ValueError(f"--workers must be >= 1. Received: {args.workers}")
            if hosts is not None and sum(n for _, n in hosts) <= args.ps:
                raise ValueError(f"--ps {args.ps} leaves no slot of the hosts for a worker")
            env = with_secret(dict(os.environ))
            service = []
            if args.data_hosts:
                service, dispatcher = _data_service(command, args, env)
                command = [*command, "--set", f"data.service={dispatcher}"]
            commands = host_commands(
                command, hosts or [("127.0.0.1", args.workers + args.ps)],
                port, args.ssh,
                env=env, ps=args.ps)
            if hosts and env.get(SECRET_ENV):
                send_secret([h for h, _ in hosts], env[SECRET_ENV], args.ssh)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        parser.error(str(e))
    labels = ([f"ps {i}" for i in range(args.ps)] +
              [f"worker {i}" for i in range(len(commands) - args.ps)]) if args.ps else None
    trainers = len(commands)
    if args.data_hosts:
        labels = (labels or [f"worker {i}" for i in range(trainers)]) + [
            "data dispatcher", *(f"data worker {i}" for i in range(len(service) - 1))]
        commands = commands + service
    deadline, restarts = time.monotonic() + args.timeout, 0
    while True:
        try:
            results = run_processes(commands, max(1.0, deadline - time.monotonic()), echo=True,
                                    labels=labels,
                                    stop_on_failure=frozenset(  # and the data dispatcher
                                        range(args.ps) if args.ps else
                                        range(min(trainers + 1, len(commands)))),
                                    restartable=frozenset(range(args.ps, trainers)),
                                    max_restarts=args.max_restarts if args.ps else 0,
                                    servers=frozenset(range(args.ps)),
                                    helpers=frozenset(range(trainers, len(commands))))
        except CommandNotFound as e:
            print(f"[launch] {e.strerror}", file=sys.stderr)
            return 127
        # the data service was stopped with the job; its dispatcher's end stops the job
        served, results = results[:trainers + 1], results[:trainers]
        if any(r.returncode == PREEMPTED_EXIT for r in results):
            return _preempted(results, labels)
        again = None if args.ps or args.horovod or all(r.returncode == 0 for r in results) \
            else _restart_reason(served, labels)
        if again is None or restarts >= args.max_restarts or time.monotonic() >= deadline:
            break
        restarts += 1
        print(f"[launch] {again}: restarting every worker (restart {restarts} of "
              f"{args.max_restarts}); the job resumes from its last backup", file=sys.stderr,
              flush=True)
    report(results, labels)
    if args.ps:  # the servers and the chief decide; a lost worker is reported above
        decisive = results[:args.ps + 1]
        failed = [r for r in decisive if r.returncode not in (0, None)]
        if failed:
            return failed[0].exit_code
        return 1 if any(r.returncode is None for r in decisive) else 0
    failed = [r for r in results if r.returncode not in (0, None)]
    if failed:
        return failed[0].exit_code
    return 1 if any(r.returncode is None for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
