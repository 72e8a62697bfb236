"""tfdist: distributed training for Keras 3 `model.fit` on TensorFlow 2.21.

One algorithm core, handed an engine: the tf.distribute engine (strategies, and the wrappers
under any strategy), the Horovod engine (`tfdist.horovod`, imported on demand so `import tfdist`
works without Horovod), and a world of one. The tools around the library (the `tfdist` command,
configs, benchmarks, the emulated cluster, launchers) live in `tfdist.tools`, which the library
never imports.

`import tfdist` imports the library, which registers its Keras classes (so `load_model` finds
them). One exception: the `tfdist` command asked only for `--help` or `--version` answers from
its parser, without TensorFlow's import (seconds); the library then loads on first use.
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
    "tensor_parallel",
    "zero",
]


_SUBMODULES = ("averaging", "callbacks", "comm", "compression", "data", "devices", "optimizers",
               "pipeline", "tensor_parallel", "zero")
_NAMES = {"DistributedOptimizer": "optimizers", "GradientExchange": "optimizers",
          "ZeroOptimizer": "zero", "CompressedStrategy": "strategies",
          "LocalSGDStrategy": "strategies", "MultiWorkerCompressedStrategy": "strategies",
          "MultiWorkerLocalSGDStrategy": "strategies", "MultiWorkerMirroredStrategy": "strategies"}


def _import_library() -> None:
    for name in _SUBMODULES:
        globals()[name] = importlib.import_module(f"tfdist.{name}")
    for name, module in _NAMES.items():
        globals()[name] = getattr(importlib.import_module(f"tfdist.{module}"), name)


def _help_only() -> bool:
    argv = _sys.argv
    return (bool(argv) and _os.path.basename(argv[0]) == "tfdist"
            and any(arg in ("-h", "--help", "--version") for arg in argv[1:]))


_deferred = _help_only()


def __getattr__(name: str):
    """Imports the library on first use when it was deferred (help only)."""
    global _deferred
    if _deferred and (name in _SUBMODULES or name in _NAMES):
        _deferred = False
        _import_library()
        return globals()[name]
    raise AttributeError(f"module 'tfdist' has no attribute {name!r}")


if not _deferred:
    _import_library()
