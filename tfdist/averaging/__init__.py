"""The local-SGD family: schedules (pure functions of the step) and model averaging.

    opt = tfdist.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                      local_sgd=tfdist.averaging.PeriodicSchedule(8, warmup_steps=200))
    model.compile(optimizer=opt, ...)
    opt.average_also(model.non_trainable_variables)   # BatchNorm statistics
"""

from tfdist.averaging.model_averaging import ModelAveraging, optimizer_slots
from tfdist.averaging.schedule import SMA, HierarchicalSchedule, PeriodicSchedule, SlowMo

__all__ = ["HierarchicalSchedule", "ModelAveraging", "PeriodicSchedule", "SMA", "SlowMo", "optimizer_slots"]
