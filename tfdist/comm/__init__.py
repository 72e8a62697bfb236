"""Collective communication with exact byte accounting (see `tfdist.comm.base`)."""

from tfdist.comm.base import (
    ByteCounter,
    Communicator,
    LocalCommunicator,
    ring_bytes,
    static_nbytes,
)
from tfdist.comm.consistency import model_fingerprint, verify_same_model
from tfdist.comm.eager import eager_collectives
from tfdist.comm.replica import ReplicaCommunicator

__all__ = [
    "ByteCounter",
    "Communicator",
    "LocalCommunicator",
    "eager_collectives",
    "ReplicaCommunicator",
    "model_fingerprint",
    "ring_bytes",
    "static_nbytes",
    "verify_same_model",
]
