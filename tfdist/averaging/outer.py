"""Outer rules: what a global model-averaging round does with the replicas' mean.

Plain averaging replaces every replica's model by the mean. An outer rule takes the mean and
returns each replica's new model, with two tensors of state per variable that every replica
keeps alike (`anchor`, `buffer`):

    new, anchor, buffer = rule.update(own, mean, anchor, buffer, world_size, first)

`first` is True at the first round (the anchor then holds the model synchronized at the end of
the warm-up). `SlowMo` and `SMA` are the two built in; a rule of your own is a subclass of
`OuterRule`: decorate it with `@tfdist.averaging.register("name")`, or name it in a config
by its import path (`averaging.outer: {name: "my_rules:Mine", ...options}`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from tfdist.arguments import check_number
from tfdist.registry import Registry


class OuterRule:
    """Base class of outer rules (see the module docstring).

    Example:
        ```python
        class Halfway(tfdist.averaging.OuterRule):
            # each replica moves half way to the round's mean

            def update(self, own, mean, anchor, buffer, world_size, first):
                return own + 0.5 * (mean - own), anchor, buffer


        local_sgd = tfdist.optimizers.LocalSGD(tfdist.averaging.PeriodicSchedule(8), outer=Halfway())
        ```
    """

    registry_name: str = ""  # set by @register

    def update(self, own, mean, anchor, buffer, world_size: int, first):
        """(this replica's new value, new anchor, new buffer) from the round's mean."""
        raise NotImplementedError

    def get_config(self) -> dict[str, Any]:
        return dataclasses.asdict(self) if dataclasses.is_dataclass(self) else {}


OUTER_RULES = Registry("outer rule", OuterRule)


def register(name: str):
    """Class decorator: makes an outer rule known to configs under `name` (`tfdist.registry`;
    a rule can also be named by its import path, `module.path:Class`).

    Example:
        ```python
        @tfdist.averaging.register("halfway")
        class Halfway(tfdist.averaging.OuterRule):
            def update(self, own, mean, anchor, buffer, world_size, first):
                return own + 0.5 * (mean - own), anchor, buffer


        local_sgd = tfdist.optimizers.LocalSGD(tfdist.averaging.PeriodicSchedule(8),
                                               outer={"name": "halfway"})
        ```
    """
    return OUTER_RULES.register(name)


@register("slowmo")
@dataclass(frozen=True)
class SlowMo(OuterRule):
    """Slow momentum on the averaged model (Wang et al., "SlowMo", ICLR 2020).

    At each averaging round, with x0 the model after the previous round and x̄ the new average:
    v <- momentum * v + (x0 - x̄);  x0 <- x0 - learning_rate * v;  every replica takes x0.
    (The paper's base-learning-rate factors cancel for a constant inner learning rate.)
    momentum=0 and learning_rate=1 is plain model averaging.

    Args:
        momentum: Outer momentum beta in [0, 1). Defaults to 0.5.
        learning_rate: Outer learning rate alpha > 0. Defaults to 1.0.

    Example:
        ```python
        local_sgd = tfdist.optimizers.LocalSGD(tfdist.averaging.PeriodicSchedule(8),
                                               outer=tfdist.averaging.SlowMo(momentum=0.5))
        optimizer = tfdist.DistributedOptimizer(keras.optimizers.SGD(0.1), local_sgd)
        ```
    """

    momentum: float = 0.5
    learning_rate: float = 1.0

    def __post_init__(self):
        check_number("momentum", self.momentum, 0, 1, high_open=True)
        check_number("learning_rate", self.learning_rate, 0, low_open=True)

    def update(self, own, mean, anchor, buffer, world_size, first):
        """(this replica's new value, new anchor, new buffer) from the round's mean."""
        v = self.momentum * buffer + (anchor - mean)
        x0 = anchor - self.learning_rate * v
        return x0, x0, v


@register("sma")
@dataclass(frozen=True)
class SMA(OuterRule):
    """Synchronous model averaging (Crossbow; Koliousis et al., VLDB 2019).

    Replicas are pulled toward a central model z instead of replaced by the average. At each
    averaging round, with w_j replica j's model after its local step and N replicas:
    c_j = alpha (w_j - z);  w_j <- w_j - c_j;  z <- z + sum_j c_j + momentum (z - z_previous).
    sum_j c_j = alpha N (mean_j w_j - z), so a round costs one all-reduce, like plain averaging.
    z starts as the replicas' mean at the first round; every replica keeps the same z.

    Args:
        alpha: Pull strength in (0, 1]; Crossbow uses 1 / N. Defaults to 0.1.
        momentum: Momentum of the central model in [0, 1). Defaults to 0.9.

    Example:
        ```python
        local_sgd = tfdist.optimizers.LocalSGD(tfdist.averaging.PeriodicSchedule(1),
                                               outer=tfdist.averaging.SMA(alpha=0.1, momentum=0.9))
        optimizer = tfdist.DistributedOptimizer(keras.optimizers.SGD(0.1), local_sgd)
        ```
    """

    alpha: float = 0.1
    momentum: float = 0.9

    def __post_init__(self):
        check_number("alpha", self.alpha, 0, 1, low_open=True)
        check_number("momentum", self.momentum, 0, 1, high_open=True)

    def update(self, own, mean, anchor, buffer, world_size, first):
        z = tf.where(first, mean, anchor)
        z_new = z + self.alpha * world_size * (mean - z) + self.momentum * buffer
        return own - self.alpha * (own - z), z_new, z_new - z


def get(spec) -> OuterRule | None:
    """An outer rule from an instance, None, or a config {"name": ..., **options} (a registered
    name or `module.path:Class`)."""
    if spec is None or isinstance(spec, OuterRule):
        return spec
    name = spec.get("name") if isinstance(spec, dict) else None
    if not isinstance(name, str):
        raise ValueError(f"`outer` must be an OuterRule (e.g. tfdist.averaging.SlowMo()), None, "
                         f"or {{'name': one of {sorted(OUTER_RULES)} or 'module.path:Class', "
                         f"...options}}. Received: {spec!r:.80}")
    cls = OUTER_RULES.lookup(name)
    options = {k: v for k, v in spec.items() if k != "name"}
    try:
        return cls(**options)
    except TypeError as e:
        raise ValueError(f"Bad options for outer rule {name!r}: {e}") from None


def serialize(rule: OuterRule | None) -> dict[str, Any] | None:
    if rule is None:
        return None
    name = OUTER_RULES.name_for(type(rule))
    if name is None:
        raise ValueError(f"Outer rule {type(rule).__name__} is defined inside a function or a "
                         "class: define it at a module's top level, or decorate it with "
                         "@tfdist.averaging.register(name), to save it in a model's config.")
    return {"name": name, **rule.get_config()}
