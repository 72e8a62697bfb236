"""Data: the embedded digits set, synthetic generators, per-worker sharding, the sequence of
global batches as a pure function of (seed, epoch), resumable at any batch, and record sets for
data larger than memory, each worker reading only its slice."""

from tfdist.data.datasets import (
    distribute,
    distribute_batches,
    distribute_shards,
    epoch_order,
    global_batches,
    load_digits,
    resume,
    shard_batches,
    synthetic_classification,
)
from tfdist.data.records import (
    RecordError,
    RecordSource,
    convert_arrays,
    convert_images,
    convert_tfrecords,
    record_batches,
)

__all__ = [
    "RecordError",
    "RecordSource",
    "convert_arrays",
    "convert_images",
    "convert_tfrecords",
    "distribute_shards",
    "record_batches",
    "distribute",
    "distribute_batches",
    "epoch_order",
    "global_batches",
    "load_digits",
    "resume",
    "shard_batches",
    "synthetic_classification",
]
