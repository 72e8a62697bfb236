"""`LocalSGD`: the part of a step that trains replicas locally and averages their models.

During the warm-up each step is synchronous (the rest of the chain: the gradient exchange);
afterwards each replica applies its own gradients and, every `period` local steps, the models are
averaged (exactly, with an outer rule such as SlowMo or SMA, within hosts, or by ring gossip).
Its counters are variables of the owner optimizer, so checkpoints carry them and a resumed run
does not repeat the warm-up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from tfdist.arguments import check_bool, check_choice, check_int
from tfdist.averaging import outer as outer_rules
from tfdist.averaging.rounds import average, gossip
from tfdist.averaging.schedule import HierarchicalSchedule, PeriodicSchedule
from tfdist.comm.holes import Holes
from tfdist.optimizers.parts import Part, register

TOPOLOGIES = ("all", "ring")


@register("LocalSGD")
class LocalSGD(Part):
    """Periodic model averaging after a synchronous warm-up: post-local SGD, hierarchical,
    SlowMo, SMA and ring gossip as options of one part.

    Args:
        schedule: `PeriodicSchedule(period, warmup_steps)`, or `HierarchicalSchedule(intra,
            inter, warmup_steps, host_size)` to average within each host every `intra` steps
            and over every replica every `inter` steps.
        outer: An outer rule applied at each global round: `tfdist.averaging.SlowMo(momentum,
            learning_rate)`, `tfdist.averaging.SMA(alpha, momentum)`, an `OuterRule` of your
            own, or a config {"name": "slowmo", ...}. Defaults to None (plain averaging).
        topology: "all" (exact average over every replica) or "ring" (decentralized gossip:
            each replica averages with its two ring neighbours).
        average_optimizer_state: Also average the optimizer's slots (momentum, Adam moments) at
            each round. Defaults to False: optimizer state stays local to each replica.

    Example:
        ```python
        from tfdist.averaging import PeriodicSchedule, SlowMo

        opt = tfdist.DistributedOptimizer(
            keras.optimizers.SGD(0.05, momentum=0.9),
            tfdist.optimizers.LocalSGD(PeriodicSchedule(8, warmup_steps=200), outer=SlowMo(0.5)))
        model = build_model()
        opt.average_also(model.non_trainable_variables)   # BatchNorm statistics too
        ```
    """

    needs_replica_gradients = True

    def __init__(self, schedule: PeriodicSchedule | HierarchicalSchedule,
                 outer: outer_rules.OuterRule | dict | None = None, topology: str = "all",
                 average_optimizer_state: bool = False):
        if not isinstance(schedule, (PeriodicSchedule, HierarchicalSchedule)):
            raise ValueError("`local_sgd` must be a tfdist.averaging.PeriodicSchedule or "
                             f"HierarchicalSchedule. Received: local_sgd={schedule!r}")
        check_choice("topology", topology, TOPOLOGIES)
        outer = outer_rules.get(outer)
        if topology == "ring" and (outer is not None or isinstance(schedule, HierarchicalSchedule)):
            raise ValueError("Ring gossip averages with neighbours only: use topology='all' with "
                             "an outer rule (SlowMo, SMA) or a HierarchicalSchedule.")
        self.schedule, self.outer, self.topology = schedule, outer, topology
        self.levels = schedule if isinstance(schedule, HierarchicalSchedule) else None
        self.average_optimizer_state = check_bool("average_optimizer_state",
                                                  average_optimizer_state)
        self.also_averaged: list = []
        self.optimizer_state: Callable[[], list] = list  # set by the owner: its slot variables
        self._own: list = []

    def build(self, owner, var_list, engine) -> None:
        self._own = []

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
            self._anchors = [owner.add_variable_from_reference(v, "outer_anchor")
                             for v in var_list]
            self._buffers = [owner.add_variable_from_reference(v, "outer_momentum")
                             for v in var_list]
        self._own += self._anchors + self._buffers
        self.host_size = None
        if self.levels is not None:
            size = self.levels.host_size or engine.local_size
            if engine.world_size % size:
                raise ValueError(f"`host_size` must divide the number of replicas "
                                 f"({engine.world_size}). Received: host_size={size}")
            self.host_size = size
        self.built = True

    def variables(self) -> list:
        return list(self._own)

    def per_replica_variables(self) -> list:
        return []  # the models are; counters, anchors and buffers are alike on every replica

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
        period = check_int("period", period, 1)
        if self.levels is not None and period % self.levels.intra_period:
            raise ValueError(f"The global averaging period must be a multiple of intra_period "
                             f"({self.levels.intra_period}). Received: period={period}")
        if not self.built:
            raise ValueError("The averaging period can change only once the optimizer is built.")
        self._period.assign(period)

    def loss_factor(self, world_size: int) -> tf.Tensor:
        """This step's factor on the loss: 1 while synchronous, `world_size` on local steps
        (each replica's whole gradient, not its share of the mean); `Chain.loss_factor`."""
        synchronous = self.schedule.is_synchronous(tf.convert_to_tensor(self._steps))
        return tf.where(synchronous, 1.0, float(world_size))

    # -- the step ------------------------------------------------------------------------------
    def step(self, ctx, grads, next) -> None:
        comm = ctx.comm
        step = tf.convert_to_tensor(self._steps)
        holes = Holes(grads)
        full = holes.refill
        # Gradients come divided by the number of replicas (see parts.py); a local step undoes
        # it, unless the loss was scaled for it (`loss_factor`).
        local_scale = 1 if ctx.loss_prescaled else comm.world_size

        def local(*values):
            first_local = tf.equal(step, self.schedule.warmup_steps)
            for anchor, var in zip(self._anchors, ctx.variables):  # the synced model
                anchor.assign(tf.where(first_local, tf.convert_to_tensor(var), anchor))
            (ctx.apply_local or ctx.apply)(full([g * tf.cast(local_scale, g.dtype)
                                                 if local_scale != 1 else g for g in values]))
            since = self._since + 1
            self._since.assign(since)
            averaged = list(ctx.variables) + self.also_averaged + (
                self.optimizer_state() if self.average_optimizer_state else [])

            def average_all():
                if self.topology == "ring":
                    gossip(comm, averaged)
                else:
                    average(comm, averaged, self.outer, self._anchors, self._buffers,
                            first=tf.equal(self._global_rounds, 0))
                ctx.traffic.add_round()
                self._global_rounds.assign_add(1)
                self._since.assign(0)

            def average_host():
                average(comm, averaged, group_size=self.host_size)
                ctx.traffic.add_round()
                self._host_rounds.assign_add(1)

            # == schedule.is_averaging(step) while the period is left unchanged.
            if self.levels is None:
                comm.cond(since >= self._period, average_all, lambda: None)
                return
            intra = self.levels.intra_period
            comm.cond(since >= self._period, average_all,
                      lambda: comm.cond(tf.equal(since % intra, 0), average_host, lambda: None))

        comm.cond(self.schedule.is_synchronous(step),
                  lambda *values: next(ctx, full(values)), local, args=holes.values)
        self._steps.assign_add(1)

    def get_config(self) -> dict[str, Any]:
        kind = "periodic" if self.levels is None else "hierarchical"
        return {"schedule": {kind: dataclasses.asdict(self.schedule)},
                "outer": outer_rules.serialize(self.outer), "topology": self.topology,
                "average_optimizer_state": self.average_optimizer_state}

    @classmethod
    def from_config(cls, config: dict) -> LocalSGD:
        config = dict(config)
        config["schedule"] = schedule_from_config(config["schedule"])
        return cls(**config)

    def __repr__(self) -> str:
        return f"LocalSGD({self.schedule!r}, outer={self.outer!r}, topology={self.topology!r})"


def schedule_from_config(config: dict) -> PeriodicSchedule | HierarchicalSchedule:
    try:
        if "hierarchical" in config:
            return HierarchicalSchedule(**config["hierarchical"])
        return PeriodicSchedule(**config.get("periodic", config))
    except (TypeError, AttributeError):
        raise ValueError("`local_sgd` must be a schedule, or its config {'periodic': {'period': "
                         f"...}}. Received: local_sgd={config!r:.80}") from None
