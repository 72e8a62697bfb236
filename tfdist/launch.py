"""Start local worker processes (TF_CONFIG or horovodrun) with a hard timeout and clean-up.

Used by the test rig and by `python -m tfdist.launch`:

    python -m tfdist.launch --workers 2 --timeout 600 -- python train.py --config ...

Each worker gets TF_CONFIG for a cluster on 127.0.0.1 with free ports; output is streamed with a
`[worker i]` prefix; if one worker fails, the others are stopped; the exit code is the first
failure's (or 0). Every worker runs in its own process group, which is killed on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
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


@dataclass
class WorkerResult:
    rank: int
    returncode: int | None  # None: killed at the timeout or because another worker failed
    output: str


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports that are free on `host` right now."""
    with contextlib.ExitStack() as stack:
        socks = []
        for _ in range(count):
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]


def tf_config(index: int, ports: list[int], host: str = "127.0.0.1") -> str:
    """TF_CONFIG for worker `index` of a cluster of len(ports) workers on `host`."""
    return json.dumps({
        "cluster": {"worker": [f"{host}:{p}" for p in ports]},
        "task": {"type": "worker", "index": index},
    })


def _pump(proc: subprocess.Popen, rank: int, sink: list[str], echo: bool,
          on_line: Callable[[int, str], None] | None) -> None:
    assert proc.stdout is not None
    for line in iter(proc.stdout.readline, ""):
        sink.append(line)
        if echo:
            sys.stdout.write(f"[worker {rank}] {line}")
            sys.stdout.flush()
        if on_line is not None:
            on_line(rank, line)


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_processes(commands: list[tuple[list[str], dict[str, str]]], timeout: float,
                  echo: bool = False, stop_on_failure: bool = True,
                  on_line: Callable[[int, str], None] | None = None) -> list[WorkerResult]:
    """Runs the commands concurrently; returns when all end, one fails, or `timeout` passes.

    Args:
        commands: (argv, environment) per process.
        timeout: Seconds before every process still running is killed.
        echo: Stream output with a `[worker i]` prefix.
        stop_on_failure: Stop the others (after a 10 s grace for their own error reports)
            when one exits non-zero.
        on_line: Called with (rank, line) for every line a process writes, as it comes.
    """
    procs: list[subprocess.Popen] = []
    sinks: list[list[str]] = []
    threads = []
    try:
        for rank, (argv, env) in enumerate(commands):
            proc = subprocess.Popen(
                argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
            procs.append(proc)
            sinks.append([])
            t = threading.Thread(target=_pump, args=(proc, rank, sinks[-1], echo, on_line),
                                 daemon=True)
            t.start()
            threads.append(t)
        deadline = time.monotonic() + timeout
        failed_at = None
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            if stop_on_failure and failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > 10:
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            _kill_group(p)
        for t in threads:
            t.join(5)
    killed = {i for i, p in enumerate(procs) if p.returncode is not None and p.returncode < 0}
    return [
        WorkerResult(i, None if i in killed else p.returncode, "".join(sinks[i]))
        for i, p in enumerate(procs)
    ]


def run_tf_workers(argv: list[str], num_workers: int, timeout: float,
                   env: dict[str, str] | None = None, echo: bool = False) -> list[WorkerResult]:
    """Runs `argv` as `num_workers` TF_CONFIG workers on 127.0.0.1."""
    if num_workers < 1:
        raise ValueError(f"`num_workers` must be >= 1. Received: num_workers={num_workers}")
    ports = free_ports(num_workers)
    base = dict(os.environ if env is None else env)
    commands = [(argv, {**base, "TF_CONFIG": tf_config(i, ports)}) for i in range(num_workers)]
    return run_processes(commands, timeout, echo=echo)


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
    cmd = [horovodrun_path(), "--gloo", "-np", str(num_ranks), "-H", f"localhost:{num_ranks}",
           "--network-interface", "lo", *argv]
    (result,) = run_processes([(cmd, dict(os.environ if env is None else env))], timeout,
                              echo=echo)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tfdist.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, required=True, help="number of local workers")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds before all are killed")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the worker command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the worker command after --")
    results = run_tf_workers(command, args.workers, args.timeout, echo=True)
    for r in results:
        if r.returncode != 0:
            state = "was stopped" if r.returncode is None else f"exited with {r.returncode}"
            print(f"[launch] worker {r.rank} {state}", file=sys.stderr)
    failed = [r.returncode for r in results if r.returncode not in (0, None)]
    if failed:
        return failed[0]
    return 1 if any(r.returncode is None for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
