"""This process's side of `python -m tfdist.launch`'s channel: the standard streams every
launcher has, on one machine or over ssh, never a file (the hosts need not share one).

- In the environment: TFDIST_ELASTIC, TFDIST_ELASTIC_MIN_WORKERS, TFDIST_ELASTIC_MAX_WORKERS and
  TFDIST_ELASTIC_MEASURED (an elastic job's sizes and the throughput measured so far), and
  TFDIST_NOTICES=stdin (a process the launcher reaches over ssh, where a signal to the local ssh
  client would not reach it). The end of standard input then means the launcher is gone: the
  process gets SIGHUP, as a command does whose ssh session closes.
- On standard input, one JSON object a line: `{"offer": n}` (the elastic launcher offers n
  workers; read by the chief) and `{"notice": "SIGTERM"}` (a preemption notice the launcher
  received, passed on: raised here as that signal, so the process's handler backs it up as if
  the signal had come to it).
- On standard output: the chief's resize request, a line starting with `REQUEST_TAG`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

REQUEST_TAG = "[tfdist] elastic request "  # then {"size": n, "reason": ..., "measured": {...}}
NOTICES_ENV = "TFDIST_NOTICES"  # "stdin": preemption notices come as lines on standard input
NOTICE_SIGNALS = ("SIGTERM", "SIGUSR1")  # the notices a line may carry


class LauncherChannel:
    """Reads the launcher's lines on standard input (when the launcher sends any) and sends the
    chief's requests."""

    def __init__(self, environ=None, stdin=None):
        environ = os.environ if environ is None else environ
        self.active = environ.get("TFDIST_ELASTIC") == "1"
        self.notices = environ.get(NOTICES_ENV) == "stdin"
        self.low = _int_or(environ.get("TFDIST_ELASTIC_MIN_WORKERS"), None)
        self.high = _int_or(environ.get("TFDIST_ELASTIC_MAX_WORKERS"), None)
        try:
            measured = json.loads(environ.get("TFDIST_ELASTIC_MEASURED") or "{}")
            self.measured = {int(k): float(v) for k, v in measured.items()}
        except (ValueError, TypeError, AttributeError):
            self.measured = {}
        self._stdin = stdin
        self._offer = 0
        self._listening = False
        self._lock = threading.Lock()

    def listen(self) -> None:
        """Starts reading the launcher's lines from standard input (once per process; only
        when the launcher sends offers or notices)."""
        if not (self.active or self.notices) or self._listening:
            return
        self._listening = True
        threading.Thread(target=self._read, daemon=True, name="tfdist-launcher-channel").start()

    def _read(self) -> None:
        stream = self._stdin if self._stdin is not None else sys.stdin
        for line in iter(stream.readline, ""):
            try:
                message = json.loads(line.strip())
            except ValueError:
                continue  # not for us (a terminal may echo other input)
            if not isinstance(message, dict):
                continue
            if self.notices and message.get("notice") in NOTICE_SIGNALS:
                signal.raise_signal(getattr(signal, message["notice"]))
            elif "offer" in message:
                try:
                    offer = int(message["offer"])
                except (ValueError, TypeError):
                    continue
                with self._lock:
                    self._offer = max(self._offer, offer)
        if self.notices:  # the launcher's link closed: a hang-up, as ssh gives its command
            signal.raise_signal(signal.SIGHUP)

    def offer(self) -> int:
        """The most workers the launcher has offered so far (0: none)."""
        with self._lock:
            return self._offer

    def request(self, size: int, reason: str, measured: dict[int, float]) -> None:
        """Asks the launcher to restart the job on `size` workers (the chief, before it exits
        with RESIZE_EXIT)."""
        print(REQUEST_TAG + json.dumps({"size": size, "reason": reason,
                                        "measured": {str(k): v for k, v in measured.items()}}),
              flush=True)


def _int_or(text, default):
    try:
        return int(text)
    except (TypeError, ValueError):
        return default


_channel: LauncherChannel | None = None


def launcher_channel() -> LauncherChannel:
    """This process's channel to the launcher (one per process)."""
    global _channel
    if _channel is None:
        _channel = LauncherChannel()
    return _channel
