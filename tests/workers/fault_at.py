"""`tfdist train` with one fault at the end of its run, for tests/test_safe_resume.py:

    python tests/workers/fault_at.py KIND POINT [tfdist train's arguments]

KIND is `kill` (SIGKILL) or `notice` (SIGTERM, a termination notice); POINT is where: `trained`
(after the last step, before the test evaluation), `saved_model` (after model.keras, before
summary.json), `finished` (after summary.json, before the backups go) or `ended` (as `train`
returns). The faults are put in from here, around the runner's own steps: the library has no
switch for them."""

from __future__ import annotations

import os
import signal
import sys

from tfdist.tools import cli, runner
from tfdist.tools.run_files import Run
from tfdist.tools.workload import Workload


def fire(kind: str) -> None:
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    signal.raise_signal(signal.SIGTERM)


def before(owner, name: str, kind: str) -> None:
    """`owner.name` fires the fault as it is called."""
    original = getattr(owner, name)

    def faulted(*args, **kwargs):
        fire(kind)
        return original(*args, **kwargs)

    setattr(owner, name, faulted)


def main(kind: str, point: str, argv: list[str]) -> int:
    if point == "trained":
        before(Workload, "evaluate", kind)
    elif point == "saved_model":
        before(Run, "finish", kind)
    elif point == "finished":
        before(Run, "remove_backups", kind)
    elif point == "ended":
        train = runner.train

        def ended(*args, **kwargs):
            try:
                return train(*args, **kwargs)
            finally:
                fire(kind)

        runner.train = ended
    else:
        raise SystemExit(f"unknown point {point!r}")
    return cli.main(["train", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
