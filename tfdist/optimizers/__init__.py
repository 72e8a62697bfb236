"""Keras 3 optimizer wrappers assembled from parts (see `tfdist.optimizers.parts`).

* `DistributedOptimizer(inner, *parts, ...)`: the wrapper, on any engine; the parts run in the
  order given (or the keyword shortcuts build them: `parts_from_shortcuts`);
* the parts: `GradientExchange` (dense or compressed), `AutoExchange` (picked from the measured
  link), `Accumulation`, `LocalSGD`,
  `TrackNorms`, `DynamicLossScaling` (from `loss_scale`), `NanPolicy` (from `nan_policy`),
  `SumOverRanks` (Horovod's `op=Sum`);
* `Chain` and `chain_of(optimizer)`: the parts and counters behind any tfdist optimizer (also a
  Keras optimizer a tfdist strategy attached to);
* `register(name)`: names a part of your own in saved optimizers (`PARTS`; unregistered, a part
  saves under its import path).
"""

from tfdist.optimizers.accumulation import Accumulation
from tfdist.optimizers.auto import AutoExchange, Candidate
from tfdist.optimizers.chain import Chain, chain_of
from tfdist.optimizers.distributed import SHORTCUTS, DistributedOptimizer, parts_from_shortcuts
from tfdist.optimizers.exchange import GradientExchange
from tfdist.optimizers.local_sgd import LocalSGD
from tfdist.optimizers.loss_scaling import DynamicLossScaling
from tfdist.optimizers.nan_policy import NanPolicy
from tfdist.optimizers.norms import TrackNorms
from tfdist.optimizers.parts import PARTS, Part, StepContext, Traffic, register
from tfdist.optimizers.sum import SumOverRanks

__all__ = ["PARTS", "SHORTCUTS", "Accumulation", "AutoExchange", "Candidate", "Chain",
           "DistributedOptimizer", "DynamicLossScaling", "GradientExchange", "LocalSGD", "NanPolicy",
           "Part", "StepContext", "SumOverRanks", "TrackNorms", "Traffic", "chain_of",
           "parts_from_shortcuts", "register"]
