"""Pipeline and operator-level model parallelism.

* `Pipeline`: a Keras layer whose stages (lists of layers) run on their own devices over
  micro-batches, by the GPipe or the 1F1B schedule, with re-materialization and skip connections
  (`Stash` / `Pop`) that go straight from one stage to a later one;
* `PipelineModel`: a model that is one Pipeline, with the loss on the last stage, so `fit` runs
  forwards and backwards interleaved (1F1B's memory bound);
* `balance_by_size` / `balance_by_time`: split a list of layers into stages;
* `ColumnParallelDense` / `RowParallelDense`: one Dense kernel split over devices;
* `schedule`: the schedules as pure clock tables.
"""

from tfdist.pipeline import schedule
from tfdist.pipeline.balance import balance_by_size, balance_by_time, partition, split
from tfdist.pipeline.pipeline import (
    Pipeline,
    PipelineModel,
    PipelineStats,
    default_devices,
    place_slots,
)
from tfdist.pipeline.skip import Pop, Stash
from tfdist.pipeline.tensor_parallel import ColumnParallelDense, RowParallelDense, on_device

__all__ = [
    "ColumnParallelDense",
    "Pipeline",
    "PipelineModel",
    "PipelineStats",
    "Pop",
    "RowParallelDense",
    "Stash",
    "balance_by_size",
    "balance_by_time",
    "default_devices",
    "on_device",
    "partition",
    "place_slots",
    "schedule",
    "split",
]
