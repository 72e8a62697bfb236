"""When to average: schedules as pure functions of the optimizer step (tensor-friendly).

Post-local SGD (Lin et al., ICLR 2020): for the first `warmup_steps` steps gradients are
all-reduced every step (synchronous SGD); afterwards replicas step locally and average their models
every `period` steps. Hierarchical averaging (as in PyTorch's HierarchicalModelAverager): every
`intra_period` steps within a host, every `inter_period` steps across hosts.
"""

from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf

from tfdist.arguments import check_int


@dataclass(frozen=True)
class PeriodicSchedule:
    """Synchronous for `warmup_steps` steps, then average every `period` local steps.

    Args:
        period: Local steps between averaging rounds (H >= 1; 1 is synchronous training).
        warmup_steps: Synchronous steps first (W >= 0). The warm-up is set here only.

    Example:
        ```python
        schedule = tfdist.averaging.PeriodicSchedule(4, warmup_steps=2)
        print([bool(schedule.is_averaging(step)) for step in range(10)])  # rounds at steps 5 and 9
        optimizer = tfdist.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                tfdist.optimizers.LocalSGD(schedule))
        ```
    """

    period: int
    warmup_steps: int = 0

    def __post_init__(self):
        check_int("period", self.period, 1)
        check_int("warmup_steps", self.warmup_steps, 0)

    def is_synchronous(self, step):
        """Step `step` (0-based) all-reduces gradients instead of stepping locally."""
        return step < self.warmup_steps

    def is_averaging(self, step):
        """Step `step` ends with a model-averaging round (after its local update)."""
        local = step - self.warmup_steps
        return tf.logical_and(local >= 0, tf.equal((local + 1) % self.period, 0)) \
            if isinstance(step, tf.Tensor) else local >= 0 and (local + 1) % self.period == 0

    def rounds(self, steps: int) -> int:
        """Communication rounds in the first `steps` steps (warm-up steps count one each)."""
        sync = min(steps, self.warmup_steps)
        return sync + max(0, steps - self.warmup_steps) // self.period


@dataclass(frozen=True)
class HierarchicalSchedule:
    """Average within a host every `intra_period` steps and across hosts every `inter_period`.

    A host is a group of `host_size` consecutive replicas (ranks): by default each worker's
    devices (tf.distribute) or each host's local ranks (Horovod). Intra-host rounds are
    reductions within the group only; global rounds are all-reduces over every replica.

    Args:
        intra_period: Local steps between intra-host rounds (>= 1).
        inter_period: Local steps between global rounds; a multiple of `intra_period`.
        warmup_steps: Synchronous steps first.
        host_size: Replicas per host, a divisor of the number of replicas; None for the
            engine's own notion of a host (see above).

    Example:
        ```python
        # within each host of 2 replicas every 2 steps, across hosts every 8
        schedule = tfdist.averaging.HierarchicalSchedule(2, 8, host_size=2)
        optimizer = tfdist.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                tfdist.optimizers.LocalSGD(schedule))
        ```
    """

    intra_period: int
    inter_period: int
    warmup_steps: int = 0
    host_size: int | None = None

    def __post_init__(self):
        check_int("intra_period", self.intra_period, 1)
        check_int("inter_period", self.inter_period, 1)
        check_int("warmup_steps", self.warmup_steps, 0)
        if self.host_size is not None:
            check_int("host_size", self.host_size, 1)
        if self.inter_period % self.intra_period:
            raise ValueError(
                f"`inter_period` must be a multiple of `intra_period` ({self.intra_period}). "
                f"Received: inter_period={self.inter_period}")

    @property
    def period(self) -> int:
        """Local steps between global rounds (what `set_averaging_period` changes)."""
        return self.inter_period

    def is_synchronous(self, step):
        return step < self.warmup_steps

    def rounds(self, steps: int) -> tuple[int, int]:
        """(global rounds incl. synchronous steps, intra-host-only rounds) in `steps` steps."""
        local = max(0, steps - self.warmup_steps)
        inter = local // self.inter_period
        return min(steps, self.warmup_steps) + inter, local // self.intra_period - inter

    def levels(self) -> tuple[PeriodicSchedule, PeriodicSchedule]:
        """(intra-host schedule, global schedule)."""
        return (PeriodicSchedule(self.intra_period, self.warmup_steps),
                PeriodicSchedule(self.inter_period, self.warmup_steps))
