"""`NanPolicy`: what a step does with non-finite gradients when no loss scaling decides.

Under `mixed_float16` the loss scaling part skips such steps (and lowers the scale). In float32
a NaN or inf gradient would otherwise reach the weights, while the loss Keras reports can stay
finite. The check runs on the *reduced* gradients, the same on every worker, so every worker
takes the same decision; on failure the workers all-reduce a flag per rank (in the failing
branch only: no cost while gradients are finite), so the error names the ranks whose own
gradients were non-finite.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tfdist.comm.holes import Holes
from tfdist.optimizers.parts import Part

POLICIES = ("raise", "skip")


_WIDE = (tf.float32, tf.float64, tf.bfloat16)  # an 8-bit or wider exponent


def all_finite(tensors) -> tf.Tensor:
    """Whether every element of `tensors` is finite (rows of a `tf.IndexedSlices` included).

    A sum is finite only if every term is (a NaN or an infinity makes it NaN or infinite), so
    one pass that sums each tensor, with no temporary, proves most steps finite. A sum that is
    not finite may also be an overflow of finite values: only then, and for float16 tensors
    (whose sums overflow at 65504), are the elements themselves checked. Exact either way."""
    tensors = [t.values if isinstance(t, tf.IndexedSlices) else t
               for t in tensors if t is not None]
    if not tensors:
        return tf.constant(True)

    def elementwise(ts):
        return tf.reduce_all([tf.reduce_all(tf.math.is_finite(t)) for t in ts])

    wide = [t for t in tensors if t.dtype in _WIDE]
    if not wide:
        return elementwise(tensors)
    summed = tf.math.is_finite(tf.add_n([tf.cast(tf.reduce_sum(t), tf.float64) for t in wide]))
    narrow = [t for t in tensors if t.dtype not in _WIDE]
    if narrow:
        summed = tf.logical_and(summed, elementwise(narrow))
    return tf.cond(summed, lambda: tf.constant(True), lambda: elementwise(tensors))


def zero_nonfinite(grads) -> list:
    """The gradients with their non-finite elements replaced by zeros (None stays None)."""
    return [None if g is None else tf.where(tf.math.is_finite(g), g, tf.zeros_like(g))
            for g in grads]


def report_nonfinite(comm, policy: str, step, mine,
                     instead: str = "nan_policy='skip' (or loss scaling)") -> None:
    """Inside the branch every worker takes on a non-finite step: under "raise", all-reduces
    each rank's flag (`mine`: a one-hot row, 1 in this rank's slot if its own gradients were
    non-finite) and fails naming the step and those ranks (and `instead`, what skips them)."""
    if policy == "raise":
        (ranks,) = comm.all_reduce([mine])
        tf.debugging.Assert(tf.constant(False), [
            "tfdist: non-finite gradients at optimizer step", step,
            "; ranks whose own gradients were non-finite (1 = yes):", ranks,
            f"; {instead} skips such steps instead"], summarize=comm.world_size)


def own_flag(comm, grads) -> tf.Tensor:
    """This rank's row for `report_nonfinite`."""
    return tf.one_hot(tf.cast(comm.rank, tf.int32), comm.world_size) * tf.cast(
        tf.logical_not(all_finite(grads)), tf.float32)


class KeptState:
    """Variables outside the optimizer's reach that a skipped step must leave as they were: the
    model's non-trainable variables (BatchNorm's moving statistics are updated by the forward
    pass, before the optimizer sees the gradients). Each has a shadow copy holding its value as of
    the last applied step: an applied step refreshes the shadows, a skipped one restores from
    them, on every replica (each replica's own copy where copies differ)."""

    def __init__(self, variables):
        self.variables = list(variables)
        self.shadows: list = []

    def build(self, owner) -> None:
        """Creates the shadows as variables of `owner` (so backups carry them), each holding its
        variable's value."""
        self.shadows = []
        for v in self.variables:
            shadow = owner.add_variable(shape=v.shape, dtype=v.dtype, initializer="zeros",
                                        aggregation="none",
                                        name=f"kept_{v.name.replace('/', '_')}")
            shadow.assign(v)
            self.shadows.append(shadow)

    def variables_created(self) -> list:
        return list(self.shadows)

    def commit(self) -> None:
        for shadow, v in zip(self.shadows, self.variables):
            shadow.assign(v)

    def restore(self) -> None:
        for shadow, v in zip(self.shadows, self.variables):
            v.assign(shadow)


class NanPolicy(Part):
    """Non-finite gradients stop training with an error (`"raise"`, the default) or skip the
    step on every worker (`"skip"`; counted in `skipped_steps`).

    The error names the optimizer step and, per rank, whether its own gradients were
    non-finite. A local SGD local step (each replica on its own gradients) checks that
    replica's gradients alone: `"raise"` raises on it, `"skip"` applies zeros in place of its
    non-finite gradients.

    Args:
        policy: "raise" or "skip". Defaults to "raise".

    Example:
        ```python
        opt = tfdist.DistributedOptimizer(keras.optimizers.SGD(0.1), nan_policy="skip")
        model = build_model()
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=64, epochs=1, verbose=0)
        print(opt.chain.part(tfdist.optimizers.NanPolicy).skipped_steps, "steps skipped")
        ```
    """

    def __init__(self, policy: str = "raise"):
        if policy not in POLICIES:
            raise ValueError(f"`nan_policy` must be one of {POLICIES}. Received: "
                             f"nan_policy={policy!r}")
        self.policy = policy
        self.kept: KeptState | None = None  # set by DistributedOptimizer.skip_also

    def build(self, owner, var_list, engine) -> None:
        self._skipped = owner.add_variable(shape=(), dtype="int64", initializer="zeros",
                                           aggregation="none", name="nonfinite_steps_skipped")
        if self.kept is not None and self.policy == "skip":
            self.kept.build(owner)
        self.built = True

    def variables(self) -> list:
        kept = self.kept.variables_created() if self.kept is not None else []
        return [self._skipped, *kept] if self.built else []

    def passes_rows(self) -> bool:
        return True

    @property
    def skipped_steps(self) -> int:
        return int(self._skipped.numpy()) if self.built else 0

    def step(self, ctx, grads, next) -> None:
        comm, policy = ctx.comm, self.policy
        # This replica's own gradients, for the failing branch's report only (not a pass over
        # them on every step); rows as their values (cond arguments are tensors).
        local = [g.values if isinstance(g, tf.IndexedSlices) else g
                 for g in grads if g is not None]
        step = tf.convert_to_tensor(ctx.owner.iterations)
        apply = ctx.apply

        def checked(reduced):
            holes = Holes(reduced)

            n = len(holes.values)

            kept = self.kept if self.kept is not None and self.kept.shadows else None

            def finite(*args):
                apply(holes.refill(args[:n]))
                if kept is not None:
                    kept.commit()

            def non_finite(*args):  # every worker is in this branch
                report_nonfinite(comm, policy, step, own_flag(comm, args[n:]))
                self._skipped.assign_add(1)
                if kept is not None:
                    kept.restore()

            comm.cond(all_finite(holes.values), finite, non_finite, args=[*holes.values, *local])

        def checked_local(local):
            ok = all_finite(local)
            if policy == "raise":
                tf.debugging.Assert(ok, ["tfdist: non-finite local gradients at optimizer step",
                                         step, "on replica", comm.rank])
                (ctx.apply_local or apply)(local)
            else:
                (ctx.apply_local or apply)(zero_nonfinite(local))

        next(ctx.replace(apply=checked, apply_local=checked_local), grads)

    def get_config(self) -> dict[str, Any]:
        return {"policy": self.policy}

    def __repr__(self) -> str:
        return f"NanPolicy({self.policy!r})"
