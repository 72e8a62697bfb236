"""Synchronous data parallelism as a Keras 3 optimizer wrapper, over any Communicator.

`DistributedOptimizer(inner)` all-reduces gradients through a `tfdist.comm.Communicator`
(counting every byte), optionally accumulates them over micro-steps first, optionally applies
dynamic loss scaling, and then lets the inner optimizer update the weights. The same class serves
both engines; only `_communicator()` and `_reduce_op` differ (see `tfdist.horovod`).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfdist.comm import (
    ByteCounter,
    Communicator,
    LocalCommunicator,
    ReplicaCommunicator,
    verify_same_model,
)
from tfdist.optimizers._keras_hooks import disable_gradient_all_reduce, replica_cond

LOSS_SCALE_MODES = ("auto", "dynamic", None)


@keras.saving.register_keras_serializable(package="tfdist")
class DistributedOptimizer(keras.optimizers.LossScaleOptimizer):
    """Wraps a Keras optimizer so that it trains synchronously over all replicas / workers.

    Under a `tf.distribute` strategy (MirroredStrategy, `tfdist.MultiWorkerMirroredStrategy`) the
    world is the strategy's replicas; with no strategy it is a single worker. The Horovod engine
    is the subclass `tfdist.horovod.DistributedOptimizer`.

    Gradients are all-reduced once per optimizer step through a Communicator whose byte counter
    is an optimizer variable: `bytes_sent` and `communication_rounds` survive checkpoints.

    Gradient accumulation: with `accumulation_steps=k`, `k` consecutive calls (micro-steps)
    accumulate local gradients; the k-th all-reduces their mean and applies it. One optimizer step
    then equals one step on a k times larger batch. This works under MirroredStrategy + `fit`,
    where Keras' own `gradient_accumulation_steps` fails.

    Loss scaling: this wrapper is a `LossScaleOptimizer` so that Keras does not wrap it again under
    the `mixed_float16` policy. Unlike Keras' own, it checks the *reduced* gradients for inf/NaN,
    so every worker makes the same skip decision (a per-worker decision would deadlock the next
    collective).

    Args:
        inner_optimizer: The Keras optimizer that updates the weights (not itself a
            `LossScaleOptimizer`).
        accumulation_steps: Micro-steps per optimizer step. Defaults to 1.
        loss_scale: `"dynamic"`, `None` (no loss scaling), or `"auto"`: dynamic when the global
            dtype policy is `mixed_float16` when this optimizer is created. Defaults to `"auto"`.
        initial_scale: Initial dynamic loss scale. Defaults to 2**15.
        dynamic_growth_steps: Finite steps before the scale doubles. Defaults to 2000.
        verify_model: All-gather a fingerprint of the model when the optimizer is built and raise
            a clear error on every worker if the workers' models differ. Defaults to True.
        name: Optional name.

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy()
        with strategy.scope():
            model = build_model()
            opt = tfdist.DistributedOptimizer(keras.optimizers.Adam(1e-3), accumulation_steps=4)
            model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
        model.fit(ds, epochs=3)
        print(opt.bytes_sent / opt.communication_rounds, "bytes per round")
        ```
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        accumulation_steps: int = 1,
        loss_scale: str | None = "auto",
        initial_scale: float = 2.0**15,
        dynamic_growth_steps: int = 2000,
        verify_model: bool = True,
        name: str | None = None,
    ):
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise ValueError(
                "`inner_optimizer` must be a Keras optimizer. "
                f"Received: inner_optimizer={inner_optimizer!r}"
            )
        if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
            raise ValueError(
                "`inner_optimizer` must not be a LossScaleOptimizer: pass its inner optimizer and "
                "`loss_scale='dynamic'` instead. "
                f"Received: inner_optimizer={type(inner_optimizer).__name__}"
            )
        if inner_optimizer.gradient_accumulation_steps:
            raise ValueError(
                "Set gradient accumulation on the wrapper (`accumulation_steps`), not on the inner "
                "optimizer. Received: inner_optimizer.gradient_accumulation_steps="
                f"{inner_optimizer.gradient_accumulation_steps}"
            )
        if isinstance(accumulation_steps, bool) or not isinstance(
            accumulation_steps, (int, np.integer)
        ) or accumulation_steps < 1:
            raise ValueError(
                "`accumulation_steps` must be an integer >= 1. "
                f"Received: accumulation_steps={accumulation_steps!r}"
            )
        if loss_scale not in LOSS_SCALE_MODES:
            raise ValueError(
                f"`loss_scale` must be one of {LOSS_SCALE_MODES}. Received: loss_scale={loss_scale!r}"
            )
        inner_scale_factor = inner_optimizer.loss_scale_factor
        super().__init__(
            inner_optimizer,
            initial_scale=initial_scale,
            dynamic_growth_steps=dynamic_growth_steps,
            name=name,
        )
        self.accumulation_steps = int(accumulation_steps)
        self.loss_scale = loss_scale
        self.verify_model = verify_model
        self.dynamic = loss_scale == "dynamic" or (
            loss_scale == "auto" and keras.config.dtype_policy().name == "mixed_float16"
        )
        if not self.dynamic:
            # LossScaleOptimizer cleared it; without dynamic scaling the user's factor stands.
            self.inner_optimizer.loss_scale_factor = inner_scale_factor
        disable_gradient_all_reduce(self.inner_optimizer)

    # -- engine hooks (overridden by the Horovod engine) --------------------------------------
    # Keras divides the loss by the number of replicas under a strategy, so a SUM is the mean.
    _reduce_op = "sum"

    def _communicator(self) -> Communicator:
        counter = ByteCounter(self._bytes_sent)
        strategy = tf.distribute.get_strategy()
        if strategy.num_replicas_in_sync > 1:
            return ReplicaCommunicator(strategy, counter)
        return LocalCommunicator(counter)

    def _verify_same_model(self, var_list) -> None:
        strategy = tf.distribute.get_strategy()
        if strategy.num_replicas_in_sync == 1:
            return

        def run(fn):
            return strategy.experimental_local_results(strategy.run(fn))[0]

        verify_same_model(var_list, ReplicaCommunicator(strategy), run=run)

    # -- Keras optimizer API -------------------------------------------------------------------
    def build(self, var_list):
        self._bytes_sent = self.add_variable(
            shape=(), dtype="float64", initializer="zeros", aggregation="none", name="bytes_sent"
        )
        self._rounds = self.add_variable(
            shape=(), dtype="int64", initializer="zeros", aggregation="none",
            name="communication_rounds",
        )
        self._accumulators = []
        if self.accumulation_steps > 1:
            self._accumulators = [
                self.add_variable_from_reference(v, name="accumulator") for v in var_list
            ]
        if self.verify_model and tf.executing_eagerly():
            self._verify_same_model(var_list)
        super().build(var_list)

    @property
    def bytes_sent(self) -> float:
        """Total bytes this worker has sent (ring-algorithm accounting, see `tfdist.comm`)."""
        return float(self._bytes_sent.numpy()) if self.built else 0.0

    @property
    def communication_rounds(self) -> int:
        """How many times gradients were exchanged."""
        return int(self._rounds.numpy()) if self.built else 0

    def scale_loss(self, loss):
        if self.dynamic:
            return super().scale_loss(loss)
        return self.inner_optimizer.scale_loss(loss)

    def apply(self, grads, trainable_variables=None):
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        if tf.distribute.in_cross_replica_context():
            raise ValueError("apply() must be called in a replica context.")
        variables = list(trainable_variables or self._trainable_variables)
        grads = list(grads)
        comm = self._communicator()
        if self.accumulation_steps == 1:
            self._reduce_and_apply(comm, grads, variables)
        else:
            self._accumulate(comm, grads, variables)
        self._iterations.assign_add(1)

    def _accumulate(self, comm, grads, variables):
        k = self.accumulation_steps
        accs = [self._accumulators[self._get_variable_index(v)] for v in variables]
        for acc, g in zip(accs, grads):
            if g is not None:
                acc.assign_add(tf.cast(g, acc.dtype))
        boundary = tf.equal((self._iterations + 1) % k, 0)

        def step():  # reads this replica's accumulators; captures no per-replica tensor
            mean = [None if g is None else acc / k for acc, g in zip(accs, grads)]
            self._reduce_and_apply(comm, mean, variables)
            for acc in accs:
                acc.assign(tf.zeros_like(acc))

        replica_cond(boundary, step, lambda: None)

    def _reduce_and_apply(self, comm, grads, variables):
        present = [g for g in grads if g is not None]
        reduced = iter(comm.all_reduce(present, op=self._reduce_op))
        grads = [None if g is None else next(reduced) for g in grads]
        self._rounds.assign_add(1)
        if not self.dynamic:
            self.inner_optimizer.apply(grads, variables)
            return
        scale = self.dynamic_scale
        present = [i for i, g in enumerate(grads) if g is not None]
        unscaled = [grads[i] / tf.cast(scale, grads[i].dtype) for i in present]
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in unscaled])

        def apply_finite(*unscaled):
            full = [None] * len(grads)
            for i, g in zip(present, unscaled):
                full[i] = g
            self.inner_optimizer.apply(full, variables)
            count = tf.convert_to_tensor(self.step_counter)
            grow = tf.equal(count, self.dynamic_growth_steps - 1)
            self.step_counter.assign(tf.where(grow, tf.zeros_like(count), count + 1))
            self.dynamic_scale.assign(tf.where(grow, scale * 2.0, scale))

        def skip_non_finite(*unscaled):
            self.step_counter.assign(0)
            self.dynamic_scale.assign(scale * 0.5)

        # Per-replica tensors go through `args`, not closures (see replica_cond).
        replica_cond(finite, apply_finite, skip_non_finite, args=unscaled)

    def get_config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "accumulation_steps": self.accumulation_steps,
            "loss_scale": self.loss_scale,
            "initial_scale": self.initial_scale,
            "dynamic_growth_steps": self.dynamic_growth_steps,
            "verify_model": self.verify_model,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)
