"""The Horovod front end: `init()`, the process role, and Keras 3 callbacks on Horovod ops.

Run under `horovodrun` (see BUILD.md for building Horovod against TensorFlow 2.21):

    horovodrun --gloo -np 2 -H localhost:2 python train.py

`init()` makes Horovod this process's engine (`tfdist.comm.HorovodEngine`), so every tfdist
optimizer built afterwards (outside a tf.distribute strategy) trains over the ranks.
`DistributedOptimizer` and `ZeroOptimizer` here are `tfdist.DistributedOptimizer` and
`tfdist.ZeroOptimizer` themselves: one class per algorithm, whatever the engine, so a model saved
under Horovod loads under a strategy and the other way round.

Importing this module does not import Horovod; `init()` does.
"""

from __future__ import annotations

import keras

from tfdist.comm import HorovodEngine, activate
from tfdist.comm.horovod import import_horovod
from tfdist.horovod import callbacks
from tfdist.optimizers import DistributedOptimizer
from tfdist.zero import ZeroOptimizer

# Models saved by tfdist 0.1 name these classes under the "tfdist.horovod" package.
for _cls in (DistributedOptimizer, ZeroOptimizer):
    keras.saving.get_custom_objects()[f"tfdist.horovod>{_cls.__name__}"] = _cls


def init(process_sets=None) -> None:
    """Initialises Horovod (idempotent) and makes it this process's engine.

    Args:
        process_sets: Passed to `hvd.init`; "dynamic" lets tfdist create the groups that
            hierarchical averaging reduces within.
    """
    hvd = import_horovod()
    if not hvd.is_initialized():
        hvd.init(process_sets=process_sets)
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


__all__ = ["DistributedOptimizer", "callbacks", "init", "is_available", "local_rank", "rank", "size",
           "ZeroOptimizer"]
