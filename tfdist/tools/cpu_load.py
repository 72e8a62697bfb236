"""How busy the machine's cores were during each training step (Linux's /proc/stat).

On the emulated cluster every host's workers, their transports and the kernel's emulated links
share one machine's cores. A step during which all of them were busy is bound by the cores, not
by the link: only less work per step (not more overlap) makes it faster, and its time does not
carry over to hosts with cores of their own. `MachineLoad` measures this per step; the bench
suites report it (`busy_cores` of `cores`).

The count is the whole machine's (every process and the kernel's interrupt work), not this
process': /proc/stat is not confined by network or mount namespaces. Threads that spin while they
wait (TensorFlow's thread pools spin briefly before they sleep) count as busy.
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


class MachineLoad(keras.callbacks.Callback):
    """Records the machine's busy core-seconds and the wall seconds of each training batch.

    `summary()` gives the mean number of cores busy over the batches after the first (which
    traces the step): `{"cores": N, "busy_cores": ..., "busy_core_ms_per_step": ...}`, or None
    where /proc/stat is missing or no such batch ran. Reading /proc/stat twice a batch costs tens
    of microseconds.
    """

    def __init__(self):
        super().__init__()
        self.busy: list[float] = []
        self.seconds: list[float] = []
        self.cores = 0
        self._start: tuple[float, float] | None = None

    def on_train_batch_begin(self, batch, logs=None):
        read = busy_core_seconds()
        self._start = None if read is None else (read[0], time.perf_counter())

    def on_train_batch_end(self, batch, logs=None):
        if self._start is None or skipping(self.model):
            return
        read = busy_core_seconds()
        if read is None:
            return
        busy, self.cores = read
        self.busy.append(busy - self._start[0])
        self.seconds.append(time.perf_counter() - self._start[1])

    def summary(self) -> dict | None:
        busy, seconds = sum(self.busy[1:]), sum(self.seconds[1:])
        if seconds <= 0:
            return None
        return {"cores": self.cores, "busy_cores": round(busy / seconds, 3),
                "busy_core_ms_per_step": round(1000 * busy / len(self.busy[1:]), 1)}
