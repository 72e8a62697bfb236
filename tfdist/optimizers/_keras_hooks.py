"""Every private TensorFlow / Keras hook tfdist relies on, in one place.

Each hook names the private attribute it touches and is covered by tests/test_keras_hooks.py,
which fails loudly if a TensorFlow or Keras upgrade moves it. Pinned: tensorflow 2.21.x,
keras 3.15.x.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence

import tensorflow as tf

# Keras' TF backend all-reduces gradients in TFOptimizer._all_reduce_sum_gradients, called from
# _backend_update_step (keras/src/backend/tensorflow/optimizer.py).
ALL_REDUCE_HOOK = "_all_reduce_sum_gradients"


def disable_gradient_all_reduce(optimizer) -> None:
    """Makes a Keras optimizer apply the gradients it is given without all-reducing them.

    tfdist wrappers reduce gradients themselves (through a Communicator); the inner optimizer
    must not reduce them a second time.
    """
    if not hasattr(type(optimizer), ALL_REDUCE_HOOK):
        raise RuntimeError(
            f"{type(optimizer).__name__} has no `{ALL_REDUCE_HOOK}`: this Keras version is not "
            "supported by tfdist (pin keras 3.15.x)."
        )

    def _identity(self, grads_and_vars):
        return list(grads_and_vars)

    object.__setattr__(optimizer, ALL_REDUCE_HOOK, types.MethodType(_identity, optimizer))


def uses_merge_call() -> bool:
    """Whether the current strategy needs `merge_call` for cross-replica work (MirroredStrategy).

    `tf.__internal__` is TF's semi-private namespace (Keras uses the same call).
    """
    return not tf.__internal__.distribute.strategy_supports_no_merge_call()


def replica_cond(pred, true_fn: Callable[..., None], false_fn: Callable[..., None],
                 args: Sequence = ()) -> None:
    """`tf.cond` whose branches may run collectives and optimizer updates, from replica context.

    Under MirroredStrategy, a `tf.cond` in replica context must not contain `merge_call` (which
    every all-reduce and variable update uses): TF raises "merge_call called while defining a new
    graph". The cond is then moved to cross-replica context and each branch runs on every replica
    with `call_for_each_replica`, the pattern Keras' LossScaleOptimizer uses. `pred` must be the
    same on every replica.

    Per-replica tensors must reach the branches through `args` (the branches are called as
    `fn(*args)`), never through a closure: `merge_call` runs a single replica's closure, so a
    captured tensor would be replica 0's on every replica. Variables may be captured.
    """
    args = list(args)
    if not uses_merge_call():
        tf.cond(pred, lambda: true_fn(*args), lambda: false_fn(*args))
        return

    def merge_fn(distribution, pred, *args):
        first = distribution.experimental_local_results(pred)[0]
        tf.cond(
            first,
            lambda: distribution.extended.call_for_each_replica(true_fn, args=args),
            lambda: distribution.extended.call_for_each_replica(false_fn, args=args),
        )

    tf.distribute.get_replica_context().merge_call(merge_fn, args=(pred, *args))
