"""Changes local SGD's averaging period H during `fit`.

Rules:
* a fixed schedule: `{epoch: H}` (from that epoch on) or a function epoch -> H;
* "adacomm" (Wang & Joshi, "Adaptive Communication Strategies ...", MLSys 2019): start with a long
  period and shorten it as the loss falls, H_e = ceil(sqrt(loss_e / loss_0) * H_0);
* "progress": lengthen H (x2, up to `max_period`) after every epoch whose loss fell by at least
  `min_delta` (relative), shorten it (/2, down to `min_period`) when the loss stops falling, so
  workers communicate less while training progresses on its own.
Rank 0 decides and broadcasts, so every worker averages at the same steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import keras
import tensorflow as tf

from tfdist.comm import resolve
from tfdist.optimizers import LocalSGD, chain_of

RULES = (None, "adacomm", "progress")


def adacomm_period(initial_period: int, initial_loss: float, loss: float) -> int:
    """AdaComm's rule: ceil(sqrt(loss / initial_loss) * initial_period), at least 1.

    Example:
        ```python
        # the loss fell to a quarter: average twice as often
        assert tfdist.callbacks.adacomm_period(16, initial_loss=2.0, loss=0.5) == 8
        ```
    """
    return max(1, math.ceil(math.sqrt(max(loss, 0.0) / initial_loss) * initial_period))


class AveragingPeriodSchedule(keras.callbacks.Callback):
    """Sets local SGD's averaging period each epoch (`DistributedOptimizer(local_sgd=...)` or
    `tfdist.LocalSGDStrategy`).

    Args:
        schedule: `{epoch: period}` or a function epoch -> period; None to use `rule`.
        rule: None, "adacomm" or "progress" (see module docstring).
        min_period, max_period: Bounds for the rules. Defaults to 1 and 64.
        min_delta: Relative loss decrease that counts as progress. Defaults to 0.01.

    Example:
        ```python
        strategy = tfdist.LocalSGDStrategy(period=8, devices=tfdist.devices.local_devices(2))
        with strategy.scope():
            model = build_model()
            model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        schedule = tfdist.callbacks.AveragingPeriodSchedule({0: 8, 2: 4})  # epoch -> period
        model.fit(x, y, batch_size=64, epochs=3, callbacks=[schedule])
        ```
    """

    def __init__(self, schedule: dict[int, int] | Callable[[int], int] | None = None,
                 rule: str | None = None, min_period: int = 1, max_period: int = 64,
                 min_delta: float = 0.01):
        super().__init__()
        if (schedule is None) == (rule is None):
            raise ValueError("Give exactly one of `schedule` and `rule`. "
                             f"Received: schedule={schedule!r}, rule={rule!r}")
        if rule not in RULES:
            raise ValueError(f"`rule` must be one of {RULES}. Received: rule={rule!r}")
        if not 1 <= min_period <= max_period:
            raise ValueError("Need 1 <= min_period <= max_period. Received: "
                             f"min_period={min_period}, max_period={max_period}")
        if isinstance(schedule, dict):
            bad = {e: p for e, p in schedule.items()
                   if not (isinstance(p, int) and p >= 1 and isinstance(e, int) and e >= 0)}
            if bad:
                raise ValueError(f"`schedule` maps epochs >= 0 to periods >= 1. Received: {bad}")
        self.schedule, self.rule = schedule, rule
        self.min_period, self.max_period, self.min_delta = min_period, max_period, min_delta
        self.periods: list[int] = []

    def on_train_begin(self, logs=None):
        chain = chain_of(self.model.optimizer)
        self._local_sgd = None if chain is None else chain.part(LocalSGD)
        if self._local_sgd is None:
            raise ValueError("AveragingPeriodSchedule needs local SGD: tfdist.DistributedOptimizer("
                             "..., local_sgd=PeriodicSchedule(...)) or tfdist.LocalSGDStrategy.")
        self._engine = resolve(self.model.distribute_strategy)
        self._initial_period = self._local_sgd.period
        self._initial_loss = self._last_loss = None

    def _set(self, period: int) -> None:
        period = int(min(max(period, self.min_period), self.max_period)) if self.rule else period
        levels = self._local_sgd.levels
        if self.rule and levels is not None:  # hierarchical: a multiple of the intra-host period
            intra = levels.intra_period
            period = max(intra, round(period / intra) * intra)
        shared = self._engine.run(
            lambda comm: comm.broadcast([tf.constant([float(period)])], root=0))
        period = int(round(float(tf.reshape(shared[0], [-1])[0])))
        self._local_sgd.set_period(period)

    def on_epoch_begin(self, epoch, logs=None):
        if self.schedule is None:
            return
        if callable(self.schedule):
            self._set(int(self.schedule(epoch)))
        else:
            started = [e for e in self.schedule if e <= epoch]
            if started:
                self._set(self.schedule[max(started)])

    def on_epoch_end(self, epoch, logs=None):
        period = self._local_sgd.period
        loss = None if logs is None else logs.get("loss")
        if self.rule is not None and loss is not None:
            loss = float(loss)
            if self._initial_loss is None:
                self._initial_loss = loss
            if self.rule == "adacomm":
                period = adacomm_period(self._initial_period, self._initial_loss, loss)
            elif self._last_loss is not None:
                fell = loss <= self._last_loss * (1.0 - self.min_delta)
                period = period * 2 if fell else max(1, period // 2)
            self._last_loss = loss
            self._set(period)
            period = self._local_sgd.period
        self.periods.append(period)
        if logs is not None:
            logs["averaging_period"] = float(period)
