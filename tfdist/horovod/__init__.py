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

import os

from tfdist.comm import HorovodEngine, activate
from tfdist.comm.horovod import import_horovod, wait_for_the_others_at_exit
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


def init(process_sets=None, *, cycle_ms: float | None = None, **horovod_options) -> None:
    """Initialises Horovod (idempotent) and makes it this process's engine.

    Args:
        process_sets: Passed to `hvd.init`; "dynamic" lets tfdist create the groups that
            hierarchical averaging reduces within.
        cycle_ms: Milliseconds between the rounds in which Horovod's background thread agrees
            with the other ranks on the tensors ready to reduce (`HOROVOD_CYCLE_TIME`, read
            once, by `hvd.init`); None keeps Horovod's own (1 ms, or the variable's). Each
            round costs CPU time on every rank, even with nothing to reduce: on hosts whose
            cores all compute, a longer cycle leaves them more (see the models benchmark
            page), and adds up to `cycle_ms` of waiting to each bucket.
        **horovod_options: Horovod's other `hvd.init` arguments (`comm`, ...).

    Example:
        ```python
        # horovodrun -np 2 python train.py
        import tfdist.horovod as hvd

        hvd.init()
        model = build_model()
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3 * hvd.size())),
                      loss="sparse_categorical_crossentropy")
        model.fit(x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()], batch_size=32, epochs=2,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)],
                  verbose=1 if hvd.rank() == 0 else 0)
        ```
    """
    hvd = import_horovod()
    if cycle_ms is not None:
        _set_cycle_time(cycle_ms, hvd.is_initialized())
    if not hvd.is_initialized():
        hvd.init(process_sets=process_sets, **horovod_options)
        wait_for_the_others_at_exit()
    activate(HorovodEngine())


def _set_cycle_time(cycle_ms: float, initialized: bool) -> None:
    """Sets `HOROVOD_CYCLE_TIME` for `hvd.init`. Raises ValueError for a value that is not a
    number > 0, one that differs from the variable the user set, or one given once Horovod is
    initialised (it read its cycle time then)."""
    if not isinstance(cycle_ms, (int, float)) or isinstance(cycle_ms, bool) or cycle_ms <= 0:
        raise ValueError(f"cycle_ms: got {cycle_ms!r}; it must be a number of milliseconds "
                         "> 0, e.g. 10")
    value = f"{cycle_ms:g}"
    current = os.environ.get("HOROVOD_CYCLE_TIME")
    if current is not None and _number(current) != float(value):
        raise ValueError(f"cycle_ms: got {value} ms, but HOROVOD_CYCLE_TIME={current} is set; "
                         "unset the variable or give the same value")
    if initialized and current is None:
        raise ValueError(f"cycle_ms: got {value} ms after Horovod was initialised, which read "
                         "its cycle time then; pass it to the first init()")
    os.environ["HOROVOD_CYCLE_TIME"] = value


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def size() -> int:
    """`hvd.size`: the number of ranks.

    Example:
        ```python
        # horovodrun -np 2 python train.py
        import tfdist.horovod as hvd

        hvd.init()
        print(f"rank {hvd.rank()} of {hvd.size()}")
        ```
    """
    return int(import_horovod().size())


def rank() -> int:
    """`hvd.rank`: this process's rank, 0 to `size() - 1`.

    Example:
        ```python
        # horovodrun -np 2 python train.py
        import tfdist.horovod as hvd

        hvd.init()
        verbose = 1 if hvd.rank() == 0 else 0  # one rank prints
        ```
    """
    return int(import_horovod().rank())


def local_rank() -> int:
    """`hvd.local_rank`: this process's rank among the ranks of its host.

    Example:
        ```python
        # horovodrun -np 2 python train.py
        import tfdist.horovod as hvd

        hvd.init()
        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")  # one GPU per rank
        ```
    """
    return int(import_horovod().local_rank())


def is_available() -> bool:
    """Whether Horovod is installed and importable here.

    Example:
        ```python
        import tfdist.horovod as hvd

        engine = "horovod" if hvd.is_available() else "tf.distribute"
        ```
    """
    try:
        import_horovod()
    except ImportError:
        return False
    return True


def is_initialized() -> bool:
    """`hvd.is_initialized`: whether `init` ran in this process.

    Example:
        ```python
        import tfdist.horovod as hvd

        print(hvd.is_initialized())  # False until hvd.init()
        ```
    """
    return bool(import_horovod().is_initialized())


__all__ = ["Adasum", "Average", "Compression", "DistributedOptimizer", "Sum", "ZeroOptimizer",
           "allgather", "allreduce", "broadcast", "broadcast_variables", "callbacks",
           "cross_rank", "cross_size", "init", "is_available", "is_initialized", "join",
           "local_rank", "local_size", "rank", "size"]
