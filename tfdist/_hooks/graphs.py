"""Private graph hook: the custom gradients TensorFlow registers while tracing and never drops.

Every `tf.custom_gradient` traced into a graph, including the one around each
`ReplicaContext.all_reduce` and `all_gather` call of a distributed step, registers its gradient
function in TensorFlow's global gradient registry under a new name. The entry closes over the
traced tensors, so it keeps the whole traced graph, and the functions the eager context holds for
it, alive for as long as the process lives. A process that traces many models (a test suite, a
sweep) grows by tens of thousands of objects per step it traces, and every later garbage
collection walks them (tensorflow/tensorflow#97697, open for TF 2.21). Covered by
tests/test_hooks.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_PREFIX = "CustomGradient-"  # the names tf.custom_gradient registers its graph-mode gradients under


def _registry() -> dict:
    from tensorflow.python.framework import ops

    return ops._gradient_registry._registry  # the registry has no public API


@contextlib.contextmanager
def custom_gradients_released() -> Iterator[None]:
    """Drops, on exit, the custom gradients registered inside the block, so the graphs traced
    there can be freed. Use it around work whose traced functions are not differentiated again
    afterwards (they are released: a gradient of one of them would fail with a `LookupError`
    naming the missing gradient, never give a wrong answer)."""
    before = set(_registry())
    try:
        yield
    finally:
        registry = _registry()
        for name in [n for n in registry if n.startswith(_PREFIX) and n not in before]:
            del registry[name]
