"""The compressor protocol: pure tensor maths with explicit state.

A compressor turns one gradient tensor into a payload of (small) tensors and back:

    state = compressor.init_state(shape, dtype)           # dict of initial tensors
    payload, ctx, state = compressor.compress(x, state, step)
    x_hat = compressor.decompress(payload, ctx)

`ctx` holds only what every worker computes alike (shape, dtype, k, shared random indices);
anything that depends on a worker's data travels in the payload. `step` (the exchange count) and
`rank` seed stochastic compressors statelessly, so a resumed run draws the same numbers.

A compressor is either *summable* (payloads of different workers may be added element-wise, so
they go through all-reduce: FP16, random-k with a shared seed, PowerSGD) or not (top-k, QSGD,
sign...: payloads are all-gathered and each worker's is decompressed). `reduce` implements that
routing over a `tfdist.comm.Communicator`; multi-round schemes (PowerSGD) override it.
Keras-facing code turns the state into variables, so strategies place it and checkpoints carry it.
"""

from __future__ import annotations

import abc
import math
from typing import Any

import tensorflow as tf

Payload = tuple[tf.Tensor, ...]
State = dict[str, tf.Tensor]


def check_ratio(ratio: float, name: str = "ratio") -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < ratio <= 1.0:
        raise ValueError(f"`{name}` must be in (0, 1]. Received: {name}={ratio!r}")
    return float(ratio)


def num_kept(n: int, ratio: float) -> int:
    """How many of n elements a sparsifier with `ratio` keeps (at least one)."""
    return max(1, min(n, math.ceil(ratio * n)))


def stateless_seed(*parts) -> tf.Tensor:
    """A [2] int64 seed for tf.random.stateless_* from integers / scalar tensors."""
    mixed = tf.constant(0, tf.int64)
    for p in parts:
        mixed = mixed * 1_000_003 + tf.cast(p, tf.int64)
    return tf.stack([mixed, tf.cast(parts[-1], tf.int64) if parts else mixed])


class Compressor(abc.ABC):
    """Base class; subclasses implement `compress` and `decompress` (and may override the rest).

    Class attributes:
        summable: payloads may be summed by an all-reduce.
        unbiased: E[decompress(compress(x))] == x.
    """

    summable: bool = False
    unbiased: bool = False

    def applies_to(self, shape: tf.TensorShape) -> bool:
        """Whether compressing a tensor of this shape pays off (else it is sent dense)."""
        return True

    def init_state(self, shape: tf.TensorShape, dtype: tf.DType, seed: int = 0) -> State:
        """Initial state for one tensor; `seed` differs per tensor, not per worker."""
        return {}

    @abc.abstractmethod
    def compress(self, x: tf.Tensor, state: State, step: tf.Tensor,
                 rank=0) -> tuple[Payload, Any, State]:
        """Returns (payload, ctx, new state)."""

    @abc.abstractmethod
    def decompress(self, payload: Payload, ctx: Any) -> tf.Tensor:
        """Rebuilds a tensor of the original shape and dtype from one worker's payload."""

    def reduce(self, x: tf.Tensor, state: State, step: tf.Tensor, comm, op: str = "sum"):
        """Sum (or mean) of `x` over workers through `comm`; returns (result, new state)."""
        payload, ctx, state = self.compress(x, state, step, comm.rank)
        n = comm.world_size
        if self.summable:
            total = self.decompress(tuple(comm.all_reduce(list(payload), op="sum")), ctx)
        else:
            gathered = [comm.all_gather(p[None]) for p in payload]
            total = tf.add_n([self.decompress(tuple(g[w] for g in gathered), ctx)
                              for w in range(n)])
        if op == "mean" and n > 1:
            total = total / tf.cast(n, total.dtype)
        return total, state

    def get_config(self) -> dict[str, Any]:
        return {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


class Identity(Compressor):
    """No compression: the dense tensor is the payload (summable)."""

    summable = True
    unbiased = True

    def compress(self, x, state, step, rank=0):
        return (x,), None, state

    def decompress(self, payload, ctx):
        return payload[0]
