"""How busy the machine's cores were during the training steps (Linux's /proc/stat).

On the emulated cluster every host's workers, their transports and the kernel's emulated links
share one machine's cores. A step during which all of them were busy is bound by the cores, not
by the link: only less work per step (not more overlap) makes it faster, and its time does not
carry over to hosts with cores of their own. `MachineLoad` measures this over each epoch's
steps; the bench suites report it (`busy_cores` of `cores`).

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
    """Records the machine's busy core-seconds over the training batches of each epoch.

    An epoch's window opens at the end of its first batch (so the run's first, tracing, step is
    left out) and closes at the end of its last; the windows leave out what runs between epochs
    (evaluation). `summary()` gives the mean number of cores busy over the windows and the busy
    core-ms per batch in them: `{"cores": N, "busy_cores": ..., "busy_core_ms_per_step": ...}`,
    or None where /proc/stat is missing or no window holds a batch. /proc/stat counts in clock
    ticks (10 ms on Linux) on each core: over a window of T seconds the mean is within about
    cores x 0.01 / T of the true one. Reading it once a batch costs tens of microseconds.
    """

    def __init__(self):
        super().__init__()
        self.cores = 0
        self.busy = self.seconds = 0.0  # closed windows' busy core-seconds and wall seconds
        self.steps = 0  # batches in them
        self._window: list | None = None  # [(busy, time) at its start, at its last batch, n]

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
        else:
            self._window[1:] = [now, self._window[2] + 1]

    def on_train_end(self, logs=None):
        self._close()

    def _close(self) -> None:
        if self._window is not None:
            (busy0, t0), (busy1, t1), steps = self._window
            self.busy += busy1 - busy0
            self.seconds += t1 - t0
            self.steps += steps
            self._window = None

    def summary(self) -> dict | None:
        self._close()
        if self.steps == 0 or self.seconds <= 0:
            return None
        return {"cores": self.cores, "busy_cores": round(self.busy / self.seconds, 3),
                "busy_core_ms_per_step": round(1000 * self.busy / self.steps, 1)}
