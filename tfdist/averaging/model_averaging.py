"""`ModelAveraging`: the local-SGD family as a component an optimizer carries.

The engine-agnostic core that `DistributedOptimizer(local_sgd=...)` and `LocalSGDStrategy` share:
during the warm-up each step is synchronous (the caller's all-reduce path); afterwards each
replica applies its own gradients and, every `period` local steps, the models are averaged
through the `GradientExchange` (which counts the bytes). Its counters are variables of the owner
optimizer, so checkpoints carry them and a resumed run does not repeat the warm-up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from tfdist.averaging.schedule import SMA, HierarchicalSchedule, PeriodicSchedule, SlowMo
from tfdist.comm.control import Holes, replica_cond

TOPOLOGIES = ("all", "ring")


def optimizer_slots(optimizer, exclude=()) -> list:
    """The optimizer's per-variable state (momentum, Adam moments): its floating-point
    variables other than the learning rate and the variables in `exclude`."""
    skip = {id(getattr(v, "value", v)) for v in exclude}
    return [v for v in optimizer.variables
            if v.dtype in ("float16", "bfloat16", "float32", "float64")
            and v.name != "learning_rate" and id(getattr(v, "value", v)) not in skip]


class ModelAveraging:
    """Periodic model averaging after a synchronous warm-up: post-local SGD, hierarchical,
    SlowMo, SMA and ring gossip as options of one component.

    Args:
        schedule: `PeriodicSchedule(period, warmup_steps)`, or `HierarchicalSchedule(intra,
            inter, warmup_steps, host_size)` to average within each host every `intra` steps
            and over every replica every `inter` steps.
        slowmo: Optional `SlowMo(momentum, learning_rate)` applied at each (global) round.
        sma: Optional `SMA(alpha, momentum)`: replicas pulled toward a central model instead of
            replaced by the average. At most one of `slowmo` and `sma`.
        topology: "all" (exact average over every replica) or "ring" (decentralized gossip:
            each replica averages with its two ring neighbours; with period 1 and no gradient,
            the replicas converge to their mean).
        average_optimizer_state: Also average the optimizer's slots (momentum, Adam moments) at
            each round. Defaults to False: optimizer state stays local to each replica.
    """

    def __init__(self, schedule: PeriodicSchedule | HierarchicalSchedule,
                 slowmo: SlowMo | None = None, topology: str = "all", sma: SMA | None = None,
                 average_optimizer_state: bool = False):
        if not isinstance(schedule, (PeriodicSchedule, HierarchicalSchedule)):
            raise ValueError("`local_sgd` must be a tfdist.averaging.PeriodicSchedule or "
                             f"HierarchicalSchedule. Received: local_sgd={schedule!r}")
        if slowmo is not None and not isinstance(slowmo, SlowMo):
            raise ValueError(f"`slowmo` must be a tfdist.averaging.SlowMo. Received: {slowmo!r}")
        if sma is not None and not isinstance(sma, SMA):
            raise ValueError(f"`sma` must be a tfdist.averaging.SMA. Received: {sma!r}")
        if slowmo is not None and sma is not None:
            raise ValueError("Use either `slowmo` or `sma`, not both.")
        if topology not in TOPOLOGIES:
            raise ValueError(f"`topology` must be one of {TOPOLOGIES}. Received: {topology!r}")
        if topology == "ring" and (slowmo is not None or sma is not None
                                   or isinstance(schedule, HierarchicalSchedule)):
            raise ValueError("Ring gossip averages with neighbours only: use topology='all' with "
                             "`slowmo`, `sma` or a HierarchicalSchedule.")
        self.schedule, self.slowmo, self.sma, self.topology = schedule, slowmo, sma, topology
        self.outer = slowmo or sma
        self.levels = schedule if isinstance(schedule, HierarchicalSchedule) else None
        self.average_optimizer_state = bool(average_optimizer_state)
        self.also_averaged: list = []
        self.optimizer_state: Callable[[], list] = list  # set by the owner: its slot variables
        self.built = False

    def build(self, owner, var_list) -> None:
        self._own: list = []

        def counter(name, value=0):
            var = owner.add_variable(shape=(), dtype="int64", aggregation="none", name=name,
                                     initializer=lambda shape, dtype: tf.constant(value, tf.int64))
            self._own.append(var)
            return var

        self._steps = counter("local_sgd_steps")
        self._period = counter("averaging_period", self.schedule.period)
        self._since = counter("steps_since_averaging")
        self._global_rounds = counter("averaging_rounds")
        self._host_rounds = counter("host_averaging_rounds")
        self._anchors, self._buffers = [], []
        if self.outer is not None:
            kind = "slowmo" if self.slowmo is not None else "sma"
            self._anchors = [owner.add_variable_from_reference(v, f"{kind}_anchor")
                             for v in var_list]
            self._buffers = [owner.add_variable_from_reference(v, f"{kind}_momentum")
                             for v in var_list]
        self._own += self._anchors + self._buffers
        self.built = True

    def own_variables(self) -> list:
        """The variables this component created on its owner (counters, anchors, buffers)."""
        return list(self._own) if self.built else []

    @property
    def period(self) -> int:
        return int(self._period.numpy()) if self.built else self.schedule.period

    @property
    def steps(self) -> int:
        return int(self._steps.numpy()) if self.built else 0

    @property
    def rounds(self) -> tuple[int, int]:
        """(global averaging rounds, intra-host rounds) since training started."""
        if not self.built:
            return 0, 0
        return int(self._global_rounds.numpy()), int(self._host_rounds.numpy())

    def set_period(self, period: int) -> None:
        if isinstance(period, bool) or not isinstance(period, (int, np.integer)) or period < 1:
            raise ValueError(f"`period` must be an integer >= 1. Received: period={period!r}")
        if self.levels is not None and period % self.levels.intra_period:
            raise ValueError(f"The global averaging period must be a multiple of intra_period "
                             f"({self.levels.intra_period}). Received: period={period}")
        if not self.built:
            raise ValueError("The averaging period can change only once the optimizer is built.")
        self._period.assign(int(period))

    def _host_size(self, levels: HierarchicalSchedule, comm) -> int:
        size = levels.host_size or comm.local_size
        if comm.world_size % size:
            raise ValueError(f"`host_size` must divide the number of replicas "
                             f"({comm.world_size}). Received: host_size={size}")
        return size

    def step(self, exchange, comm, grads: list, variables: list,
             synchronous: Callable[[list], None], apply_local: Callable[[list], None],
             local_scale: float = 1.0) -> None:
        """One optimizer step. `synchronous(grads)` all-reduces and applies (warm-up);
        `apply_local(grads)` applies this replica's own gradients, pre-multiplied by
        `local_scale` (the number of replicas when the loss was divided by it)."""
        step = tf.convert_to_tensor(self._steps)
        holes = Holes(grads)
        full = holes.refill
        levels = self.levels
        host_size = self._host_size(levels, comm) if levels is not None else None

        def local(*values):
            first_local = tf.equal(step, self.schedule.warmup_steps)
            for anchor, var in zip(self._anchors, variables):  # the synced model
                anchor.assign(tf.where(first_local, tf.convert_to_tensor(var), anchor))
            apply_local(full([g * tf.cast(local_scale, g.dtype) for g in values]))
            since = self._since + 1
            self._since.assign(since)
            averaged = variables + self.also_averaged + (
                self.optimizer_state() if self.average_optimizer_state else [])

            def average():
                if self.topology == "ring":
                    exchange.gossip(comm, averaged)
                else:
                    exchange.average(comm, averaged, self.outer, self._anchors, self._buffers,
                                     first=tf.equal(self._global_rounds, 0))
                self._global_rounds.assign_add(1)
                self._since.assign(0)

            def average_host():
                exchange.average(comm, averaged, group_size=host_size)
                self._host_rounds.assign_add(1)

            # == schedule.is_averaging(step) while the period is left unchanged.
            if levels is None:
                replica_cond(since >= self._period, average, lambda: None)
                return
            intra = levels.intra_period
            replica_cond(since >= self._period, average,
                         lambda: replica_cond(tf.equal(since % intra, 0), average_host,
                                              lambda: None))

        replica_cond(self.schedule.is_synchronous(step),
                     lambda *values: synchronous(full(values)), local,
                     args=holes.values)
        self._steps.assign_add(1)

    def get_config(self) -> dict:
        schedule = dataclasses.asdict(self.schedule)
        return {"local_sgd": {"periodic" if self.levels is None else "hierarchical": schedule},
                "averaging_topology": self.topology,
                "slowmo": None if self.slowmo is None else dataclasses.asdict(self.slowmo),
                "sma": None if self.sma is None else dataclasses.asdict(self.sma),
                "average_optimizer_state": self.average_optimizer_state}

    @staticmethod
    def from_config(config: dict) -> dict:
        """Inverse of `get_config`: the constructor arguments, as objects."""
        out = dict(config)
        schedule = out.get("local_sgd")
        if schedule is not None:
            if "hierarchical" in schedule:
                out["local_sgd"] = HierarchicalSchedule(**schedule["hierarchical"])
            else:  # also configs saved before hierarchical schedules existed
                out["local_sgd"] = PeriodicSchedule(**schedule.get("periodic", schedule))
        for key, cls in (("slowmo", SlowMo), ("sma", SMA)):
            if out.get(key) is not None:
                out[key] = cls(**out[key])
        return out
