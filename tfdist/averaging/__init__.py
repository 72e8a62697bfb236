"""The local-SGD family as pure algorithms: when to average (schedules), what a round does with
the mean (outer rules: SlowMo, SMA, your own) and the rounds themselves (exact, grouped, gossip).

The Keras-facing part that runs them inside an optimizer step is `tfdist.optimizers.LocalSGD`:

    opt = tfdist.DistributedOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9),
        tfdist.optimizers.LocalSGD(tfdist.averaging.PeriodicSchedule(8, warmup_steps=200),
                                   outer=tfdist.averaging.SlowMo(0.5)))
"""

from tfdist.averaging.outer import OUTER_RULES, SMA, OuterRule, SlowMo, register
from tfdist.averaging.rounds import average, gossip, optimizer_slots
from tfdist.averaging.schedule import HierarchicalSchedule, PeriodicSchedule

__all__ = ["HierarchicalSchedule", "OUTER_RULES", "OuterRule", "PeriodicSchedule", "SMA", "SlowMo",
           "average", "gossip", "optimizer_slots", "register"]
