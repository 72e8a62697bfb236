"""Quiet runs: TensorFlow's and Keras' log lines and known-harmless warnings silenced.

`tfdist` prints nothing of its own on stderr but errors; TensorFlow prints lines while it loads
(C++: CUDA probes, oneDNN, CPU features) and while it runs (Python loggers, warnings). The
`tfdist` command silences them unless `--verbose`; a Python program gets the same with
`TFDIST_QUIET=1` in its environment (read by the first `import tfdist`, which must come before
TensorFlow's import for the C++ lines), or with `tfdist.quiet()` for the Python-level ones.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

QUIET_ENV = "TFDIST_QUIET"
# Warnings that say nothing about the job: tf.distribute's and tf.data's notes on what it does.
HARMLESS = (r".*Using MirroredStrategy eagerly has significant overhead.*",
            r".*Your input ran out of data.*", r".*shuffle.*")


def quiet() -> None:
    """Silences TensorFlow's Python logs (absl, `tf.get_logger()`) below ERROR and the
    known-harmless warnings. The C++ lines TensorFlow prints while it loads need
    `TFDIST_QUIET=1` (or `TF_CPP_MIN_LOG_LEVEL=3`) before TensorFlow's import.

    Example:
        ```python
        import tfdist

        tfdist.quiet()
        ```
    """
    for pattern in HARMLESS:
        warnings.filterwarnings("ignore", message=pattern)
    import absl.logging
    import tensorflow as tf

    absl.logging.set_verbosity(absl.logging.ERROR)
    tf.get_logger().setLevel("ERROR")


@contextlib.contextmanager
def silenced_stderr():
    """Points this process's file descriptor 2 at /dev/null for the block (the lines
    TensorFlow's C++ libraries print while they load, before any log level applies)."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@contextlib.contextmanager
def loading_quietly():
    """For a block that may import TensorFlow (the first time): its C++ log level set to errors
    and the lines its libraries print while they load (before any level applies) silenced; then
    `quiet()` once it is loaded. The `tfdist` command wraps its config check in it (which loads
    TensorFlow only when the config gets past the schema) and its commands' start."""
    from tfdist._hooks.imports import matplotlib_on_first_use

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    try:
        with silenced_stderr(), matplotlib_on_first_use():
            yield
    finally:
        if "tensorflow" in sys.modules:
            quiet()
