"""`DynamicLossScaling`: dynamic loss scaling whose skip decision every worker shares."""

from __future__ import annotations

import tensorflow as tf

from tfdist.comm.holes import Holes
from tfdist.optimizers.nan_policy import KeptState, all_finite, zero_nonfinite
from tfdist.optimizers.parts import Part, on_values


class DynamicLossScaling(Part):
    """Undoes the loss scale on this replica's gradients, and applies the *reduced* gradients
    only if they are all finite (else halves the scale and skips the step).

    Keras' `LossScaleOptimizer` decides per worker from its local gradients; one worker would then
    skip a collective the others enter. The reduced gradients are the same everywhere, so every
    worker decides alike. The scale and its growth counter are the owner's (a
    `keras.optimizers.LossScaleOptimizer`: `dynamic_scale`, `step_counter`,
    `dynamic_growth_steps`). Gradients are unscaled first, so error-feedback state does not
    depend on the loss scale.

    Example:
        ```python
        opt = tfdist.DistributedOptimizer(keras.optimizers.Adam(), loss_scale="dynamic")
        print(opt.chain.parts[0])  # DynamicLossScaling(): the wrapper puts it first
        ```
    """

    kept: KeptState | None = None  # set by DistributedOptimizer.skip_also

    def build(self, owner, var_list, engine) -> None:
        if self.kept is not None:
            self.kept.build(owner)
        self.built = True

    def variables(self) -> list:
        return self.kept.variables_created() if self.kept is not None else []

    def passes_rows(self) -> bool:
        return True

    def step(self, ctx, grads, next) -> None:
        owner = ctx.owner
        scale = owner.dynamic_scale
        unscaled = [on_values(lambda x: x / tf.cast(scale, x.dtype), g) for g in grads]
        apply = ctx.apply
        kept = self.kept if self.kept is not None and self.kept.shadows else None

        def apply_if_finite(reduced):
            holes = Holes(reduced)
            finite = all_finite(holes.values)

            def apply_finite(*values):
                apply(holes.refill(values))
                count = tf.convert_to_tensor(owner.step_counter)
                grow = tf.equal(count, owner.dynamic_growth_steps - 1)
                owner.step_counter.assign(tf.where(grow, tf.zeros_like(count), count + 1))
                owner.dynamic_scale.assign(tf.where(grow, scale * 2.0, scale))
                if kept is not None:
                    kept.commit()

            def skip_non_finite(*values):
                owner.step_counter.assign(0)
                owner.dynamic_scale.assign(scale * 0.5)
                if kept is not None:
                    kept.restore()

            # Per-replica tensors go through `args`, not closures (see Communicator.cond).
            ctx.comm.cond(finite, apply_finite, skip_non_finite, args=holes.values)

        def apply_local(local):  # one replica's own gradients: no shared decision possible
            (ctx.apply_local or apply)(zero_nonfinite(local))

        next(ctx.replace(apply=apply_if_finite, apply_local=apply_local), unscaled)

    def __repr__(self) -> str:
        return "DynamicLossScaling()"
