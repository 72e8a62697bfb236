"""Private checkpoint hooks: tf.train.Checkpoint entries computed at save time, and objects
hidden from a Trackable's checkpoint (each covered by tests/test_hooks.py).

A Trackable's checkpoint tensors come from `_serialize_to_tensors` and go back through
`_restore_from_tensors` (the protocol tf.lookup tables use); which objects a checkpoint holds
comes from `_trackable_children`. ZeroOptimizer uses both to write its sharded variables
consolidated (one entry, any number of replicas) instead of one replica's shard.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

_Trackable: Any = tf.__internal__.tracking.Trackable


class ComputedCheckpointEntry(_Trackable):
    """A checkpoint entry: `save()` gives {key: array} when a checkpoint is written,
    `restore({key: array})` receives them back (also deferred, once the entry is tracked)."""

    def __init__(self, save, restore):
        self._save_fn, self._restore_fn = save, restore

    def _serialize_to_tensors(self):
        return {key: tf.constant(value) for key, value in self._save_fn().items()}

    def _restore_from_tensors(self, restored_tensors):
        self._restore_fn({key: value.numpy() for key, value in restored_tensors.items()})
        return tf.no_op()


def children_without(children: dict, hidden: list, cache: dict) -> dict:
    """A Trackable's `_trackable_children()` with the objects in `hidden` left out (also from
    the lists it tracks). A checkpoint asks for the children more than once and matches them
    by identity, so each filtered list is made once and kept in `cache` while unchanged."""
    ids = {id(x) for x in hidden} | {id(getattr(x, "value", x)) for x in hidden}
    out = {}
    for name, child in children.items():
        if id(child) in ids:
            continue
        if isinstance(child, list) and any(id(x) in ids for x in child):
            kept = [x for x in child if id(x) not in ids]
            key = (name, tuple(id(x) for x in kept))
            if key not in cache:
                cache[key] = tf.__internal__.tracking.wrap(kept)
            child = cache[key]
        out[name] = child
    return out


def hide_from_checkpoints(trackable, hidden) -> None:
    """Makes `trackable`'s checkpoints leave out the objects `hidden()` returns."""
    original, cache = trackable._trackable_children, {}  # type: ignore[var-annotated]
    object.__setattr__(trackable, "_trackable_children",
                       lambda *args, **kwargs: children_without(original(*args, **kwargs),
                                                                hidden(), cache))
