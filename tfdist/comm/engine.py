"""Engines: how this process's replicas train together, as one object the algorithms are handed.

An `Engine` gives the algorithms everything that depends on how the job runs:

* the communicator for a train step (`communicator`), with the replica-safe conditional;
* the process role: world size, this process's rank, whether it is the chief, the global ranks
  and devices of its replicas, the replicas per host (`local_size`);
* eager collectives, outside a train step (`run`);
* how Keras scales the loss (`loss_divided_by_replicas`: under a tf.distribute strategy Keras
  divides the loss by the number of replicas; elsewhere not).

Algorithms (compression, averaging, zero, pipeline, the optimizer parts) never ask which engine
runs: they receive one. `resolve()` is the one place that looks: the strategy in scope, else the
engine a front end activated (`tfdist.horovod.init()`), else each registered engine's `detect`,
else a world of one. A new engine is one module defining an `Engine` subclass with
`@register`, imported by `tfdist.comm`.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np
import tensorflow as tf

from tfdist.comm.base import ByteCounter, Communicator, LocalCommunicator
from tfdist.comm.consistency import setup_differences, verify_same_model, verify_same_setup

# name -> engine class, in detection order (highest `priority` first).
ENGINES: dict[str, type[Engine]] = {}
_active: list[Engine] = []  # the engine a front end activated for this process (at most one)


class Engine(abc.ABC):
    """One way of running data-parallel replicas (see the module docstring).

    Subclasses set `name` and implement the abstract members; `detect` finds a running instance.

    Example:
        ```python
        class Recording(tfdist.comm.LocalEngine):
            # a world of one that records the collectives the algorithms make

            name = "recording"

            def communicator(self, counter=None):
                class Recorder(tfdist.comm.LocalCommunicator):
                    def all_reduce(self, tensors, op="sum"):
                        print("all_reduce of", len(list(tensors)), "tensors")
                        return super().all_reduce(tensors, op)

                return Recorder(counter)


        tfdist.comm.register(Recording)
        tfdist.comm.activate(tfdist.comm.get_engine("recording"))
        model = build_model()
        model.compile(optimizer=tfdist.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                      loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=64, epochs=1)
        tfdist.comm.activate(None)
        ```
    """

    name: ClassVar[str] = ""
    priority: ClassVar[int] = 0
    # Keras divides the loss by the number of replicas only under a tf.distribute strategy.
    loss_divided_by_replicas: ClassVar[bool] = False

    # -- detection ------------------------------------------------------------------------------
    @classmethod
    def detect(cls, strategy: tf.distribute.Strategy) -> Engine | None:
        """An instance if this engine runs the current process (with `strategy` in scope)."""
        return None

    # -- the communicator ------------------------------------------------------------------------
    @abc.abstractmethod
    def communicator(self, counter: ByteCounter | None = None) -> Communicator:
        """The communicator for collectives inside a train step (replica context)."""

    # -- process role ----------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def world_size(self) -> int:
        """Replicas (ranks) training in sync, over all processes."""

    @property
    def process_count(self) -> int:
        return 1

    @property
    def process_index(self) -> int:
        return 0

    @property
    def is_chief(self) -> bool:
        """Whether this process writes the job's files (worker 0 / rank 0)."""
        return self.process_index == 0

    def key_value_store(self):
        """A `tfdist.comm.kv.KeyValueStore` every process of the job reaches through the job's
        own channel, or None (one process: nothing to reach)."""
        return None

    @property
    def local_devices(self) -> list[str]:
        """The devices of this process's replicas, in local order."""
        return ["/device:CPU:0"]

    def local_ranks(self) -> list[int]:
        """The global ranks of this process's replicas, in local order."""
        return [self.process_index]

    @property
    def local_size(self) -> int:
        """Replicas per host: the default host size of hierarchical averaging."""
        return 1

    @property
    def multi_process(self) -> bool:
        return self.process_count > 1

    # -- eager collectives -----------------------------------------------------------------------
    def run(self, fn: Callable[[Communicator], Any], timeout: float | None = None) -> Any:
        """Runs `fn(communicator)` on every local replica, outside a train step, and returns this
        process's first replica's result (callbacks, checks, checkpoint gathers).

        Raises:
            TimeoutError: `fn` had not returned after `timeout` seconds (the other processes
                did not join the collective); it is left waiting on a daemon thread.
        """
        if timeout is None:
            return self._run(fn)
        return within(timeout, lambda: self._run(fn))

    def _run(self, fn: Callable[[Communicator], Any]) -> Any:
        return fn(self.communicator())

    def gather_values(self, values: Sequence[float]) -> np.ndarray:
        """Every replica's `values` (floats, the same count everywhere), as rows in rank order:
        small and cheap enough to call at every step from a callback (a preemption check)."""
        row = tf.constant([list(values)], tf.float64)
        return np.asarray(self.run(lambda comm: comm.all_gather(row)))

    def replica_copies(self, variable) -> list:
        """The per-replica components of a (possibly mirrored) variable, in local order."""
        return replica_copies(variable)

    def verify_same_model(self, variables) -> None:
        """Raises the same clear error on every worker if the workers' models differ. One
        process's replicas build one model: only processes are compared."""
        if self.multi_process:
            verify_same_model(variables, self.communicator(), run=self._run_collective)

    def verify_same_setup(self, setup: dict[str, int | str]) -> None:
        """Raises the same clear error on every worker if the workers' `setup` values differ
        (`tfdist.comm.verify_same_setup`); only processes are compared."""
        if self.multi_process:
            verify_same_setup(setup, self.communicator(), run=self._run_collective)

    def setup_differences(self, setup: dict[str, int | str]) -> dict[str, dict[int, str]]:
        """The keys of `setup` whose values differ between the processes, with each process's
        value as text ({key: {process index: text}}), the same answer on every process; empty
        when they agree (`tfdist.comm.consistency.setup_differences`)."""
        if not self.multi_process:
            return {}
        return setup_differences(setup, self.communicator(), run=self._run_collective,
                                 process=self.process_index)

    def _run_collective(self, fn: Callable[[], tf.Tensor]) -> tf.Tensor:
        return self._run(lambda _: fn())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world_size={self.world_size})"


def replica_copies(variable) -> list:
    """The per-replica components of a (possibly mirrored) variable, in local order.

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))
        with strategy.scope():
            v = keras.Variable(1.0)
        assert len(tfdist.comm.replica_copies(v)) == 2  # one per device
        ```
    """
    value = getattr(variable, "value", variable)
    if isinstance(value, tf.distribute.DistributedValues):
        return list(value.values)
    return [value]


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """`fn()`, or a TimeoutError if it has not returned after `seconds` (Horovod's collectives
    have no timeout of their own)."""
    result: dict = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
            result["error"] = e

    thread = threading.Thread(target=target, name="tfdist-collective", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"the collective did not finish within {seconds:g} s")
    if "error" in result:
        raise result["error"]
    return result["value"]


class LocalEngine(Engine):
    """A world of one: every collective is the identity and sends nothing.

    Example:
        ```python
        engine = tfdist.comm.LocalEngine()
        assert engine.world_size == 1
        optimizer = tfdist.DistributedOptimizer(keras.optimizers.SGD(0.1), engine=engine)
        ```
    """

    name = "local"
    priority = -100

    @classmethod
    def detect(cls, strategy):
        return cls()

    def communicator(self, counter=None):
        return LocalCommunicator(counter)

    @property
    def world_size(self) -> int:
        return 1


def register(cls: type[Engine]) -> type[Engine]:
    """Class decorator: makes an engine known to `resolve` (and by name to `get`).

    Example:
        ```python
        @tfdist.comm.register
        class Mine(tfdist.comm.LocalEngine):
            name = "mine"


        assert isinstance(tfdist.comm.get_engine("mine"), Mine)
        ```
    """
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a `name` to be registered.")
    ENGINES[cls.name] = cls
    order = sorted(ENGINES.items(), key=lambda item: -item[1].priority)
    ENGINES.clear()
    ENGINES.update(order)
    return cls


register(LocalEngine)


def activate(engine: Engine | None) -> None:
    """Makes `engine` this process's engine wherever no tf.distribute strategy with several
    replicas is in scope (what `tfdist.horovod.init()` does); None forgets it.

    Example:
        ```python
        tfdist.comm.activate(tfdist.comm.LocalEngine())  # what tfdist.horovod.init() does for Horovod
        model = build_model()
        model.compile(optimizer=tfdist.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                      loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=64, epochs=1)
        tfdist.comm.activate(None)
        ```
    """
    _active.clear()
    if engine is not None:
        _active.append(engine)


def resolve(strategy: tf.distribute.Strategy | None = None) -> Engine:
    """The engine running this process.

    Engines bound to a strategy (priority > 0: the tf.distribute engine for Mirrored and
    multi-worker strategies) are asked first, with the strategy in scope (or `strategy`); then
    the engine a front end activated; then the other registered engines' `detect`; else a world
    of one.

    Example:
        ```python
        with tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2)).scope():
            engine = tfdist.comm.resolve()
        assert engine.name == "distribute" and engine.world_size == 2
        assert tfdist.comm.resolve().name == "local"  # no strategy, no Horovod: a world of one
        ```
    """
    strategy = strategy if strategy is not None else tf.distribute.get_strategy()
    for bound in (True, False):
        if not bound and _active:
            return _active[0]
        for cls in ENGINES.values():
            if (cls.priority > 0) == bound:
                engine = cls.detect(strategy)
                if engine is not None:
                    return engine
    return LocalEngine()


def get(spec: str | Engine | None) -> Engine | None:
    """An engine from an instance, a registered name (created now), or None (resolve later).

    Example:
        ```python
        assert tfdist.comm.get_engine("local").world_size == 1
        assert tfdist.comm.get_engine(None) is None  # resolved when the optimizer is built
        ```
    """
    if spec is None or isinstance(spec, Engine):
        return spec
    if isinstance(spec, str) and spec in ENGINES:
        return ENGINES[spec]()
    raise ValueError(f"Unknown engine {spec!r}; choose one of {sorted(ENGINES)}, or pass an "
                     "Engine instance.")
