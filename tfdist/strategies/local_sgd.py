"""Strategies that train with post-local SGD (and optionally SlowMo), the user's optimizer unchanged.

    strategy = tfdist.LocalSGDStrategy(period=8, warmup_steps=200)           # one host
    strategy = tfdist.MultiWorkerLocalSGDStrategy(period=8, warmup_steps=200) # TF_CONFIG workers
    with strategy.scope():
        model = build_model()
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=...)
    model.fit(...)

Every Keras optimizer built under the scope carries a `tfdist.optimizers.Chain` with a
`LocalSGD` part (the same parts as `DistributedOptimizer(local_sgd=...)`). The strategy records
the variables created in its scope, so the model's non-trainable float variables (BatchNorm
statistics) are averaged too, without being named. Optimizer state stays local unless
`average_optimizer_state=True`.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from tfdist._hooks.distribute import fresh_collective_keys
from tfdist._hooks.optimizer import install_strategy_hooks
from tfdist.averaging import SMA, HierarchicalSchedule, PeriodicSchedule, SlowMo, optimizer_slots
from tfdist.comm import DistributeEngine
from tfdist.optimizers import Chain, GradientExchange, LocalSGD
from tfdist.strategies.multi_worker import MultiWorkerMirroredStrategy


class _LocalSGD:
    """Mixin: the schedule, a scope that records variables, and the per-optimizer components."""

    def _init_local_sgd(self, period, warmup_steps, slowmo, topology, sma=None,
                        intra_period=None, host_size=None, average_optimizer_state=False):
        if host_size is not None and intra_period is None:
            raise ValueError("`host_size` is for hierarchical averaging: set `intra_period` too. "
                             f"Received: host_size={host_size!r}, intra_period=None")
        self.schedule = (PeriodicSchedule(period, warmup_steps) if intra_period is None  # validates
                         else HierarchicalSchedule(intra_period, period, warmup_steps, host_size))
        if slowmo is not None and sma is not None:
            raise ValueError("Use either `slowmo` or `sma`, not both.")
        self._averaging_args = (slowmo or sma, topology, average_optimizer_state)
        LocalSGD(self.schedule, *self._averaging_args)  # validates the options
        self._created: list = []
        install_strategy_hooks()

    @contextlib.contextmanager
    def scope(self):
        """The strategy's scope, also recording every variable created in it."""
        def record(next_creator, **kwargs):
            var = next_creator(**kwargs)
            self._created.append(var)
            return var

        with super().scope(), tf.variable_creator_scope(record):
            yield self

    def tfdist_attach(self, optimizer, variables) -> Chain:
        """A built chain (local SGD over a dense exchange) for one optimizer."""
        local_sgd = LocalSGD(self.schedule, *self._averaging_args)
        chain = Chain([local_sgd, GradientExchange()], DistributeEngine(self))
        chain.build(optimizer, variables)
        local_sgd.optimizer_state = lambda: optimizer_slots(  # slots exist once built
            optimizer, exclude=chain.variables())
        owned = {id(getattr(v, "value", v)) for v in optimizer.variables}  # Keras -> tf variable
        unique = {id(v): v for v in self._created}  # nested scopes record a variable twice
        local_sgd.also_averaged = [
            v for v in unique.values()
            if not v.trainable and v.dtype.is_floating and id(v) not in owned
            and getattr(v, "synchronization", None) != tf.VariableSynchronization.ON_READ]
        return chain


class LocalSGDStrategy(_LocalSGD, tf.distribute.MirroredStrategy):
    """MirroredStrategy (one host, many devices) training with post-local SGD.

    Args:
        period: Local steps between model-averaging rounds (>= 1).
        warmup_steps: Synchronous steps first (post-local SGD). Defaults to 0.
        slowmo: Optional `tfdist.averaging.SlowMo(momentum, learning_rate)`.
        topology: "all" (exact averaging) or "ring" (gossip with the two ring neighbours).
        sma: Optional `tfdist.averaging.SMA(alpha, momentum)` (Crossbow).
        intra_period: Hierarchical averaging: also average within each host every
            `intra_period` steps (`period` must be a multiple). Defaults to None.
        host_size: Replicas per host for hierarchical averaging; defaults to each worker's
            devices (emulate hosts on one machine with e.g. host_size=2 of 4 devices).
        average_optimizer_state: Also average the optimizer's slots. Defaults to False.
        devices, cross_device_ops: MirroredStrategy's arguments.

    Example:
        ```python
        strategy = tfdist.LocalSGDStrategy(period=8, warmup_steps=20,
                                           devices=tfdist.devices.local_devices(2))
        with strategy.scope():
            model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                                      keras.layers.Dense(10, activation="softmax")])
            model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        x, y = tfdist.data.load_digits()
        model.fit(x, y, batch_size=64, epochs=1)
        ```
    """

    def __init__(self, period: int, warmup_steps: int = 0, slowmo: SlowMo | None = None,
                 topology: str = "all", devices=None, cross_device_ops=None, *,
                 sma: SMA | None = None, intra_period: int | None = None,
                 host_size: int | None = None, average_optimizer_state: bool = False):
        self._init_local_sgd(period, warmup_steps, slowmo, topology, sma, intra_period,
                             host_size, average_optimizer_state)
        fresh_collective_keys()  # this strategy's collectives numbered apart from others'
        super().__init__(devices=devices, cross_device_ops=cross_device_ops)


class MultiWorkerLocalSGDStrategy(_LocalSGD, MultiWorkerMirroredStrategy):
    """`tfdist.MultiWorkerMirroredStrategy` (TF_CONFIG workers) training with post-local SGD.

    Args: as `LocalSGDStrategy`, plus `cluster_resolver`, `communication_options`,
    `timeout_seconds` and `step_logs` of `tfdist.MultiWorkerMirroredStrategy` ("local" lets
    the local steps run without waiting for the other workers).

    Example (each worker runs it, e.g. under `python -m tfdist.launch --workers 2 -- python
    train.py`; build and compile under `strategy.scope()` as with `LocalSGDStrategy`):
        ```python
        # python -m tfdist.launch --workers 2 -- python train.py  (TF_CONFIG on each worker)
        strategy = tfdist.MultiWorkerLocalSGDStrategy(period=8, warmup_steps=20, step_logs="local")
        with strategy.scope():
            model = build_model()
            model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        model.fit(tfdist.data.distribute(strategy, x, y, 64), epochs=3, steps_per_epoch=20)
        ```
    """

    def __init__(self, period: int, warmup_steps: int = 0, slowmo: SlowMo | None = None,
                 topology: str = "all", cluster_resolver=None, communication_options=None,
                 timeout_seconds: float | None = None, *, sma: SMA | None = None,
                 intra_period: int | None = None, host_size: int | None = None,
                 average_optimizer_state: bool = False, step_logs: str = "averaged"):
        self._init_local_sgd(period, warmup_steps, slowmo, topology, sma, intra_period,
                             host_size, average_optimizer_state)
        super().__init__(cluster_resolver=cluster_resolver,
                         communication_options=communication_options,
                         timeout_seconds=timeout_seconds, step_logs=step_logs)
