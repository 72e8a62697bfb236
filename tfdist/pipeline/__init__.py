"""Pipeline parallelism: a Keras layer whose stages run on their own devices over micro-batches.

* `Pipeline` (`layer.py`): stages (lists of layers) on devices, run by the GPipe or the 1F1B
  schedule, with re-materialization and skip connections (`Stash` / `Pop`, `skip.py`) that go
  straight from one stage to a later one; `executor.py` runs one pass of the schedule;
* `PipelineModel` (`model.py`): a model that is one Pipeline, with the loss on the last stage,
  so `fit` runs forwards and backwards interleaved (1F1B's memory bound);
* `balance_by_size` / `balance_by_time` (`balance.py`): split a list of layers into stages;
* `cluster_devices` (`cluster.py`): one device per TF_CONFIG worker, so stages (and rows of
  data-parallel pipelines) run in other processes and hosts through TF's cluster runtime;
* `schedule`: the schedules as pure clock tables; `PipelineStats` (`stats.py`): what a run kept;

Placing optimizer slots with their variables is `tfdist.devices.place_slots`; tensor-parallel
layers are in `tfdist.tensor_parallel`.
"""

from tfdist.pipeline import schedule
from tfdist.pipeline.balance import balance_by_size, balance_by_time, partition, split
from tfdist.pipeline.cluster import cluster_devices
from tfdist.pipeline.layer import Pipeline
from tfdist.pipeline.model import PipelineModel
from tfdist.pipeline.skip import Pop, Stash
from tfdist.pipeline.stats import PipelineStats

__all__ = [
    "Pipeline",
    "PipelineModel",
    "PipelineStats",
    "Pop",
    "Stash",
    "balance_by_size",
    "balance_by_time",
    "cluster_devices",
    "partition",
    "schedule",
    "split",
]
