"""The multi-process rows of the bench suites: one command run as N TF_CONFIG workers or N
Horovod ranks on 127.0.0.1, with a hard timeout and the processes' output on failure."""

from __future__ import annotations

import os
import sys

from tfdist.tools.launch import run_horovod, run_tf_workers


def run_on(kind: str, argv: list[str], processes: int, timeout: float, what: str) -> bool:
    """Runs `argv` as `processes` Horovod ranks (`kind` "horovod") or TF_CONFIG workers (any
    other kind). Returns False, with a note, where Horovod is not installed; raises
    RuntimeError with the end of every process' output if one fails."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    if kind == "horovod":
        from tfdist.horovod import is_available

        if not is_available():
            print(f"bench: Horovod is not installed; skipping {what}", file=sys.stderr)
            return False
        results = [run_horovod(argv, processes, timeout, env=env)]
    else:
        results = run_tf_workers(argv, processes, timeout, env=env)
    if any(r.returncode != 0 for r in results):
        tail = "\n".join(r.output[-2000:] for r in results)
        raise RuntimeError(f"bench: the {kind} processes of {what} failed:\n{tail}")
    return True
