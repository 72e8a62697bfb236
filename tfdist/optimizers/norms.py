"""`TrackNorms`: each tensor's local gradient norm per micro-batch (what Accordion reads)."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfdist.optimizers.parts import Part, dense_gradient, register


@register("TrackNorms")
class TrackNorms(Part):
    """Accumulates, per variable, the squared norm of each micro-batch's local gradient (after
    loss scaling is undone, before accumulation), so `tfdist.callbacks.Accordion` can detect
    critical regimes from norms independent of the batch size.

    Example:
        ```python
        norms = tfdist.optimizers.TrackNorms()
        model = build_model()
        model.compile(optimizer=tfdist.DistributedOptimizer(keras.optimizers.SGD(0.1), norms),
                      loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=64, epochs=1, verbose=0)
        print(norms.mean_gradient_norms())  # one RMS norm per variable
        ```
    """

    keeps_gradient_units = True

    def build(self, owner, var_list, engine) -> None:
        self.grad_sq = {index: owner.add_variable(shape=(), dtype="float32", aggregation="none",
                                                  initializer="zeros", name="grad_sq")
                        for index in range(len(var_list))}
        self.samples = owner.add_variable(shape=(), dtype="int64", aggregation="none",
                                          initializer="zeros", name="norm_samples")
        self.built = True

    def variables(self) -> list:
        return [*self.grad_sq.values(), self.samples] if self.built else []

    def passes_rows(self) -> bool:
        return True  # the norm of the rows' sum

    def step(self, ctx, grads, next) -> None:
        for g, v in zip(grads, ctx.variables):
            if g is not None:  # rows on their way to the exchange: the norm of their sum
                g = tf.cast(dense_gradient(g, v), tf.float32)
                self.grad_sq[ctx.index(v)].assign_add(tf.reduce_sum(tf.square(g)))
        self.samples.assign_add(1)
        next(ctx, grads)

    def mean_gradient_norms(self) -> np.ndarray:
        """RMS over the micro-batches since `reset` of each tensor's local gradient norm."""
        samples = max(int(self.samples.numpy()), 1)
        return np.sqrt([float(self.grad_sq[i].numpy()) / samples for i in sorted(self.grad_sq)])

    def reset(self) -> None:
        for v in self.grad_sq.values():
            v.assign(0.0)
        self.samples.assign(0)

    def __repr__(self) -> str:
        return "TrackNorms()"
