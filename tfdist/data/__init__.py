"""Data: the embedded digits set, synthetic generators, per-worker sharding, and the sequence of
global batches as a pure function of (seed, epoch), resumable at any batch."""

from tfdist.data.datasets import (
    distribute,
    distribute_batches,
    epoch_order,
    global_batches,
    load_digits,
    resume,
    shard_batches,
    synthetic_classification,
)

__all__ = [
    "distribute",
    "distribute_batches",
    "epoch_order",
    "global_batches",
    "load_digits",
    "resume",
    "shard_batches",
    "synthetic_classification",
]
