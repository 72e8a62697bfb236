"""The private TensorFlow hooks of the strategies package (covered by tests/test_hooks.py).

Each MirroredStrategy numbers its collective ops from the same base, so a second strategy in one
process reuses instance keys of the first, and TF aborts with "Collective instance 100 expected
type 0 ... but got type 2" once the first has run a traced collective. TF's own tests avoid it by
raising the class attribute `_collective_key_base` before each new strategy; so does this module.
"""

from __future__ import annotations

import itertools
from typing import Any

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


# -- tf.train.Checkpoint entries computed at save time ------------------------------------------
# A Trackable's checkpoint tensors come from `_serialize_to_tensors` and go back through
# `_restore_from_tensors` (the protocol tf.lookup tables use); which objects a checkpoint holds
# comes from `_trackable_children`. ZeroOptimizer uses both to write its sharded variables
# consolidated (one entry, any number of replicas) instead of one replica's shard.
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


# -- where a tf.function's nodes actually ran ------------------------------------------------------
def executed_devices(python_function, *args) -> dict[str, tuple[str, str]]:
    """Runs `python_function(*args)` as a new `tf.function` once and returns {node name:
    (device, op type)} for every node of the graphs the runtime partitioned and ran (the devices
    it assigned, not the ones asked for). Uses the eager context's run metadata, which has no
    public API and reports a function's graphs only when it is instantiated, hence the new
    tf.function."""
    from tensorflow.python.eager import context

    ctx = context.context()
    ctx.enable_run_metadata()
    try:
        tf.function(python_function)(*args)
        metadata = ctx.export_run_metadata()
    finally:
        ctx.disable_run_metadata()
    return {node.name: (node.device, node.op)
            for graph in metadata.function_graphs
            for partition in graph.partition_graphs
            for node in partition.node}


# -- when each op ran ----------------------------------------------------------------------------
def profile_op_intervals(function, logdir: str) -> list[tuple[str, int, int]]:
    """Runs `function()` under the TensorFlow profiler and returns (node name, start ns, end ns)
    for every op kernel executed, read from the XSpace the profiler writes under `logdir` (its
    proto module is not part of the public API)."""
    import glob

    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    tf.profiler.experimental.start(logdir)
    try:
        function()
    finally:
        tf.profiler.experimental.stop()
    paths = sorted(glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True))
    if not paths:
        raise RuntimeError(f"The TensorFlow profiler wrote no trace under {logdir}.")
    space = xplane_pb2.XSpace()
    with open(paths[-1], "rb") as f:
        space.ParseFromString(f.read())
    out = []
    for plane in space.planes:
        names = plane.event_metadata
        for line in plane.lines:
            base = line.timestamp_ns * 1000
            for event in line.events:
                name = names[event.metadata_id].name
                if ":" not in name:  # op kernels are "node name:op type"
                    continue
                start = (base + event.offset_ps) // 1000
                out.append((name.split(":", 1)[0], start, start + event.duration_ps // 1000))
    return out
