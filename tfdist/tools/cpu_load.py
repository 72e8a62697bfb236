"""How busy the machine's cores were during the training steps (Linux's /proc/stat).

On the emulated cluster every host's workers, their transports and the kernel's emulated links
share one machine's cores. A step during which all of them were busy is bound by the cores, not
by the link: only less work per step (not more overlap) makes it faster, and its time does not
carry over to hosts with cores of their own. `MachineLoad` measures this over each epoch's
steps; the bench suites report it (`busy_cores` of `cores`).

The count is the whole machine's (every process and the kernel's interrupt work), not this
process': /proc/stat is not confined by network or mount namespaces. Threads that spin while they
wait (TensorFlow's thread pools spin briefly before they sleep) count as busy.

`MachineLoad` also splits this process' own CPU time by thread (/proc/self/task): TensorFlow's
op pools (`tf_Compute`) against every other thread (the main thread's training loop, the
transports' threads: Horovod's and Gloo's, gRPC's `event_engine`, TensorFlow's
`collective_ops`). That says which of the machine's busy core-ms a worker's transport took.
"""

from __future__ import annotations

import os
import time

import keras

from tfdist.callbacks.start import skipping

STAT = "/proc/stat"
# The fields of /proc/stat's "cpu" line, in order; guest time is already in user and nice.
FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
IDLE = ("idle", "iowait")
TASKS = "/proc/self/task"
COMPUTE = "tf_Compute"  # the name TensorFlow gives the threads of its op pools
MAIN = "main"  # the process' first thread: Python's, the training loop's
UNNAMED = "unnamed"  # other threads with the process' own name (Horovod's, Gloo's, Python's)
THREADS_EVERY_S = 1.0  # the threads are read at most this often (7 threads: 0.14 ms a read)


def parse_stat(text: str) -> tuple[float, int]:
    """(busy core-seconds since boot, cores) from the text of /proc/stat: the "cpu" line's
    fields but idle and iowait, in clock ticks, and the number of "cpuN" lines."""
    lines = text.splitlines()
    total = next((line.split() for line in lines if line.startswith("cpu ")), None)
    if total is None:
        raise ValueError(f"no aggregate 'cpu' line in {STAT}")
    ticks = dict(zip(FIELDS, (int(x) for x in total[1:1 + len(FIELDS)])))
    busy = sum(v for k, v in ticks.items() if k not in IDLE)
    cores = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    return busy / os.sysconf("SC_CLK_TCK"), cores


def busy_core_seconds() -> tuple[float, int] | None:
    """This machine's busy core-seconds since boot and its cores, or None without /proc/stat."""
    try:
        with open(STAT) as f:
            return parse_stat(f.read())
    except (OSError, ValueError):
        return None


def parse_task_stat(text: str) -> tuple[str, int]:
    """(thread name, user + system clock ticks) from the text of /proc/PID/task/TID/stat; the
    name is between the first "(" and the last ")", and may hold spaces and parentheses."""
    try:
        name = text[text.index("(") + 1:text.rindex(")")]
        fields = text[text.rindex(")") + 2:].split()
        return name, int(fields[11]) + int(fields[12])  # stat's 14th and 15th fields
    except (ValueError, IndexError):
        raise ValueError(f"not a thread's stat line: {text[:80]!r}") from None


def thread_times(tasks: str = TASKS) -> dict[str, tuple[str, float]] | None:
    """This process' threads: thread id -> (group, CPU core-seconds since it started). The group
    is the thread's name, `MAIN` for the first thread and `UNNAMED` for other threads named like
    the process. None where the task directory cannot be read."""
    try:
        tids = os.listdir(tasks)
        with open(f"{tasks}/{os.getpid()}/stat") as f:
            process_name = parse_task_stat(f.read())[0]
    except (OSError, ValueError):
        return None
    clock = os.sysconf("SC_CLK_TCK")
    times = {}
    for tid in tids:
        try:
            with open(f"{tasks}/{tid}/stat") as f:
                name, used = parse_task_stat(f.read())
        except (OSError, ValueError):  # the thread ended while the directory was read
            continue
        group = MAIN if tid == str(os.getpid()) else UNNAMED if name == process_name else name
        times[tid] = (group, used / clock)
    return times


def thread_groups(core_ms: dict[str, float]) -> tuple[float, float]:
    """(compute, other): TensorFlow's op pools' core-ms and every other thread's."""
    compute = core_ms.get(COMPUTE, 0.0)
    return compute, sum(core_ms.values()) - compute


class _ThreadWindow:
    """One epoch's per-thread readings: at its window's start and at most every
    THREADS_EVERY_S after, with the batches counted at each."""

    def __init__(self, reading: dict[str, tuple[str, float]], now: float):
        self.first, self.last = reading, reading
        self.last_at, self.steps = now, 0

    def update(self, now: float, steps: int) -> None:
        if now - self.last_at >= THREADS_EVERY_S:
            reading = thread_times()
            if reading is not None:
                self.last, self.last_at, self.steps = reading, now, steps


class MachineLoad(keras.callbacks.Callback):
    """Records the machine's busy core-seconds over the training batches of each epoch.

    An epoch's window opens at the end of its first batch (so the run's first, tracing, step is
    left out) and closes at the end of its last; the windows leave out what runs between epochs
    (evaluation). `summary()` gives the mean number of cores busy over the windows and the busy
    core-ms per batch in them: `{"cores": N, "busy_cores": ..., "busy_core_ms_per_step": ...}`,
    or None where /proc/stat is missing or no window holds a batch. /proc/stat counts in clock
    ticks (10 ms on Linux) on each core: over a window of T seconds the mean is within about
    cores x 0.01 / T of the true one. Reading it once a batch costs tens of microseconds.

    The summary's `thread_core_ms_per_step` is this process' own CPU per batch by thread name
    (`thread_times`), read at each window's start and then at most once a second (the batches
    between its first and last reading; a thread that ended in between is left out); absent
    where no window lasts a second.
    """

    def __init__(self):
        super().__init__()
        self.cores = 0
        self.busy = self.seconds = 0.0  # closed windows' busy core-seconds and wall seconds
        self.steps = 0  # batches in them
        self._window: list | None = None  # [(busy, time) at its start, at its last batch, n]
        self._threads: _ThreadWindow | None = None  # this epoch's per-thread readings
        self.thread_core_s: dict[str, float] = {}  # closed windows' core-seconds by thread
        self.thread_steps = 0  # batches in them

    def on_epoch_begin(self, epoch, logs=None):
        self._close()

    def on_train_batch_end(self, batch, logs=None):
        if skipping(self.model):  # a finished step of a resumed epoch: nothing ran
            return
        read = busy_core_seconds()
        if read is None:
            return
        self.cores = read[1]
        now = (read[0], time.perf_counter())
        if self._window is None:
            self._window = [now, now, 0]
            threads = thread_times()
            self._threads = None if threads is None else _ThreadWindow(threads, now[1])
        else:
            self._window[1:] = [now, self._window[2] + 1]
            if self._threads is not None:
                self._threads.update(now[1], self._window[2])

    def on_train_end(self, logs=None):
        self._close()

    def _close(self) -> None:
        if self._window is not None:
            (busy0, t0), (busy1, t1), steps = self._window
            self.busy += busy1 - busy0
            self.seconds += t1 - t0
            self.steps += steps
            self._window = None
        if self._threads is not None and self._threads.steps:
            w = self._threads
            for tid, (name, seconds) in w.last.items():  # a thread that ended is left out
                used = seconds - w.first.get(tid, (name, 0.0))[1]
                self.thread_core_s[name] = self.thread_core_s.get(name, 0.0) + used
            self.thread_steps += w.steps
        self._threads = None

    def summary(self) -> dict | None:
        self._close()
        if self.steps == 0 or self.seconds <= 0:
            return None
        summary = {"cores": self.cores, "busy_cores": round(self.busy / self.seconds, 3),
                   "busy_core_ms_per_step": round(1000 * self.busy / self.steps, 1)}
        if self.thread_steps:
            summary["thread_core_ms_per_step"] = {
                name: round(1000 * s / self.thread_steps, 1)
                for name, s in sorted(self.thread_core_s.items(), key=lambda kv: -kv[1])}
        return summary
