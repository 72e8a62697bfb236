"""Where and when a benchmark ran, as its page states it (every suite's JSON starts so)."""

from __future__ import annotations

import os
import platform
import re
import time
from importlib import metadata


def machine() -> str:
    """This machine, as a benchmark page names it: cores, CPU model, memory, TensorFlow."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), "")
    except OSError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()} CPU cores{f' ({model})' if model else ''}, {memory:.0f} GiB, "
            f"{platform.system()}, no GPU, TensorFlow {metadata.version('tensorflow')}")


SETTINGS = ("TF_NUM_INTRAOP_THREADS",)  # variables of this environment that change the times


def stamp(command: str) -> dict[str, str]:
    """The head of a suite's JSON: the command that ran it (after the `SETTINGS` set in this
    environment, as a shell sets them), today's date and this machine."""
    settings = "".join(f"{k}={os.environ[k]} " for k in SETTINGS if k in os.environ)
    return {"command": settings + command, "date": time.strftime("%Y-%m-%d"),
            "machine": machine()}


def cores_of(machine_text: str) -> int | None:
    """The number of CPU cores a `machine()` text names, or None."""
    found = re.match(r"(\d+) CPU cores", machine_text)
    return int(found.group(1)) if found else None
