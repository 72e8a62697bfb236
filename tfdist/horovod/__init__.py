"""The Horovod engine: Keras 3 optimizer wrapper and callbacks on `horovod.tensorflow` ops.

Run under `horovodrun` (see BUILD.md for building Horovod against TensorFlow 2.21):

    horovodrun --gloo -np 2 -H localhost:2 python train.py

Importing this module does not import Horovod; `init()` does.
"""

from __future__ import annotations

from tfdist.comm.horovod import import_horovod
from tfdist.horovod import callbacks
from tfdist.horovod.optimizer import DistributedOptimizer, ZeroOptimizer


def init(process_sets=None) -> None:
    """Initialises Horovod (idempotent).

    Args:
        process_sets: Passed to `hvd.init`; "dynamic" lets tfdist create the groups that
            hierarchical averaging reduces within.
    """
    hvd = import_horovod()
    if not hvd.is_initialized():
        hvd.init(process_sets=process_sets)


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


__all__ = ["DistributedOptimizer", "callbacks", "init", "is_available", "local_rank", "rank", "size",
           "ZeroOptimizer"]
