"""tfdist: distributed training for Keras 3 `model.fit` on TensorFlow 2.21.

One algorithm core, handed an engine: the tf.distribute engine (strategies, and the wrappers
under any strategy), the Horovod engine (`tfdist.horovod`, imported on demand so `import tfdist`
works without Horovod), and a world of one. The tools around the library (the `tfdist` command,
configs, benchmarks, the emulated cluster, launchers) live in `tfdist.tools`, which the library
never imports.

`import tfdist` imports the library, which registers its Keras classes (so `load_model` finds
them). Two kinds of process load it on first use instead, as they need no TensorFlow before
their work starts: the launchers (`python -m tfdist.launch`, `python -m tfdist.emulated`:
seconds saved at every job start) and the `tfdist` command (a config is checked before
TensorFlow loads, and TensorFlow quietly after it: `tfdist.logs.loading_quietly`).
"""

from __future__ import annotations

import importlib
import os as _os
import sys as _sys

from tfdist import logs as _logs

__version__ = "0.2.0"

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
    "plan",
    "quiet",
    "ps",
    "tensor_parallel",
    "zero",
]


_SUBMODULES = ("averaging", "callbacks", "comm", "compression", "data", "devices", "optimizers",
               "pipeline", "plan", "ps", "tensor_parallel", "zero")
_NAMES = {"quiet": "logs", "DistributedOptimizer": "optimizers", "GradientExchange": "optimizers",
          "ZeroOptimizer": "zero", "CompressedStrategy": "strategies",
          "LocalSGDStrategy": "strategies", "MultiWorkerCompressedStrategy": "strategies",
          "MultiWorkerLocalSGDStrategy": "strategies", "MultiWorkerMirroredStrategy": "strategies"}


def _import_library() -> None:
    from tfdist._hooks.imports import matplotlib_on_first_use

    with matplotlib_on_first_use():  # Keras' galleries would load it: a second of start-up
        import tensorflow  # noqa: F401
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


def _is_command() -> bool:
    """Whether this process is the `tfdist` command (its console script, or `python -m
    tfdist.tools.cli`)."""
    argv = _sys.argv
    return bool(argv) and _os.path.basename(argv[0]) == "tfdist" or \
        _main_module() == "tfdist.tools.cli"


_deferred = _is_command() or _main_module() in _LAUNCHERS


def __getattr__(name: str):
    """A name of the library, imported on first use (the command and the launchers import
    the library this way, a part at a time)."""
    if name in _NAMES:
        value = getattr(importlib.import_module(f"tfdist.{_NAMES[name]}"), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"tfdist.{name}")
    else:
        raise AttributeError(f"module 'tfdist' has no attribute {name!r}")
    globals()[name] = value
    return value


if not _deferred:
    if _os.environ.get(_logs.QUIET_ENV) == "1":  # a Python program asking for quiet
        if "tensorflow" in _sys.modules:  # loaded, and said what it says while loading
            print(f"[tfdist] {_logs.QUIET_ENV}=1 came after TensorFlow was imported (by keras "
                  "or your program), so its start-up lines are printed already: import tfdist "
                  "before keras and tensorflow",
                  file=_sys.stderr, flush=True)
        _os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        with _logs.silenced_stderr():
            _import_library()
        _logs.quiet()
    else:
        _import_library()
