"""tfdist: distributed training for Keras 3 `model.fit` on TensorFlow 2.21.

One algorithm core, handed an engine: the tf.distribute engine (strategies, and the wrappers
under any strategy), the Horovod engine (`tfdist.horovod`, imported on demand so `import tfdist`
works without Horovod), and a world of one. The tools around the library (the `tfdist` command,
configs, benchmarks, the emulated cluster, launchers) live in `tfdist.tools`, which the library
never imports.

`import tfdist` imports the library, which registers its Keras classes (so `load_model` finds
them). When this process is the `tfdist` command, two things happen first: asked only for
`--help` or `--version`, it answers from its parser without TensorFlow's import (seconds; the
library then loads on first use); otherwise, unless `--verbose`, TensorFlow's C++ logging is
silenced: its level is set before TensorFlow loads, and the lines its libraries print while
loading (before that level applies) go to /dev/null.
"""

from __future__ import annotations

import importlib
import os as _os
import sys as _sys

__version__ = "0.1.0"

__all__ = [
    "CompressedStrategy",
    "DistributedOptimizer",
    "GradientExchange",
    "LocalSGDStrategy",
    "MultiWorkerCompressedStrategy",
    "MultiWorkerLocalSGDStrategy",
    "MultiWorkerMirroredStrategy",
    "ZeroOptimizer",
    "__version__",
    "averaging",
    "callbacks",
    "comm",
    "compression",
    "data",
    "devices",
    "optimizers",
    "pipeline",
    "quiet",
    "ps",
    "tensor_parallel",
    "zero",
]


_SUBMODULES = ("averaging", "callbacks", "comm", "compression", "data", "devices", "optimizers",
               "pipeline", "ps", "tensor_parallel", "zero")
_NAMES = {"quiet": "logs", "DistributedOptimizer": "optimizers", "GradientExchange": "optimizers",
          "ZeroOptimizer": "zero", "CompressedStrategy": "strategies",
          "LocalSGDStrategy": "strategies", "MultiWorkerCompressedStrategy": "strategies",
          "MultiWorkerLocalSGDStrategy": "strategies", "MultiWorkerMirroredStrategy": "strategies"}


def _import_library() -> None:
    for name in _SUBMODULES:
        globals()[name] = importlib.import_module(f"tfdist.{name}")
    for name, module in _NAMES.items():
        globals()[name] = getattr(importlib.import_module(f"tfdist.{module}"), name)


def _command_arguments() -> list[str] | None:
    """The arguments when this process is the `tfdist` command (its console script, or
    `python -m tfdist.tools.cli`), else None."""
    argv = _sys.argv
    if argv and _os.path.basename(argv[0]) == "tfdist":
        return argv[1:]
    original = list(getattr(_sys, "orig_argv", []))
    if "-m" in original:
        i = original.index("-m")
        if original[i + 1:i + 2] == ["tfdist.tools.cli"]:
            return original[i + 2:]
    return None


def _without_stderr(fn) -> None:
    """Runs `fn` with this process's file descriptor 2 on /dev/null, then restores it."""
    _sys.stderr.flush()
    saved, devnull = _os.dup(2), _os.open(_os.devnull, _os.O_WRONLY)
    try:
        _os.dup2(devnull, 2)
        fn()
    finally:
        _os.dup2(saved, 2)
        _os.close(saved)
        _os.close(devnull)


_arguments = _command_arguments()
_deferred = _arguments is not None and any(a in ("-h", "--help", "--version") for a in _arguments)
_quiet = (_arguments is not None and not {"-v", "--verbose"} & set(_arguments)) or \
    _os.environ.get("TFDIST_QUIET") == "1"  # tfdist.logs.QUIET_ENV
if _quiet:
    _os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def __getattr__(name: str):
    """Imports the library on first use when it was deferred (help only)."""
    global _deferred
    if _deferred and (name in _SUBMODULES or name in _NAMES):
        _deferred = False
        _import_library()
        return globals()[name]
    raise AttributeError(f"module 'tfdist' has no attribute {name!r}")


if not _deferred:
    _without_stderr(_import_library) if _quiet else _import_library()
    if _quiet and _arguments is None:  # TFDIST_QUIET=1 in a Python program
        globals()["quiet"]()
