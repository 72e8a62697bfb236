"""`SumOverRanks`: the reduced gradient as the sum over replicas, not their mean."""

from __future__ import annotations

import tensorflow as tf

from tfdist.optimizers.parts import Part, on_values, register


@register("SumOverRanks")
class SumOverRanks(Part):
    """Hands the inner optimizer the *sum* of the replicas' gradients instead of their mean
    (the exchange averages; this multiplies its result by the number of replicas): Horovod's
    `op=hvd.Sum`. With plain SGD it equals the mean with the learning rate times the number of
    replicas; adaptive optimizers (Adam) barely notice the scale.

    Example:
        ```python
        opt = tfdist.DistributedOptimizer(keras.optimizers.SGD(0.01),
                                          tfdist.optimizers.SumOverRanks())
        ```
    """

    def passes_rows(self) -> bool:
        return True

    def step(self, ctx, grads, next) -> None:
        apply, world = ctx.apply, ctx.comm.world_size

        def summed(reduced):
            apply([None if g is None else on_values(lambda x: x * tf.cast(world, x.dtype), g)
                   for g in reduced])

        next(ctx.replace(apply=summed), grads)  # local SGD's local steps (apply_local) as they are

    def __repr__(self) -> str:
        return "SumOverRanks()"
