"""How a parameter-server task of `tfdist train` ends on a termination notice.

The servers hold the training state and checkpoint it every `train.checkpoint_steps` updates, so
on a notice (train.preemption_signals) every task ends with PREEMPTED_EXIT and the same command
resumes from the servers' newest checkpoint: there is no backup to write at the step in flight.
A server raises `Notice` out of its serving loop; a worker stops at the end of its step in flight
(`StopOnNotice`), or when its next call finds the servers gone.

Every task ends at once with `os._exit`: TensorFlow's RPC server and client threads still run,
and the interpreter's shutdown around them can abort the process ("terminate called without an
active exception") or hang. Nothing is left to write: a checkpoint being written counts only
once it is renamed whole, and a worker's own checkpoint of its step in flight is written before
`StopOnNotice` looks.

A task that has not ended `DEADLINE` seconds after its notice (its main thread inside a call
that does not return) prints where each of its threads is and ends all the same: the notice is
heard the moment it arrives (`signal.set_wakeup_fd`), not when the main thread next runs Python.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from typing import NoReturn

import keras

from tfdist.callbacks import PREEMPTED_EXIT
from tfdist.callbacks.channel import launcher_channel

# Seconds a task may take to end after a notice; below the launcher's grace period
# (tfdist.tools.launch.PREEMPTION_GRACE, 30 s), which kills what is still running after it.
DEADLINE = 20.0
# Seconds a worker whose servers went away waits for the notice that explains it.
NOTICE_WAIT = 10.0

NOTICED = threading.Event()
LISTENING = threading.Event()  # this process answers notices (`listen` installed its handlers)
FINISHING = threading.Event()  # training is over: a notice no longer ends the task (epilogue)
_watching = threading.Lock()  # held once the deadline's watcher runs (one per process)


class Notice(BaseException):
    """A termination notice reached a parameter server's main thread. A BaseException, as
    KeyboardInterrupt is: no `except Exception` on the way out of the serving loop holds it."""


def listen(signals: list[str], raising: bool) -> None:
    """Installs the handlers of `signals` (names, e.g. "SIGTERM"): each sets `NOTICED` and, with
    `raising`, raises `Notice` in the main thread; and starts the deadline's watcher."""

    def noticed(signum, frame):
        NOTICED.set()
        if raising:
            raise Notice(signal.Signals(signum).name)

    numbers = {int(getattr(signal, name)) for name in signals}
    for number in numbers:
        signal.signal(number, noticed)
    if _watching.acquire(blocking=False):
        read, write = os.pipe()
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        threading.Thread(target=_watch, args=(read, numbers), daemon=True,
                         name="tfdist-notice-deadline").start()
    LISTENING.set()
    launcher_channel().listen()  # notices the launcher passes on as lines (a task over ssh)


def _watch(read: int, numbers: set[int]) -> None:
    """Waits for a notice's signal number on the wakeup pipe (one before the training ended),
    then `DEADLINE` seconds."""
    while not any(number in numbers for number in os.read(read, 64)) or FINISHING.is_set():
        pass
    NOTICED.set()
    time.sleep(DEADLINE)
    print(f"tfdist: still running {DEADLINE:g} s after the termination notice; where each "
          "thread is:", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    exit_preempted()


def exit_preempted() -> NoReturn:
    """Says so and ends the process with PREEMPTED_EXIT, at once (see the module docstring)."""
    print(f"termination notice: exiting with {PREEMPTED_EXIT}; the same command resumes from the "
          "parameter servers' newest checkpoint", flush=True)
    sys.stderr.flush()
    os._exit(PREEMPTED_EXIT)


class StopOnNotice(keras.callbacks.Callback):
    """Ends a parameter-server worker after its step in flight once a notice arrived, without
    telling the servers it finished (it has not: the job resumes)."""

    def on_train_batch_end(self, batch, logs=None):
        if NOTICED.is_set():
            exit_preempted()
