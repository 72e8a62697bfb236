"""Skip connections across pipeline stages.

`Stash("name")` marks the tensor flowing past it; a later `Pop("name")` merges it back into the
main path (added, or concatenated on the last axis). Inside a `Pipeline` the stashed tensor goes
straight from the stashing stage's device to the popping stage's device, and its gradient straight
back: the stages in between neither copy it nor keep it.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
import tensorflow as tf

__all__ = ["Stash", "Pop", "SkipRoutes", "route_skips"]

MERGES = ("add", "concat")


@keras.saving.register_keras_serializable(package="tfdist")
class Stash(keras.layers.Layer):
    """Passes its input through unchanged and keeps it under `skip` for a later `Pop`.

    Example:
        ```python
        stages = [[keras.layers.Flatten(), keras.layers.Dense(64), tfdist.pipeline.Stash("skip")],
                  [keras.layers.Dense(64), tfdist.pipeline.Pop("skip"), keras.layers.Dense(10)]]
        pipe = tfdist.pipeline.Pipeline(stages, devices=tfdist.devices.local_devices(2))
        print(pipe(x[:4]).shape)  # stage 2 adds stage 1's output back (a residual across stages)
        ```
    """

    def __init__(self, skip: str, **kwargs):
        super().__init__(**kwargs)
        if not isinstance(skip, str) or not skip:
            raise ValueError(f"Stash needs a non-empty skip name, got {skip!r}.")
        self.skip = skip

    def call(self, inputs):
        return inputs

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "skip": self.skip}


@keras.saving.register_keras_serializable(package="tfdist")
class Pop(keras.layers.Layer):
    """Merges the tensor stashed under `skip` into its input: `merge="add"` or `"concat"`.

    Example:
        ```python
        stages = [[keras.layers.Flatten(), keras.layers.Dense(64), tfdist.pipeline.Stash("skip")],
                  [keras.layers.Dense(64), tfdist.pipeline.Pop("skip", merge="concat"),
                   keras.layers.Dense(10)]]
        pipe = tfdist.pipeline.Pipeline(stages, devices=tfdist.devices.local_devices(2))
        print(pipe(x[:4]).shape)
        ```
    """

    def __init__(self, skip: str, merge: str = "add", **kwargs):
        super().__init__(**kwargs)
        if not isinstance(skip, str) or not skip:
            raise ValueError(f"Pop needs a non-empty skip name, got {skip!r}.")
        if merge not in MERGES:
            raise ValueError(f"Pop merge={merge!r} is not one of {MERGES}.")
        self.skip, self.merge = skip, merge

    def call(self, inputs):
        x, stashed = inputs
        if self.merge == "add":
            return x + stashed
        return tf.concat([x, stashed], axis=-1)

    def compute_output_shape(self, input_shape):
        shape, stashed = input_shape
        if self.merge == "add":
            return shape
        last = None if shape[-1] is None or stashed[-1] is None else shape[-1] + stashed[-1]
        return (*shape[:-1], last)

    def get_config(self):
        return {**super().get_config(), "skip": self.skip, "merge": self.merge}


class SkipRoutes:
    """Where each skip crosses stages: `outgoing[j]` are the names stage j stashes for a later
    stage, `incoming[j]` those stage j pops from an earlier one."""

    def __init__(self, num_stages: int):
        self.outgoing: list[list[str]] = [[] for _ in range(num_stages)]
        self.incoming: list[list[str]] = [[] for _ in range(num_stages)]
        self.source: dict[str, int] = {}


def route_skips(stages: Sequence[Sequence[keras.layers.Layer]]) -> SkipRoutes:
    """Checks that every skip is stashed once, then popped once, later in the layer order."""
    routes = SkipRoutes(len(stages))
    open_skips: dict[str, tuple[int, int]] = {}
    seen: set[str] = set()
    for j, stage in enumerate(stages):
        for position, layer in enumerate(stage):
            where = f"stage {j}, layer {position} ({layer.name})"
            if isinstance(layer, Stash):
                if layer.skip in seen:
                    raise ValueError(f"Skip {layer.skip!r} is stashed twice (again at {where}): "
                                     "give each skip connection its own name.")
                seen.add(layer.skip)
                open_skips[layer.skip] = (j, position)
            elif isinstance(layer, Pop):
                if layer.skip not in open_skips:
                    if layer.skip in seen:
                        raise ValueError(f"Skip {layer.skip!r} is popped twice (again at {where}): "
                                         "a stashed tensor is popped exactly once.")
                    raise ValueError(f"Skip {layer.skip!r} is popped at {where} before it is "
                                     "stashed: put Stash(" f"{layer.skip!r}) in an earlier layer "
                                     "or stage than its Pop.")
                source, _ = open_skips.pop(layer.skip)
                if source != j:
                    routes.outgoing[source].append(layer.skip)
                    routes.incoming[j].append(layer.skip)
                    routes.source[layer.skip] = source
    if open_skips:
        name, (j, position) = next(iter(open_skips.items()))
        raise ValueError(f"Skip {name!r} is stashed at stage {j}, layer {position} but never "
                         f"popped: add Pop({name!r}) after it, or remove the Stash.")
    return routes
