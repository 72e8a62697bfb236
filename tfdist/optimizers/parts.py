"""The parts a distributed optimizer step is assembled from, and how they chain.

A step takes this replica's gradients through an ordered list of parts, in the manner of optax's
`chain`: the order given is the order run, and nothing in the chain knows a concrete part. The
keyword arguments of `tfdist.DistributedOptimizer` build the usual order:

    loss scaling / non-finite check -> gradient-norm tracking -> accumulation -> local SGD
                                    -> gradient exchange -> the inner optimizer

Each part is an object with its own state (`build`: variables of the owner optimizer, so
checkpoints carry them) and its step, `step(ctx, grads, next)`: it transforms the gradients and
calls `next(ctx, grads)` to continue, possibly inside a conditional (accumulation continues on
the k-th micro-step only), possibly not at all (local SGD's local steps apply directly, skipping
the exchange), possibly with a changed context (loss scaling wraps the final apply in its finite
check). The end of the chain is `ctx.apply`: the inner optimizer updates the variables. A part
after the exchange sees the reduced gradients (the same on every replica).

A part says what the chain must know about it through class attributes, not its type:
`reduces` (it is the exchange: exactly one part of a chain reduces), `needs_replica_gradients`
(it must come before the exchange), `keeps_gradient_units` (its state is in the gradients'
units, so the loss is not pre-scaled), `passes_rows(self)` (embedding gradients may reach it as
rows) and `loss_factor(self, n)` (a factor it wants on the loss). A part of your own is one file:
subclass `Part`, decorate it with `tfdist.optimizers.register(name)` if a saved optimizer must
name it otherwise than by its import path.

Parts never ask which engine runs: the context carries the engine and its communicator.
Gradients reach the parts in one convention on every engine, Keras' under a tf.distribute
strategy: each replica's gradient of the loss divided by the number of replicas, so an exchange
*sums* them into the mean gradient. Every piece of gradient-shaped state (error-feedback
residuals, PowerSGD's Q, accumulators) is then in the same units on every engine, and a
checkpoint resumes exactly on another engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np
import tensorflow as tf

from tfdist._hooks.optimizer import variable_index
from tfdist.comm import ByteCounter, Communicator, Engine, ring_bytes
from tfdist.registry import Registry


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What every part of one optimizer step sees.

    Attributes:
        engine: The engine the optimizer runs on.
        comm: The engine's communicator for this step (counting into `traffic`).
        variables: The variables the gradients belong to, in order.
        apply: The end of the chain: `apply(grads)` updates `variables` (None entries skipped)
            from gradients that are the same on every replica (reduced).
        traffic: The optimizer's byte, call and round counters.
        owner: The Keras optimizer whose variables hold the parts' state.
        apply_local: How a replica applies its own gradients (local SGD's local steps), where
            a decision taken on them may differ between replicas; None: as `apply`.
        loss_prescaled: The loss was multiplied by `Chain.loss_factor()` before the backward
            pass, so local SGD's local steps get each replica's whole gradient as it is.

    Example:
        ```python
        class Report(tfdist.optimizers.Part):  # prints what the context holds, when traced

            def step(self, ctx, grads, next):
                print(f"{ctx.comm.world_size} replicas, {len(ctx.variables)} variables, "
                      f"the first at index {ctx.index(ctx.variables[0])} of the optimizer")
                next(ctx, grads)

        model = build_model()
        model.compile(optimizer=tfdist.DistributedOptimizer(keras.optimizers.SGD(0.1), Report()),
                      loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=64, epochs=1, verbose=0)
        ```
    """

    engine: Engine
    comm: Communicator
    variables: list
    apply: Callable[[list], None]
    traffic: Traffic
    owner: Any
    apply_local: Callable[[list], None] | None = None
    loss_prescaled: bool = False

    def index(self, variable) -> int:
        """The position of `variable` in the owner optimizer's variable list (state lookup)."""
        return variable_index(self.owner, variable)

    def replace(self, **changes) -> StepContext:
        return dataclasses.replace(self, **changes)


def dense_gradient(grad, variable):
    """`grad` as a dense tensor of `variable`'s static shape. An embedding's gradient comes as
    tf.IndexedSlices (rows and their indices, the row count unknown when traced), and some
    gradients lose their static shape on the way (a Dense kernel applied to a sequence, under
    MultiWorkerMirroredStrategy: (None, units)); exchanges, compressors and byte accounting work
    on whole tensors of known shape. Others pass as they are."""
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        rows = int(variable.shape[0])
        grad = tf.math.unsorted_segment_sum(grad.values, grad.indices, rows)
    if grad.shape.is_fully_defined():
        return grad
    return tf.reshape(grad, variable.shape)


def on_values(fn: Callable[[Any], Any], grad):
    """`fn` applied to a gradient: to its rows where it is a `tf.IndexedSlices` (an embedding's
    gradient on its way to the exchange, which sums it as rows), else to the tensor; None stays
    None. For element-wise maps (a scale, a cast)."""
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(fn(grad.values), grad.indices, grad.dense_shape)
    return fn(grad)


class Part:
    """One stage of a distributed optimizer's step (see the module docstring).

    Subclasses override `step`, and `build`, `variables`, `per_replica_variables` and
    `get_config` when they keep state or options; the class attributes below say what the chain
    must know about them.

    Attributes:
        reduces: The part exchanges the gradients: it passes on values that are the same on
            every replica. A chain has exactly one.
        needs_replica_gradients: The part works on each replica's own gradients, so it must come
            before the exchange (local SGD).
        keeps_gradient_units: The part keeps state in the gradients' units (norms, buffers), so
            the chain does not fold factors into the loss (`Chain.loss_factor`).

    Example:
        ```python
        class ClipValue(tfdist.optimizers.Part):  # after the exchange: the reduced gradients

            def __init__(self, limit):
                self.limit = limit

            def step(self, ctx, grads, next):
                next(ctx, [None if g is None else tf.clip_by_value(g, -self.limit, self.limit)
                           for g in grads])

            def get_config(self):
                return {"limit": self.limit}

        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))
        with strategy.scope():
            model = build_model()
            opt = tfdist.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                              tfdist.optimizers.GradientExchange(), ClipValue(0.5))
            model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=64, epochs=1, verbose=0)
        print([type(p).__name__ for p in opt.chain.parts])  # NanPolicy, GradientExchange, ClipValue
        ```
    """

    reduces: ClassVar[bool] = False
    needs_replica_gradients: ClassVar[bool] = False
    keeps_gradient_units: ClassVar[bool] = False
    built: bool = False

    def build(self, owner, var_list: list, engine: Engine) -> None:
        """Creates the part's state as variables of `owner` (a Keras optimizer)."""
        self.built = True

    def variables(self) -> list:
        """The variables this part created on its owner."""
        return []

    def per_replica_variables(self) -> list:
        """Those of `variables()` whose value differs between replicas (every replica's copy is
        checkpointed)."""
        return []

    def passes_rows(self) -> bool:
        """Whether an embedding's gradient may reach this part as rows (`tf.IndexedSlices`),
        to be exchanged as rows; otherwise every gradient is made dense first."""
        return False

    def loss_factor(self, world_size: int) -> tf.Tensor | None:
        """A factor this part wants on the loss before the backward pass (None: none); see
        `Chain.loss_factor`."""
        return None

    def step(self, ctx: StepContext, grads: list, next: Callable[[StepContext, list], None]) -> None:
        next(ctx, grads)

    def get_config(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Part:
        return cls(**config)


PARTS: Registry[Part] = Registry("optimizer part", Part)
register = PARTS.register


def run_chain(parts: Sequence[Part], ctx: StepContext, grads: list) -> None:
    """Runs `grads` through `parts` in order, ending in `ctx.apply`."""

    def call(i: int, ctx: StepContext, grads: list) -> None:
        if i == len(parts):
            ctx.apply(grads)
        else:
            parts[i].step(ctx, grads, lambda c, g: call(i + 1, c, g))

    call(0, ctx, list(grads))


def check_order(parts: Sequence[Part]) -> list[Part]:
    """`parts` as a chain runs them, checked: parts only, no class twice, exactly one exchange
    (a part that `reduces`), and every part that `needs_replica_gradients` before it."""
    parts = list(parts)
    for part in parts:
        if not isinstance(part, Part):
            raise ValueError(f"Expected a tfdist.optimizers.Part (an exchange, accumulation, "
                             f"local SGD, ...). Received: {part!r}")
    kinds = [type(p) for p in parts]
    twice = sorted({k.__name__ for k in kinds if kinds.count(k) > 1})
    if twice:
        raise ValueError(f"Two parts of the same kind: {', '.join(twice)}; give each once. "
                         f"Received: {parts!r}")
    exchanges = [i for i, p in enumerate(parts) if p.reduces]
    if len(exchanges) != 1:
        raise ValueError(f"A chain needs exactly one exchange (a part that reduces the "
                         f"gradients, e.g. GradientExchange); received {len(exchanges)}: "
                         f"{parts!r}")
    late = [p for p in parts[exchanges[0] + 1:] if p.needs_replica_gradients]
    if late:
        raise ValueError(f"{late[0]!r} works on each replica's own gradients: put it before "
                         f"the exchange {parts[exchanges[0]]!r}. Received order: {parts!r}")
    return parts


class Traffic:
    """What an optimizer sent: bytes, collective calls and communication rounds, as variables of
    the owner optimizer (so checkpoints carry them); every replica adds the same amounts.

    The exchange notes, when it is traced, the bytes a dense float32 all-reduce of the same
    gradients would send (`dense_bytes_per_exchange`), the yardstick of `bytes_vs_dense`.

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))
        with strategy.scope():
            model = build_model()
            model.compile(optimizer=tfdist.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                          loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=64, epochs=1, verbose=0)
        traffic = tfdist.optimizers.chain_of(model.optimizer).traffic
        print(traffic.bytes_sent / traffic.communication_rounds, "bytes per exchange;",
              traffic.dense_bytes_per_exchange(), "for a dense float32 all-reduce")
        ```
    """

    def __init__(self):
        self.built = False
        self.world_size: int | None = None
        self.gradient_bytes: int | None = None

    def build(self, owner) -> None:
        def counter(name: str, dtype: str):
            return owner.add_variable(shape=(), dtype=dtype, initializer="zeros",
                                      aggregation="none", name=name)

        self._bytes = counter("bytes_sent", "float64")
        self._calls = counter("collective_calls", "int64")
        self._rounds = counter("communication_rounds", "int64")
        self.built = True

    def counter(self) -> ByteCounter:
        return ByteCounter(self._bytes, self._calls)

    def variables(self) -> list:
        return [self._bytes, self._calls, self._rounds] if self.built else []

    def add_round(self) -> None:
        self._rounds.assign_add(1)

    @property
    def bytes_sent(self) -> float:
        """Total bytes this worker has sent (ring-algorithm accounting, see `tfdist.comm`)."""
        return float(self._bytes.numpy()) if self.built else 0.0

    @property
    def collective_calls(self) -> int:
        """Collective calls this worker has made (one per all-reduce/all-gather/... call)."""
        return int(self._calls.numpy()) if self.built else 0

    @property
    def communication_rounds(self) -> int:
        """Gradient exchanges and model-averaging rounds so far."""
        return int(self._rounds.numpy()) if self.built else 0

    def note_dense(self, world_size: int, variables: Sequence) -> None:
        """Records (at trace time) the gradients a dense exchange would send."""
        self.world_size = world_size
        self.gradient_bytes = sum(4 * int(np.prod(v.shape)) for v in variables)

    def dense_bytes_per_exchange(self) -> float | None:
        """Bytes a dense float32 all-reduce of the same gradients sends (once traced)."""
        if self.world_size is None or self.gradient_bytes is None:
            return None
        return ring_bytes("all_reduce", self.gradient_bytes, self.world_size)
