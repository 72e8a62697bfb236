"""What a termination notice does to a `tfdist train` process once its training is over.

After `model.fit` returns (a parameter server: after its serving loop) there is no step left to
back up, and what remains is the run's epilogue: the test evaluation, model.keras, summary.json,
removing the backups. A notice (train.preemption_signals) that lands then no longer ends the
process: it is said, and the run finishes and exits 0, so a scheduler that stops a job as it
ends sees it done, not killed (143) or preempted (76) with nothing left to resume. An epilogue
that outlives the scheduler's grace is killed like any process; the same command then finishes
the run from its newest backup without training again.

In a process that ends with its run (`tfdist train`: `last_run`), the signals are then ignored
outright: the interpreter's shutdown resets Python's own handlers to the default action, under
which a notice in those last seconds would end the process as killed.
"""

from __future__ import annotations

import signal
import sys
import threading

from tfdist.tools import ps_notices

_previous: dict[int, object] = {}  # the handlers `begin` replaced, which `end` puts back
_last = threading.Event()  # this process ends with its run (`last_run`)


def last_run() -> None:
    """Says that this process ends once its run has: `end` then ignores the notices."""
    _last.set()


def begin(signals: list[str]) -> None:
    """From now on a notice among `signals` (names) is said and the run goes on to its end."""

    def noted(number, frame):
        if not ps_notices.NOTICED.is_set():
            print(f"[tfdist] {signal.Signals(number).name} received after training ended: "
                  "finishing the run (test evaluation, model, summary), then exiting 0",
                  file=sys.stderr, flush=True)
        ps_notices.NOTICED.set()  # a parameter-server worker whose servers go: a notice

    if threading.current_thread() is not threading.main_thread():
        return  # Python installs handlers only there; the caller's own handlers stay
    ps_notices.FINISHING.set()
    for number in _numbers(signals):
        previous = signal.signal(number, noted)
        _previous.setdefault(number, previous)


def end() -> None:
    """At the run's end: puts back the handlers `begin` replaced, or ignores those signals from
    now on in a process that ends with its run (`last_run`)."""
    if threading.current_thread() is not threading.main_thread():
        return
    while _previous:
        number, handler = _previous.popitem()
        signal.signal(number, signal.SIG_IGN if _last.is_set() else handler)
    if not _last.is_set():
        ps_notices.FINISHING.clear()


def _numbers(signals: list[str]) -> set[int]:
    return {int(getattr(signal, name)) for name in signals}
