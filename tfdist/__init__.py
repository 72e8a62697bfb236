"""tfdist: distributed training for Keras 3 `model.fit` on TensorFlow 2.21.

One algorithm core, handed an engine: the tf.distribute engine (strategies, and the wrappers
under any strategy), the Horovod engine (`tfdist.horovod`, imported on demand so `import tfdist`
works without Horovod), and a world of one. The tools around the library (the `tfdist` command,
configs, benchmarks, the emulated cluster, launchers) live in `tfdist.tools`, which the library
never imports.

`import tfdist` imports the library, which registers its Keras classes (so `load_model` finds
them). Two kinds of process load it on first use instead: the launchers (`python -m
tfdist.launch`, `python -m tfdist.emulated`), which need no TensorFlow (seconds saved at every
job start), and the `tfdist` command asked only for `--help` or `--version`. Otherwise, when this
process is the `tfdist` command, unless `--verbose`, TensorFlow's C++ logging is silenced: its
level is set before TensorFlow loads, and the lines its libraries print while loading (before
that level applies) go to /dev/null.
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


_LAUNCHERS = ("tfdist.launch", "tfdist.tools.launch", "tfdist.emulated", "tfdist.tools.emulated")


def _main_module() -> str | None:
    """The module this process runs with `python -m`, else None."""
    original = list(getattr(_sys, "orig_argv", []))
    if "-m" in original[:-1]:
        return original[original.index("-m") + 1]
    return None


def _command_arguments() -> list[str] | None:
    """The arguments when this process is the `tfdist` command (its console script, or
    `python -m tfdist.tools.cli`), else None."""
    argv = _sys.argv
    if argv and _os.path.basename(argv[0]) == "tfdist":
        return argv[1:]
    if _main_module() == "tfdist.tools.cli":
        original = list(_sys.orig_argv)
        return original[original.index("-m") + 2:]
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
_deferred = (_arguments is not None and any(a in ("-h", "--help", "--version") for a in _arguments)
             ) or _main_module() in _LAUNCHERS
_quiet = (_arguments is not None and not {"-v", "--verbose"} & set(_arguments)) or \
    _os.environ.get("TFDIST_QUIET") == "1"  # tfdist.logs.QUIET_ENV
if _quiet:
    _os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def __getattr__(name: str):
    """Imports the library on first use when it was deferred (help, the launchers)."""
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
