"""Sharded optimizer state (ZeRO stages 1 and 2).

    model.compile(optimizer=tfdist.ZeroOptimizer(keras.optimizers.Adam(1e-3), stage=1), ...)
"""

from tfdist.zero.memory import memory_report
from tfdist.zero.offload import Offload
from tfdist.zero.optimizer import ELEMENTWISE, ZeroOptimizer
from tfdist.zero.plan import ShardPlan

__all__ = ["ELEMENTWISE", "Offload", "ShardPlan", "ZeroOptimizer", "memory_report"]
