"""Data: the embedded digits set, synthetic generators, and per-worker sharding."""

from tfdist.data.datasets import (
    distribute,
    distribute_batches,
    global_batches,
    load_digits,
    shard_batches,
    synthetic_classification,
)

__all__ = [
    "distribute",
    "distribute_batches",
    "global_batches",
    "load_digits",
    "shard_batches",
    "synthetic_classification",
]
