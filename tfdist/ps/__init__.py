"""Parameter-server training for Keras 3 `model.fit`: synchronous, bounded-staleness (SSP) or
asynchronous, on TensorFlow's own RPC runtime.

* `Cluster`: the "ps" and worker tasks TF_CONFIG describes (`python -m tfdist.launch --ps P
  --workers W` writes it); variables are split over the ps tasks by size (`assign_shards`).
* `serve(model, optimizer, staleness)`: a ps task holds its shard of the variables and the
  optimizer state and applies the workers' gradients (`ParameterServer`).
* `ParameterServerOptimizer` + `FinishCallback`: a worker's `fit` pushes gradients and pulls
  weights inside its train step.
* `HogwildStrategy` + `HogwildSGD`: replicas on one host's devices update shared weights
  without locks (Hogwild).
* `ParameterServerEngine`: the task's role as a `tfdist.comm.Engine` (registered by name).
"""

from tfdist.ps.cluster import Cluster, assign_shards, shard_of
from tfdist.ps.engine import ParameterServerEngine
from tfdist.ps.hogwild import HogwildSGD, HogwildStrategy
from tfdist.ps.optimizer import FinishCallback, ParameterServerOptimizer
from tfdist.ps.server import ParameterServer, SetupMismatch, serve, staleness_report

__all__ = ["Cluster", "FinishCallback", "HogwildSGD", "HogwildStrategy", "ParameterServer",
           "ParameterServerEngine", "ParameterServerOptimizer", "SetupMismatch", "assign_shards",
           "serve", "shard_of", "staleness_report"]
