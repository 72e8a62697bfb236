"""`ModelAveraging`: post-local SGD (and SlowMo) as a component an optimizer carries.

The engine-agnostic core that `DistributedOptimizer(local_sgd=...)` and `LocalSGDStrategy` share:
during the warm-up each step is synchronous (the caller's all-reduce path); afterwards each
replica applies its own gradients and, every `period` local steps, the models are averaged
through the `GradientExchange` (which counts the bytes). Its counters are variables of the owner
optimizer, so checkpoints carry them and a resumed run does not repeat the warm-up.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tensorflow as tf

from tfdist.averaging.schedule import PeriodicSchedule, SlowMo
from tfdist.comm.control import Holes, replica_cond

TOPOLOGIES = ("all", "ring")


class ModelAveraging:
    """Periodic model averaging after a synchronous warm-up, optionally with SlowMo.

    Args:
        schedule: The `PeriodicSchedule(period, warmup_steps)`.
        slowmo: Optional `SlowMo(momentum, learning_rate)` applied at each averaging round.
        topology: "all" (exact average over every replica) or "ring" (decentralized gossip:
            each replica averages with its two ring neighbours; with period 1 and no gradient,
            the replicas converge to their mean).
    """

    def __init__(self, schedule: PeriodicSchedule, slowmo: SlowMo | None = None,
                 topology: str = "all"):
        if not isinstance(schedule, PeriodicSchedule):
            raise ValueError("`local_sgd` must be a tfdist.averaging.PeriodicSchedule. "
                             f"Received: local_sgd={schedule!r}")
        if slowmo is not None and not isinstance(slowmo, SlowMo):
            raise ValueError(f"`slowmo` must be a tfdist.averaging.SlowMo. Received: {slowmo!r}")
        if topology not in TOPOLOGIES:
            raise ValueError(f"`topology` must be one of {TOPOLOGIES}. Received: {topology!r}")
        if topology == "ring" and slowmo is not None:
            raise ValueError("SlowMo needs exact averaging: use topology='all' with `slowmo`.")
        self.schedule, self.slowmo, self.topology = schedule, slowmo, topology
        self.also_averaged: list = []
        self.built = False

    def build(self, owner, var_list) -> None:
        def counter(name, value=0):
            return owner.add_variable(shape=(), dtype="int64", aggregation="none", name=name,
                                      initializer=lambda shape, dtype: tf.constant(value, tf.int64))

        self._steps = counter("local_sgd_steps")
        self._period = counter("averaging_period", self.schedule.period)
        self._since = counter("steps_since_averaging")
        self._anchors, self._buffers = [], []
        if self.slowmo is not None:
            self._anchors = [owner.add_variable_from_reference(v, "slowmo_anchor") for v in var_list]
            self._buffers = [owner.add_variable_from_reference(v, "slowmo_momentum")
                             for v in var_list]
        self.built = True

    @property
    def period(self) -> int:
        return int(self._period.numpy()) if self.built else self.schedule.period

    @property
    def steps(self) -> int:
        return int(self._steps.numpy()) if self.built else 0

    def set_period(self, period: int) -> None:
        if isinstance(period, bool) or not isinstance(period, (int, np.integer)) or period < 1:
            raise ValueError(f"`period` must be an integer >= 1. Received: period={period!r}")
        if not self.built:
            raise ValueError("The averaging period can change only once the optimizer is built.")
        self._period.assign(int(period))

    def step(self, exchange, comm, grads: list, variables: list,
             synchronous: Callable[[list], None], apply_local: Callable[[list], None],
             local_scale: float = 1.0) -> None:
        """One optimizer step. `synchronous(grads)` all-reduces and applies (warm-up);
        `apply_local(grads)` applies this replica's own gradients, pre-multiplied by
        `local_scale` (the number of replicas when the loss was divided by it)."""
        step = tf.convert_to_tensor(self._steps)
        holes = Holes(grads)
        full = holes.refill

        def local(*values):
            first_local = tf.equal(step, self.schedule.warmup_steps)
            for anchor, var in zip(self._anchors, variables):  # the synced model
                anchor.assign(tf.where(first_local, tf.convert_to_tensor(var), anchor))
            apply_local(full([g * tf.cast(local_scale, g.dtype) for g in values]))
            since = self._since + 1
            self._since.assign(since)

            def average():
                if self.topology == "ring":
                    exchange.gossip(comm, variables + self.also_averaged)
                else:
                    exchange.average(comm, variables + self.also_averaged, self.slowmo,
                                     self._anchors, self._buffers)
                self._since.assign(0)

            # == schedule.is_averaging(step) while the period is left unchanged.
            replica_cond(since >= self._period, average, lambda: None)

        replica_cond(self.schedule.is_synchronous(step),
                     lambda *values: synchronous(full(values)), local,
                     args=holes.values)
        self._steps.assign_add(1)

    def get_config(self) -> dict:
        s = self.slowmo
        return {"local_sgd": {"period": self.schedule.period,
                              "warmup_steps": self.schedule.warmup_steps},
                "averaging_topology": self.topology,
                "slowmo": None if s is None else {"momentum": s.momentum,
                                                  "learning_rate": s.learning_rate}}
