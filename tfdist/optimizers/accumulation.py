"""`Accumulation`: k micro-batches per optimizer step, summed locally, exchanged once."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tfdist.arguments import check_bool, check_int
from tfdist.optimizers.parts import Part, register


@register("Accumulation")
class Accumulation(Part):
    """Gradient accumulation: `steps` consecutive calls (micro-steps) add their local gradients;
    the last one passes their mean on (to the exchange), so one optimizer step equals one step on
    a `steps` times larger batch. Works under MirroredStrategy + `fit`, where Keras' own
    `gradient_accumulation_steps` fails ("merge_call called while defining a new graph"): the
    conditional runs through the engine's replica-safe `cond`.

    Args:
        steps: Micro-steps per optimizer step. Defaults to 1.
        variable: Allow `set_steps` during training (Accordion's batch-size mode). Defaults to
            False.

    Example:
        ```python
        opt = tfdist.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                          tfdist.optimizers.Accumulation(4))
        model = build_model()
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # steps of 4 x 16 examples
        print(int(opt.iterations.numpy()), "optimizer steps")
        ```
    """

    keeps_gradient_units = True

    def __init__(self, steps: int = 1, variable: bool = False):
        self.steps = check_int("accumulation_steps", steps, 1)
        self.variable = check_bool("variable_accumulation", variable)
        self.buffers: list = []

    def build(self, owner, var_list, engine) -> None:
        self._micro_steps = owner.add_variable(
            shape=(), dtype="int64", initializer="zeros", aggregation="none", name="micro_steps")
        self._target = owner.add_variable(
            shape=(), dtype="int64", aggregation="none", name="accumulation_steps",
            initializer=lambda shape, dtype: tf.constant(self.steps, tf.int64))
        self.buffers = self.make_buffers(owner, var_list, engine)  # last: ZeRO hides its shard
        self.built = True

    def make_buffers(self, owner, var_list, engine) -> list:
        """One buffer per variable (ZeroOptimizer's stage 2 keeps one gradient shard instead)."""
        return [owner.add_variable_from_reference(v, name="accumulator") for v in var_list]

    def variables(self) -> list:
        return list(self.buffers) + [self._micro_steps, self._target] if self.built else []

    def per_replica_variables(self) -> list:
        return list(self.buffers)

    @property
    def current_steps(self) -> int:
        return int(self._target.numpy()) if self.built else self.steps

    def set_steps(self, steps: int) -> None:
        """Changes the micro-steps per optimizer step (eagerly, between steps). A pending
        accumulation completes as soon as it has `steps` micro-steps."""
        steps = check_int("steps", steps, 1)
        if not self.built:
            raise ValueError("The accumulation steps can change only once the optimizer is built.")
        self._target.assign(steps)

    # -- the step ------------------------------------------------------------------------------
    def step(self, ctx, grads, next) -> None:
        self.add(ctx, grads)
        micro = self._micro_steps + 1
        self._micro_steps.assign(micro)
        present = [g is not None for g in grads]

        def flush():  # reads this replica's buffers; captures no per-replica tensor
            self.flush(ctx, present, next)
            for buffer in self.buffers:
                buffer.assign(tf.zeros_like(buffer))
            self._micro_steps.assign(0)

        ctx.comm.cond(micro >= self._target, flush, lambda: None)

    def add(self, ctx, grads) -> None:
        """Adds one micro-batch's gradients to the buffers."""
        for v, g in zip(ctx.variables, grads):
            if g is not None:
                buffer = self.buffers[ctx.index(v)]
                buffer.assign_add(tf.cast(g, buffer.dtype))

    def flush(self, ctx, present, next) -> None:
        """Passes the micro-batches' mean on."""
        k = tf.cast(self._micro_steps, tf.float32)
        buffers = [self.buffers[ctx.index(v)] for v in ctx.variables]
        next(ctx, [b / tf.cast(k, b.dtype) if p else None for b, p in zip(buffers, present)])

    def get_config(self) -> dict[str, Any]:
        return {"steps": self.steps, "variable": self.variable}

    def __repr__(self) -> str:
        return f"Accumulation(steps={self.steps})"
