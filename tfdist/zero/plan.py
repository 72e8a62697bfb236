"""`ShardPlan`: every trainable parameter in one flat vector, split into N equal shards.

Tensors are sliced, not handed whole to ranks, so the shards balance to within one element:
with P parameters and N replicas every shard holds S = ceil(P / N) elements, the last one
padded with N S - P zeros.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf


class ShardPlan:
    """Flat layout of a list of tensors and its split into `world_size` shards.

    Args:
        shapes: The tensors' shapes, in order.
        world_size: Number of shards (replicas).
    """

    def __init__(self, shapes: Sequence, world_size: int):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"`world_size` must be an integer >= 1. Received: {world_size!r}")
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
