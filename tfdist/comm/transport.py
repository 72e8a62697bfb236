"""The transport: carries a codec's rounds of communication over a communicator.

A codec (`tfdist.compression.Compressor`) is maths only. Its side of one exchange is a generator,
`codec.encode(xs, states, step, rank)`, that yields the rounds of communication it needs and
receives each round's result:

* `Sum(tensors)`: every worker's tensors summed element-wise (an all-reduce); the reply is the
  list of sums.
* `Gather(tensors)`: every worker's copy of each tensor (an all-gather); the reply is, for each
  tensor, the copies stacked in rank order: shape [world_size, *shape].
* `Choice(pred, if_true, if_false, args)`: one of two sequences of rounds, chosen by a predicate
  that is the same on every worker; `if_true(rank, *args)` and `if_false(rank, *args)` return
  generators of rounds, and the reply is what the chosen one returns. Per-replica tensors reach
  the branches through `args`, and the worker's rank is handed in afresh, never captured: an
  engine may run the branches outside the replica (`Communicator.cond`).

The generator returns (sums, new states): the sum over workers of each tensor as the codec
rebuilds it, and each tensor's new codec state. The transport decides how a round travels: all
its tensors in one fused collective call (the default) or one call per round's list as given;
the engine's communicator (tf.distribute, Horovod, a world of one) carries it. So one transport
serves every codec and every engine, and a codec never sees a communicator (PyTorch keeps its
DDP communication hooks apart from the bucket transport in the same way).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from tfdist.comm.base import Communicator, fused_all_gather, fused_all_reduce


@dataclass(frozen=True)
class Sum:
    """A round: each tensor summed over the workers (an all-reduce).

    Example:
        ```python
        def mean_of(x, world_size):  # a codec's rounds: one sum, then local maths
            (total,) = yield tfdist.comm.Sum([x])
            return total / world_size


        comm = tfdist.comm.LocalCommunicator()
        assert tfdist.comm.run_rounds(mean_of(tf.ones(2), 1), comm).numpy().tolist() == [1, 1]
        ```
    """

    tensors: Sequence[tf.Tensor]


@dataclass(frozen=True)
class Gather:
    """A round: every worker's copy of each tensor, stacked in rank order (an all-gather).

    Example:
        ```python
        def largest_of(x):  # each worker's copy, then the largest element of any
            (copies,) = yield tfdist.comm.Gather([x])  # shape [world_size, *x.shape]
            return tf.reduce_max(copies)


        comm = tfdist.comm.LocalCommunicator()
        assert float(tfdist.comm.run_rounds(largest_of(tf.constant([1.0, 3.0])), comm)) == 3.0
        ```
    """

    tensors: Sequence[tf.Tensor]


@dataclass(frozen=True)
class Choice:
    """One of two sequences of rounds, by a predicate that is the same on every worker: the
    branches are called as `if_true(rank, *args)` / `if_false(rank, *args)`.

    Example:
        ```python
        def summed(rank, x):
            (total,) = yield tfdist.comm.Sum([x])
            return total


        def gathered(rank, x):
            (copies,) = yield tfdist.comm.Gather([x])
            return tf.reduce_sum(copies, axis=0)


        def either(x, dense):  # the same sum, by one route or the other
            total = yield tfdist.comm.Choice(dense, summed, gathered, args=[x])
            return total


        comm = tfdist.comm.LocalCommunicator()
        for dense in (True, False):
            out = tfdist.comm.run_rounds(either(tf.ones(2), tf.constant(dense)), comm)
            assert out.numpy().tolist() == [1, 1]
        ```
    """

    pred: Any
    if_true: Callable[..., Generator]
    if_false: Callable[..., Generator]
    args: Sequence = ()


Rounds = Generator[Any, Any, Any]


def run_rounds(rounds: Rounds, comm: Communicator) -> Any:
    """Carries every round `rounds` yields over `comm`; returns what the generator returns.

    Example:
        ```python
        def twice_the_sum(x):  # a generator of rounds: one all-reduce, then local maths
            (total,) = yield tfdist.comm.Sum([x])
            return 2 * total


        comm = tfdist.comm.LocalCommunicator()  # a world of one: the sum is x itself
        assert tfdist.comm.run_rounds(twice_the_sum(tf.ones(3)), comm).numpy().tolist() == [2, 2, 2]
        ```
    """
    try:
        request = next(rounds)
        while True:
            request = rounds.send(_carry(request, comm))
    except StopIteration as done:
        return done.value


def _carry(request, comm: Communicator):
    if isinstance(request, Sum):
        return fused_all_reduce(comm, list(request.tensors), "sum")
    if isinstance(request, Gather):
        return fused_all_gather(comm, list(request.tensors))
    if isinstance(request, Choice):
        return comm.cond(request.pred,
                         lambda *args: run_rounds(request.if_true(comm.rank, *args), comm),
                         lambda *args: run_rounds(request.if_false(comm.rank, *args), comm),
                         args=request.args)
    raise TypeError(f"A codec yielded {request!r}: a round is tfdist.comm.Sum, Gather or Choice.")


def reduce_encoded(codec, xs: Sequence[tf.Tensor], states: Sequence[dict], step,
                   comm: Communicator, op: str = "sum") -> tuple[list[tf.Tensor], list[dict]]:
    """The sum (or mean) over workers of each tensor of `xs` through `codec`, with each tensor's
    codec state; returns (results, new states). Every tensor of the exchange is encoded
    together, each round in one fused collective call (PowerSGD: every P in one all-reduce,
    every Q in another).

    Example:
        ```python
        codec = tfdist.compression.TopK(0.25)
        x = tf.random.normal([16, 4])
        state = codec.init_state(x.shape, x.dtype)
        (total,), _ = tfdist.comm.reduce_encoded(codec, [x], [state], tf.constant(0, tf.int64),
                                                 tfdist.comm.LocalCommunicator())
        assert int(tf.math.count_nonzero(total)) == 16  # a quarter of the 64 elements
        ```
    """
    if op not in ("sum", "mean"):
        raise ValueError(f"`op` must be 'sum' or 'mean'. Received: op={op!r}")
    totals, new_states = run_rounds(codec.encode(list(xs), list(states), step, comm.rank), comm)
    n = comm.world_size
    if op == "mean" and n > 1:
        totals = [t / tf.cast(n, t.dtype) for t in totals]
    return list(totals), list(new_states)
