"""Control flow around collectives: a `tf.cond` whose branches may communicate."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf


class Holes:
    """A list with None entries (gradients of unused variables), split for collectives and
    control flow, which take tensors only: `values` are the present entries, `refill(values)`
    puts (transformed) values back in their places."""

    def __init__(self, items: Sequence):
        self.size = len(items)
        self.present = [i for i, x in enumerate(items) if x is not None]
        self.values = [items[i] for i in self.present]

    def refill(self, values: Sequence) -> list:
        out: list = [None] * self.size
        for i, v in zip(self.present, values):
            out[i] = v
        return out


def uses_merge_call() -> bool:
    """Whether the current strategy needs `merge_call` for cross-replica work (MirroredStrategy).

    `tf.__internal__` is TF's semi-private namespace (Keras uses the same call).
    """
    return not tf.__internal__.distribute.strategy_supports_no_merge_call()


def replica_cond(pred, true_fn: Callable[..., Any], false_fn: Callable[..., Any],
                 args: Sequence = ()) -> Any:
    """`tf.cond` whose branches may run collectives and optimizer updates, from replica context.

    Under MirroredStrategy, a `tf.cond` in replica context must not contain `merge_call` (which
    every all-reduce and variable update uses): TF raises "merge_call called while defining a new
    graph". The cond is then moved to cross-replica context and each branch runs on every replica
    with `call_for_each_replica`, the pattern Keras' LossScaleOptimizer uses. `pred` must be the
    same on every replica.

    Per-replica tensors must reach the branches through `args` (the branches are called as
    `fn(*args)`), never through a closure: `merge_call` runs a single replica's closure, so a
    captured tensor would be replica 0's on every replica. Variables may be captured.

    Returns:
        The taken branch's outputs (this replica's), or None when the branches return None.
    """
    args = list(args)
    if not uses_merge_call():
        return tf.cond(pred, lambda: true_fn(*args), lambda: false_fn(*args))

    def merge_fn(distribution, pred, *args):
        first = distribution.experimental_local_results(pred)[0]
        return tf.cond(
            first,
            lambda: distribution.extended.call_for_each_replica(true_fn, args=args),
            lambda: distribution.extended.call_for_each_replica(false_fn, args=args),
        )

    return tf.distribute.get_replica_context().merge_call(merge_fn, args=(pred, *args))
