"""The parts a distributed optimizer step is assembled from, and how they chain.

A step takes this replica's gradients through a chain of parts, in a fixed order:

    loss scaling -> gradient-norm tracking -> accumulation -> local SGD -> gradient exchange
                                                                      -> the inner optimizer

Each part is an object with its own state (variables of the owner optimizer, so checkpoints
carry them) and one method, `step(ctx, grads, next)`: it transforms the gradients and calls
`next(ctx, grads)` to continue, possibly inside a conditional (accumulation continues on the
k-th micro-step only), possibly more than once or not at all (local SGD's local steps apply
directly, skipping the exchange), possibly with a changed context (loss scaling wraps the final
apply in its finite check). The end of the chain is `ctx.apply`: the inner optimizer updates the
variables. In the spirit of optax's `chain` and Keras' optimizer wrappers; the order is fixed
because each part's meaning depends on its place (`Part.position`).

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

    Subclasses set `position` and override `step`, and `build`, `variables`,
    `per_replica_variables` and `get_config` when they keep state or options.
    """

    position: ClassVar[int] = 0
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

    def step(self, ctx: StepContext, grads: list, next: Callable[[StepContext, list], None]) -> None:
        next(ctx, grads)

    def get_config(self) -> dict[str, Any]:
        return {}


def run_chain(parts: Sequence[Part], ctx: StepContext, grads: list) -> None:
    """Runs `grads` through `parts` (already in order), ending in `ctx.apply`."""

    def call(i: int, ctx: StepContext, grads: list) -> None:
        if i == len(parts):
            ctx.apply(grads)
        else:
            parts[i].step(ctx, grads, lambda c, g: call(i + 1, c, g))

    call(0, ctx, list(grads))


def ordered(parts: Sequence[Part]) -> list[Part]:
    """`parts` in chain order; two parts of one kind are refused."""
    seen: dict[int, Part] = {}
    for part in parts:
        if not isinstance(part, Part):
            raise ValueError(f"Expected a tfdist.optimizers.Part (an exchange, accumulation or "
                             f"local-SGD part). Received: {part!r}")
        if part.position in seen:
            raise ValueError(f"Two parts of the same kind: {seen[part.position]!r} and {part!r}; "
                             "give each kind once.")
        seen[part.position] = part
    return [seen[p] for p in sorted(seen)]


class Traffic:
    """What an optimizer sent: bytes, collective calls and communication rounds, as variables of
    the owner optimizer (so checkpoints carry them); every replica adds the same amounts.

    The exchange notes, when it is traced, the bytes a dense float32 all-reduce of the same
    gradients would send (`dense_bytes_per_exchange`), the yardstick of `bytes_vs_dense`.
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
