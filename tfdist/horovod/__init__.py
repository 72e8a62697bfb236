"""The Horovod front end: `init()`, the process role, and Keras 3 callbacks on Horovod ops.

Run under `horovodrun` (see BUILD.md for building Horovod against TensorFlow 2.21):

    horovodrun --gloo -np 2 -H localhost:2 python train.py

`init()` makes Horovod this process's engine (`tfdist.comm.HorovodEngine`), so every tfdist
optimizer built afterwards (outside a tf.distribute strategy) trains over the ranks.
`DistributedOptimizer(...)` returns a `tfdist.DistributedOptimizer` and `ZeroOptimizer` is
`tfdist.ZeroOptimizer` itself: one class per algorithm, whatever the engine, so a model saved
under Horovod loads under a strategy and the other way round.

Horovod's Keras API is spoken here too (`tfdist.horovod.keras_api`): a script written for
`horovod.tensorflow.keras` runs with `import tfdist.horovod as hvd` (`hvd.DistributedOptimizer(
opt, compression=hvd.Compression.fp16, backward_passes_per_step=...)`,
`hvd.callbacks.BroadcastGlobalVariablesCallback(0)`, `hvd.elastic.run`, ...).

Importing this module does not import Horovod; `init()` does.
"""

from __future__ import annotations

from tfdist.comm import HorovodEngine, activate
from tfdist.comm.horovod import import_horovod
from tfdist.horovod import callbacks
from tfdist.horovod.keras_api import (
    Adasum,
    Average,
    Compression,
    DistributedOptimizer,
    Sum,
    allgather,
    allreduce,
    broadcast,
    broadcast_variables,
    cross_rank,
    cross_size,
    join,
    local_size,
)
from tfdist.zero import ZeroOptimizer


def __getattr__(name: str):
    if name == "elastic":  # imports Horovod: only when asked for
        import importlib

        return importlib.import_module("tfdist.horovod.elastic")
    raise AttributeError(f"module 'tfdist.horovod' has no attribute {name!r}")


def init(process_sets=None, **horovod_options) -> None:
    """Initialises Horovod (idempotent) and makes it this process's engine.

    Args:
        process_sets: Passed to `hvd.init`; "dynamic" lets tfdist create the groups that
            hierarchical averaging reduces within.
        **horovod_options: Horovod's other `hvd.init` arguments (`comm`, ...).
    """
    hvd = import_horovod()
    if not hvd.is_initialized():
        hvd.init(process_sets=process_sets, **horovod_options)
    activate(HorovodEngine())


def size() -> int:
    return int(import_horovod().size())


def rank() -> int:
    return int(import_horovod().rank())


def local_rank() -> int:
    return int(import_horovod().local_rank())


def is_available() -> bool:
    """Whether Horovod is installed and importable here."""
    try:
        import_horovod()
    except ImportError:
        return False
    return True


def is_initialized() -> bool:
    return bool(import_horovod().is_initialized())


__all__ = ["Adasum", "Average", "Compression", "DistributedOptimizer", "Sum", "ZeroOptimizer",
           "allgather", "allreduce", "broadcast", "broadcast_variables", "callbacks",
           "cross_rank", "cross_size", "init", "is_available", "is_initialized", "join",
           "local_rank", "local_size", "rank", "size"]
