"""`Watchdog`: a training step that waits too long ends the process with a message, not a hang.

A collective waits for every worker. When one worker freezes (stopped, stuck in its input
pipeline, swapping) the others wait with it; TensorFlow's multi-worker runtime notices a frozen
task through its heartbeats, Horovod 0.28 does not (its stall check only warns, and a frozen
rank's peers wait forever). With this callback every process times its own training steps on a
thread of its own; a step that runs longer than `timeout` seconds ends the process with
`WATCHDOG_EXIT` and a message naming the step and the ranks that had not reached it (their
last step and how long ago it started).

Each process's watchdog thread writes the process's step and the time every second or so, also
while the main thread waits inside a collective: through the job's own channel
(`Engine.key_value_store()`: TensorFlow's coordination service of a multi-worker job, or the
Gloo rendezvous store of a Horovod job), so hosts need share no file; or to `directory/rank-<r>`
when a directory is given. A frozen or dead process stops writing, a slow one shows an earlier
step. With neither (Horovod over MPI, no directory) the message says only that this process
waited. The first step, which traces and compiles the model, is not timed. The times are the
hosts' clocks: keep them in sync (NTP), as every cluster does.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import keras

from tfdist.arguments import check_number
from tfdist.comm import resolve

WATCHDOG_EXIT = 124  # as `timeout` exits when its command runs too long
HEARTBEAT_DIR_ENV = "TFDIST_HEARTBEAT_DIR"


class Watchdog(keras.callbacks.Callback):
    """Ends this process (exit `WATCHDOG_EXIT`) when a training step runs past `timeout`.

    Args:
        timeout: Seconds a step may take (the first, tracing step is not timed).
        directory: A directory every process can write (NFS) for the heartbeats, instead of
            the job's own store. Defaults to $TFDIST_HEARTBEAT_DIR; None without it (the
            heartbeats then go through the job's store, where it has one).
        exit: Called with the exit code when the step times out (tests); defaults to os._exit,
            since the main thread is blocked inside the collective.

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))
        with strategy.scope():
            model = build_model()
            model.compile(optimizer=tfdist.DistributedOptimizer(keras.optimizers.Adam()),
                          loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=64, epochs=1,
                  callbacks=[tfdist.callbacks.Watchdog(timeout=120)])
        ```
    """

    def __init__(self, timeout: float = 300.0, directory: str | os.PathLike | None = None,
                 exit=os._exit):
        super().__init__()
        self.timeout = check_number("timeout", timeout, 0, low_open=True)
        directory = directory if directory is not None else os.environ.get(HEARTBEAT_DIR_ENV)
        if directory is not None and not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"Watchdog(directory={directory!r}): give a directory path (str or "
                            "os.PathLike) that every process can write, or None.")
        self.directory = Path(directory) if directory else None
        self._exit = exit
        self._step = 0
        self._started: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store = None  # the job's key-value store, when there is no directory
        self.rank, self.world_size = 0, 1

    # -- Keras hooks -------------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        engine = resolve()
        self.rank, self.world_size = engine.process_index, engine.process_count
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
        elif self.world_size > 1:
            self._store = engine.key_value_store()
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="tfdist-watchdog", daemon=True)
        self._thread.start()

    def on_train_batch_begin(self, batch, logs=None):
        self._step += 1
        self._started = time.monotonic() if self._step > 1 else None
        if self.directory is not None:  # a store is written by the watchdog's thread alone
            self._beat()

    def on_train_batch_end(self, batch, logs=None):
        self._started = None

    def on_train_end(self, logs=None):
        self._started = None
        self._stop.set()

    # -- heartbeats ----------------------------------------------------------------------------
    def _beat(self) -> None:
        beat = json.dumps({"step": self._step, "time": time.time(), "pid": os.getpid()})
        try:  # a full or vanished directory, or an unreachable store, must not stop training
            if self.directory is not None:
                path = self.directory / f"rank-{self.rank}"
                partial = path.with_suffix(".partial")
                partial.write_text(beat)
                partial.replace(path)
            elif self._store is not None:
                self._store.put(f"heartbeat-{self.rank}", beat)
        except OSError:
            pass

    def _read(self, rank: int) -> str | None:
        if self.directory is not None:
            try:
                return (self.directory / f"rank-{rank}").read_text()
            except OSError:
                return None
        return self._store.get(f"heartbeat-{rank}") if self._store is not None else None

    @property
    def _shared(self) -> bool:
        """Whether the ranks' heartbeats reach each other (a directory or the job's store)."""
        return self.directory is not None or self._store is not None

    def _others(self) -> list[str]:
        """The other ranks that are silent (frozen or dead) or behind this one."""
        if not self._shared:
            return []
        behind, now = [], time.time()
        stale = max(5.0, 5 * self._interval)
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            try:
                beat = json.loads(self._read(rank) or "")
                step, at, pid = int(beat["step"]), float(beat["time"]), int(beat["pid"])
            except (ValueError, TypeError, KeyError):
                behind.append(f"rank {rank}: no heartbeat")
                continue
            silent = now - at
            if silent > stale:
                behind.append(f"rank {rank} (pid {pid}): silent for {silent:.0f} s at "
                              f"step {step} (frozen or dead)")
            elif step < self._step:
                behind.append(f"rank {rank}: still at step {step}")
        return behind

    def message(self) -> str:
        behind = self._others()
        where = ("" if self.world_size == 1 else f"; {'; '.join(behind)}" if behind else
                 "; every other rank is alive at this step" if self._shared else
                 f" (this job has no store the ranks share: set ${HEARTBEAT_DIR_ENV} or "
                 "`directory` to a directory every process shares to learn which rank is behind)")
        return (f"tfdist.Watchdog: rank {self.rank} of {self.world_size}: training step "
                f"{self._step} has run for more than {self.timeout:g} s{where}. Ending this "
                f"process (exit code {WATCHDOG_EXIT}) instead of waiting on (with "
                "tfdist.callbacks.BackupAndRestore the same command resumes from the last "
                "backup).")

    @property
    def _interval(self) -> float:
        return min(1.0, self.timeout / 10)

    def _watch(self) -> None:
        self._beat()  # at once: a rank that freezes in its first steps has been seen alive
        while not self._stop.wait(self._interval):
            self._beat()
            started = self._started
            if started is not None and time.monotonic() - started > self.timeout:
                print(self.message(), file=sys.stderr, flush=True)
                self._exit(WATCHDOG_EXIT)
                return
