"""Private tf.distribute hooks (each covered by tests/test_hooks.py).

* Collective keys. Each MirroredStrategy numbers its collective ops from the same base (the
  class attribute `_collective_key_base`, read once when a strategy is created), so a second
  strategy in one process reuses the keys of the first, and TF aborts with "Collective instance
  100 expected type 0 ... but got type 2" once both have run collectives of different kinds
  (what every notebook that builds two models meets). TF's own tests raise the base before each
  new strategy. `fresh_collective_keys()` makes the attribute give every new MirroredStrategy a
  base of its own; tfdist installs it when it first needs it (building one of its
  MirroredStrategy subclasses, or a communicator or engine on a strategy), never at import.
  Multi-worker strategies keep theirs: their keys must agree across processes.
* Central variables. `central_variable` unwraps a CentralStorageStrategy variable (its
  private `_v`) so that Hogwild replicas can update it without aggregation.
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


class _FreshKeyBase:
    """A class attribute whose every read is a new key base: each MirroredStrategy created
    reads it once, so each numbers its collectives in a range of its own."""

    def __get__(self, instance, owner) -> int:
        return next(_generation) * _KEY_STRIDE


def fresh_collective_keys() -> None:
    """Gives every MirroredStrategy (and subclass) created from now on keys of its own.
    Idempotent."""
    cls = tf.distribute.MirroredStrategy
    if KEY_BASE_ATTRIBUTE not in vars(cls):
        raise RuntimeError(
            f"tf.distribute.MirroredStrategy has no `{KEY_BASE_ATTRIBUTE}`: this TensorFlow "
            "version is not supported by tfdist (pin tensorflow 2.21.x).")
    if not isinstance(vars(cls)[KEY_BASE_ATTRIBUTE], _FreshKeyBase):
        setattr(cls, KEY_BASE_ATTRIBUTE, _FreshKeyBase())


def uses_merge_call() -> bool:
    """Whether the current strategy needs `merge_call` for cross-replica work."""
    return not tf.__internal__.distribute.strategy_supports_no_merge_call()


def central_variable(variable):
    """The one `tf.Variable` behind a variable a `CentralStorageStrategy` created (its
    `AggregatingVariable` wraps it as `_v`); any other variable as it is. Replicas update it
    directly, which `AggregatingVariable` refuses in a replica context."""
    value = variable if isinstance(variable, tf.Variable) else variable.value  # keras.Variable
    inner = getattr(value, "_v", None)
    if inner is None and type(value).__name__ == "AggregatingVariable":
        raise RuntimeError("tf.distribute's AggregatingVariable has no `_v` any more: "
                           "tfdist's Hogwild optimizer needs an update for this TensorFlow.")
    return value if inner is None else inner
