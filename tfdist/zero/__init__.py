"""Sharded optimizer state (ZeRO stages 1 and 2) and parameters (stage 3).

    model.compile(optimizer=tfdist.ZeroOptimizer(keras.optimizers.Adam(1e-3), stage=1), ...)

    model = tfdist.zero.ShardedModel(build_model())          # stage 3, under the strategy
    model.compile(optimizer=keras.optimizers.Adam(1e-3), ...)  # trained by ZeroOptimizer(stage=3)
"""

from tfdist.zero.memory import memory_report
from tfdist.zero.offload import Offload
from tfdist.zero.optimizer import ELEMENTWISE, ZeroOptimizer
from tfdist.zero.plan import LayerShardPlan, ShardPlan
from tfdist.zero.sharded import ShardedModel

__all__ = ["ELEMENTWISE", "LayerShardPlan", "Offload", "ShardPlan", "ShardedModel", "ZeroOptimizer",
           "memory_report"]
