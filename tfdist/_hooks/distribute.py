"""Private tf.distribute hooks (each covered by tests/test_hooks.py).

* Collective keys. Each MirroredStrategy numbers its collective ops from the same base, so a
  second strategy in one process reuses instance keys of the first, and TF aborts with
  "Collective instance 100 expected type 0 ... but got type 2" once the first has run a traced
  collective. TF's own tests avoid it by raising the class attribute `_collective_key_base`
  before each new strategy; so does `advance_collective_keys`.
* Merge calls. `uses_merge_call` asks TF's semi-private `tf.__internal__` whether the current
  strategy needs `merge_call` for cross-replica work (MirroredStrategy does, the multi-worker
  collective strategy does not); Keras asks the same.
"""

from __future__ import annotations

import itertools

import tensorflow as tf

KEY_BASE_ATTRIBUTE = "_collective_key_base"
_KEY_STRIDE = 100_000
_generation = itertools.count(1)


def advance_collective_keys() -> None:
    """Makes the next MirroredStrategy (or subclass) number its collectives afresh."""
    cls = tf.distribute.MirroredStrategy
    if not hasattr(cls, KEY_BASE_ATTRIBUTE):
        raise RuntimeError(
            f"tf.distribute.MirroredStrategy has no `{KEY_BASE_ATTRIBUTE}`: this TensorFlow "
            "version is not supported by tfdist (pin tensorflow 2.21.x)."
        )
    setattr(cls, KEY_BASE_ATTRIBUTE, next(_generation) * _KEY_STRIDE)


def new_mirrored_strategy(devices=None, cross_device_ops=None) -> tf.distribute.MirroredStrategy:
    """A `tf.distribute.MirroredStrategy` whose collectives do not clash with earlier ones."""
    advance_collective_keys()
    return tf.distribute.MirroredStrategy(devices=devices, cross_device_ops=cross_device_ops)


def uses_merge_call() -> bool:
    """Whether the current strategy needs `merge_call` for cross-replica work."""
    return not tf.__internal__.distribute.strategy_supports_no_merge_call()
