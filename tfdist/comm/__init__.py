"""Engines and collective communication, with counted bytes (the ring model) and calls.

* `Engine` (`engine.py`): how this process's replicas train together, handed to every
  algorithm; `resolve()` finds the running one. Engines: `DistributeEngine` (tf.distribute,
  `distribute.py`), `HorovodEngine` (`horovod.py`), `LocalEngine` (a world of one).
* `Communicator` (`base.py`): the collectives an engine offers inside a train step, counting
  the bytes each worker sends and the collective calls; `fused_all_reduce` /
  `fused_all_gather` pack many tensors into one call, `bucketed_all_reduce` into one call per
  bucket, last tensors first (overlap with the backward pass), embedding rows in their place
  in that order; `sparse_all_reduce` sums an embedding's row gradients by all-gathering the
  rows each worker holds and their indices, in one call.
* The transport (`transport.py`): carries a codec's rounds (`Sum`, `Gather`, `Choice`) over a
  communicator, each round in one fused call (`reduce_encoded`, `run_rounds`).
"""

from tfdist.comm.base import (
    ByteCounter,
    Communicator,
    LocalCommunicator,
    bucketed_all_reduce,
    fused_all_gather,
    fused_all_reduce,
    ring_bytes,
    sparse_all_reduce,
    static_nbytes,
)
from tfdist.comm.consistency import model_fingerprint, verify_same_model, verify_same_setup
from tfdist.comm.distribute import DistributeEngine, ReplicaCommunicator
from tfdist.comm.engine import ENGINES, Engine, LocalEngine, activate, register, replica_copies, resolve
from tfdist.comm.engine import get as get_engine
from tfdist.comm.horovod import HorovodEngine
from tfdist.comm.transport import Choice, Gather, Sum, reduce_encoded, run_rounds

__all__ = [
    "ByteCounter",
    "Choice",
    "Communicator",
    "DistributeEngine",
    "ENGINES",
    "Engine",
    "Gather",
    "HorovodEngine",
    "LocalCommunicator",
    "LocalEngine",
    "ReplicaCommunicator",
    "Sum",
    "activate",
    "bucketed_all_reduce",
    "fused_all_gather",
    "fused_all_reduce",
    "get_engine",
    "model_fingerprint",
    "reduce_encoded",
    "register",
    "replica_copies",
    "resolve",
    "ring_bytes",
    "run_rounds",
    "sparse_all_reduce",
    "static_nbytes",
    "verify_same_model",
    "verify_same_setup",
]
