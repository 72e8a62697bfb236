"""When to average: schedules as pure functions of the optimizer step (tensor-friendly).

Post-local SGD (Lin et al., ICLR 2020): for the first `warmup_steps` steps gradients are
all-reduced every step (synchronous SGD); afterwards replicas step locally and average their models
every `period` steps. Hierarchical averaging (as in PyTorch's HierarchicalModelAverager): every
`intra_period` steps within a host, every `inter_period` steps across hosts.
"""

from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}. Received: {name}={value!r}")
    return value


@dataclass(frozen=True)
class PeriodicSchedule:
    """Synchronous for `warmup_steps` steps, then average every `period` local steps.

    Args:
        period: Local steps between averaging rounds (H >= 1; 1 is synchronous training).
        warmup_steps: Synchronous steps first (W >= 0). The warm-up is set here only.
    """

    period: int
    warmup_steps: int = 0

    def __post_init__(self):
        _check_int("period", self.period, 1)
        _check_int("warmup_steps", self.warmup_steps, 0)

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
    """

    intra_period: int
    inter_period: int
    warmup_steps: int = 0
    host_size: int | None = None

    def __post_init__(self):
        _check_int("intra_period", self.intra_period, 1)
        _check_int("inter_period", self.inter_period, 1)
        _check_int("warmup_steps", self.warmup_steps, 0)
        if self.host_size is not None:
            _check_int("host_size", self.host_size, 1)
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


@dataclass(frozen=True)
class SlowMo:
    """Slow momentum on the averaged model (Wang et al., "SlowMo", ICLR 2020).

    At each averaging round, with x0 the model after the previous round and x̄ the new average:
    v <- momentum * v + (x0 - x̄);  x0 <- x0 - learning_rate * v;  every replica takes x0.
    (The paper's base-learning-rate factors cancel for a constant inner learning rate.)
    momentum=0 and learning_rate=1 is plain model averaging.

    Args:
        momentum: Outer momentum beta in [0, 1). Defaults to 0.5.
        learning_rate: Outer learning rate alpha > 0. Defaults to 1.0.
    """

    momentum: float = 0.5
    learning_rate: float = 1.0

    def __post_init__(self):
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"`momentum` must be in [0, 1). Received: momentum={self.momentum!r}")
        if not self.learning_rate > 0:
            raise ValueError(
                f"`learning_rate` must be > 0. Received: learning_rate={self.learning_rate!r}")

    def update(self, own, mean, anchor, buffer, world_size, first):
        """(this replica's new value, new anchor, new buffer) from the round's mean."""
        v = self.momentum * buffer + (anchor - mean)
        x0 = anchor - self.learning_rate * v
        return x0, x0, v


@dataclass(frozen=True)
class SMA:
    """Synchronous model averaging (Crossbow; Koliousis et al., VLDB 2019).

    Replicas are pulled toward a central model z instead of replaced by the average. At each
    averaging round, with w_j replica j's model after its local step and N replicas:
    c_j = alpha (w_j - z);  w_j <- w_j - c_j;  z <- z + sum_j c_j + momentum (z - z_previous).
    sum_j c_j = alpha N (mean_j w_j - z), so a round costs one all-reduce, like plain averaging.
    z starts as the replicas' mean at the first round; every replica keeps the same z.

    Args:
        alpha: Pull strength in (0, 1]; Crossbow uses 1 / N. Defaults to 0.1.
        momentum: Momentum of the central model in [0, 1). Defaults to 0.9.
    """

    alpha: float = 0.1
    momentum: float = 0.9

    def __post_init__(self):
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"`alpha` must be in (0, 1]. Received: alpha={self.alpha!r}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"`momentum` must be in [0, 1). Received: momentum={self.momentum!r}")

    def update(self, own, mean, anchor, buffer, world_size, first):
        z = tf.where(first, mean, anchor)
        z_new = z + self.alpha * world_size * (mean - z) + self.momentum * buffer
        return own - self.alpha * (own - z), z_new, z_new - z
