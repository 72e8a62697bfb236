"""`ShardPlan`: every trainable parameter in one flat vector, split into N equal shards
(`LayerShardPlan`: the same per layer, for ZeRO stage 3).

Tensors are sliced, not handed whole to ranks, so the shards balance to within one element:
with P parameters and N replicas every shard holds S = ceil(P / N) elements, the last one
padded with N S - P zeros.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from tfdist.arguments import check_int


class ShardPlan:
    """Flat layout of a list of tensors and its split into `world_size` shards.

    Args:
        shapes: The tensors' shapes, in order.
        world_size: Number of shards (replicas).

    Example:
        ```python
        plan = tfdist.zero.ShardPlan([(64, 10), (10,)], world_size=4)
        print(plan.total, plan.shard_size, plan.padding)  # 650 elements: 4 shards of 163, 2 pad
        flat = plan.flatten([tf.ones((64, 10)), tf.zeros((10,))])
        print(flat.shape)  # (652,)
        ```
    """

    def __init__(self, shapes: Sequence, world_size: int):
        check_int("world_size", world_size, 1)
        self.shapes = [tf.TensorShape(s) for s in shapes]
        for s in self.shapes:
            if not s.is_fully_defined():
                raise ValueError(f"Sharding needs fully defined shapes; got {s}.")
        self.sizes = [int(s.num_elements()) for s in self.shapes]
        self.world_size = world_size
        self.total = sum(self.sizes)
        self.shard_size = -(-self.total // world_size)  # ceil(P / N)
        self.padding = self.shard_size * world_size - self.total

    def flatten(self, tensors: Sequence) -> tf.Tensor:
        """One padded float32 vector of N S elements (None entries count as zeros)."""
        parts = [tf.zeros([n], tf.float32) if t is None else tf.reshape(tf.cast(t, tf.float32), [-1])
                 for t, n in zip(tensors, self.sizes)]
        return tf.concat(parts + [tf.zeros([self.padding], tf.float32)], axis=0)

    def unflatten(self, flat) -> list[tf.Tensor]:
        """Inverse of `flatten`: the tensors, in their shapes (padding dropped)."""
        parts = tf.split(flat[:self.total], self.sizes)
        return [tf.reshape(p, s) for p, s in zip(parts, self.shapes)]

    def shard(self, flat, rank) -> tf.Tensor:
        """Shard `rank` (an int or a scalar tensor) of a flat padded vector."""
        start = tf.cast(rank, tf.int32) * self.shard_size
        return tf.slice(flat, [start], [self.shard_size])

    # -- host-side (checkpoints) ---------------------------------------------------------------
    def consolidate(self, shards: Sequence[np.ndarray]) -> np.ndarray:
        """The unpadded length-P vector from every replica's shard, in rank order."""
        if len(shards) != self.world_size:
            raise ValueError(f"Need all {self.world_size} shards to consolidate; got {len(shards)}.")
        return np.concatenate([np.asarray(s) for s in shards])[:self.total]

    def split(self, full: np.ndarray) -> list[np.ndarray]:
        """Inverse of `consolidate`: this plan's N shards of a length-P vector."""
        full = np.asarray(full).reshape(-1)
        if full.size != self.total:
            raise ValueError(f"Expected {self.total} values to shard; got {full.size}.")
        padded = np.concatenate([full, np.zeros(self.padding, full.dtype)])
        return [padded[r * self.shard_size:(r + 1) * self.shard_size]
                for r in range(self.world_size)]


class LayerShardPlan:
    """ZeRO stage 3's layout: each layer's parameters sharded on their own (a `ShardPlan` per
    layer), so one layer can be all-gathered at a time. Replica r holds shard r of every layer,
    concatenated: `shard_size` = sum over layers of ceil(P_l / N).

    `consolidate` and `split` speak of the length-P vector of all parameters in layer order,
    as `ShardPlan`'s do, so checkpoint code serves both layouts.

    Args:
        groups: Each layer's parameter shapes, in order.
        world_size: Number of shards (replicas).

    Example:
        ```python
        plan = tfdist.zero.LayerShardPlan([[(64, 32), (32,)], [(32, 10), (10,)]], world_size=2)
        print([layer.shard_size for layer in plan.layers], plan.shard_size)  # [1040, 165] 1205
        ```
    """

    def __init__(self, groups: Sequence[Sequence], world_size: int):
        self.layers = [ShardPlan(shapes, world_size) for shapes in groups]
        self.world_size = world_size
        self.total = sum(p.total for p in self.layers)
        self.shard_size = sum(p.shard_size for p in self.layers)
        self.padding = self.shard_size * world_size - self.total
        self.offsets = np.cumsum([0] + [p.shard_size for p in self.layers])[:-1].tolist()

    def layer_shard(self, shard, index: int) -> tf.Tensor:
        """Layer `index`'s part of a replica's shard."""
        start = self.offsets[index]
        return shard[start:start + self.layers[index].shard_size]

    @property
    def largest_layer(self) -> int:
        """Elements of the largest all-gathered layer (padding included)."""
        return max((p.shard_size * self.world_size for p in self.layers), default=0)

    def consolidate(self, shards: Sequence[np.ndarray]) -> np.ndarray:
        if len(shards) != self.world_size:
            raise ValueError(f"Need all {self.world_size} shards to consolidate; got {len(shards)}.")
        shards = [np.asarray(s).reshape(-1) for s in shards]
        return np.concatenate([np.zeros(0, np.float32)] + [
            plan.consolidate([s[start:start + plan.shard_size] for s in shards])
            for plan, start in zip(self.layers, self.offsets)])

    def split(self, full: np.ndarray) -> list[np.ndarray]:
        full = np.asarray(full).reshape(-1)
        if full.size != self.total:
            raise ValueError(f"Expected {self.total} values to shard; got {full.size}.")
        bounds = np.cumsum([0] + [p.total for p in self.layers])
        per_layer = [plan.split(full[a:b]) for plan, a, b in
                     zip(self.layers, bounds[:-1], bounds[1:])]
        return [np.concatenate([np.zeros(0, full.dtype)] + [parts[r] for parts in per_layer])
                for r in range(self.world_size)]


def record_parameter_shard(variable, plan: LayerShardPlan) -> None:
    """Marks `variable` (a `ShardedModel`'s own) as a ZeRO stage 3 parameter shard laid out by
    `plan`: the variable carries its plan, for `ZeroOptimizer(stage=3)` to read when it is
    built on it."""
    variable._tfdist_shard_plan = plan


def parameter_shard_plan(variable) -> LayerShardPlan | None:
    """The plan of `variable` if it is a stage 3 parameter shard (`record_parameter_shard`)."""
    return getattr(variable, "_tfdist_shard_plan", None)
