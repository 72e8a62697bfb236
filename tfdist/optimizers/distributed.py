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

from tfdist.averaging.model_averaging import ModelAveraging, optimizer_slots
from tfdist.averaging.schedule import SMA, HierarchicalSchedule, PeriodicSchedule, SlowMo
from tfdist.comm import (
    Communicator,
    LocalCommunicator,
    ReplicaCommunicator,
    verify_same_model,
)
from tfdist.comm.control import Holes, replica_cond
from tfdist.comm.eager import eager_collectives
from tfdist.optimizers._keras_hooks import disable_gradient_all_reduce
from tfdist.optimizers.exchange import GradientExchange

LOSS_SCALE_MODES = ("auto", "dynamic", None)


def _replica_copies(var) -> list:
    """The per-device components of a (possibly mirrored) variable."""
    value = getattr(var, "value", var)
    return list(value.values) if isinstance(value, tf.distribute.DistributedValues) else [value]


@keras.saving.register_keras_serializable(package="tfdist")
class DistributedOptimizer(keras.optimizers.LossScaleOptimizer):
    """Wraps a Keras optimizer so that it trains synchronously over all replicas / workers.

    Under a `tf.distribute` strategy (MirroredStrategy, `tfdist.MultiWorkerMirroredStrategy`) the
    world is the strategy's replicas; with no strategy it is a single worker. The Horovod engine
    is the subclass `tfdist.horovod.DistributedOptimizer`.

    Gradients are all-reduced once per optimizer step through a Communicator whose byte counter
    is an optimizer variable: `bytes_sent` and `communication_rounds` survive checkpoints.

    Compression: with `compressor=...` each large enough tensor is compressed (its state, e.g.
    error-feedback residuals, is optimizer variables, so checkpoints carry it); summable payloads
    are all-reduced, the others all-gathered; the rest is all-reduced dense in one call.

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
        compressor: A `tfdist.compression` compressor (or its registry name / config) for the
            gradient exchange. Defaults to None (dense all-reduce).
        min_compress_size: Tensors with fewer elements are sent dense. Defaults to 1024.
        compress_1d: Also compress 1-D tensors (biases, norms). Defaults to False.
        compression_start_step: Exchanges sent dense before compression starts. Defaults to 0.
        track_norms: Track each tensor's gradient norm (for `tfdist.callbacks.Accordion`).
        variable_accumulation: Allow `set_accumulation_steps` during training (Accordion's
            batch-size mode). Defaults to False.
        local_sgd: A `tfdist.averaging.PeriodicSchedule(period, warmup_steps)`: after the
            synchronous warm-up, replicas step locally and average their models every `period`
            steps (post-local SGD). Trainable variables are averaged; call `average_also(...)`
            with the model's non-trainable variables (BatchNorm statistics) to average those
            too. A `HierarchicalSchedule(intra, inter, warmup_steps, host_size)` averages within
            each host every `intra` steps and over all replicas every `inter` steps (on Horovod,
            call `tfdist.horovod.init(process_sets="dynamic")`). Defaults to None (synchronous
            every step).
        slowmo: A `tfdist.averaging.SlowMo(momentum, learning_rate)`: slow momentum on the
            averaged model at each averaging round (needs `local_sgd`). Defaults to None.
        averaging_topology: "all" (exact model average) or "ring" (decentralized gossip with the
            two ring neighbours). Defaults to "all".
        sma: A `tfdist.averaging.SMA(alpha, momentum)`: Crossbow's synchronous model averaging,
            replicas pulled toward a central model at each round (needs `local_sgd`).
        average_optimizer_state: Also average the inner optimizer's slots (momentum, Adam
            moments) at each round. Defaults to False: optimizer state stays local.
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
        compressor=None,
        min_compress_size: int = 1024,
        compress_1d: bool = False,
        compression_start_step: int = 0,
        track_norms: bool = False,
        variable_accumulation: bool = False,
        local_sgd: PeriodicSchedule | HierarchicalSchedule | None = None,
        slowmo: SlowMo | None = None,
        averaging_topology: str = "all",
        sma: SMA | None = None,
        average_optimizer_state: bool = False,
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
        exchange = GradientExchange(compressor, min_compress_size, compress_1d,
                                    compression_start_step, track_norms)
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
        self.exchange = exchange
        self.variable_accumulation = bool(variable_accumulation)
        for arg, value in (("slowmo", slowmo), ("sma", sma),
                           ("average_optimizer_state", average_optimizer_state or None)):
            if value is not None and local_sgd is None:
                raise ValueError(f"`{arg}` needs `local_sgd`. "
                                 f"Received: {arg}={value!r}, local_sgd=None")
        self.averaging = (None if local_sgd is None
                          else ModelAveraging(local_sgd, slowmo, averaging_topology, sma,
                                              average_optimizer_state))
        if local_sgd is not None and exchange.compressor is not None:
            raise ValueError("Use either `compressor` or `local_sgd`, not both.")
        if local_sgd is not None and (accumulation_steps > 1 or variable_accumulation):
            raise ValueError("`local_sgd` does not combine with gradient accumulation yet: use "
                             "accumulation_steps=1 (a longer averaging period has the same "
                             "effect on communication).")
        self.local_sgd = local_sgd
        self.slowmo = slowmo
        self.dynamic = loss_scale == "dynamic" or (
            loss_scale == "auto" and keras.config.dtype_policy().name == "mixed_float16"
        )
        if not self.dynamic:
            # LossScaleOptimizer cleared it; without dynamic scaling the user's factor stands.
            self.inner_optimizer.loss_scale_factor = inner_scale_factor
        disable_gradient_all_reduce(self.inner_optimizer)

    _tfdist_no_exchange = True  # a strategy's exchange must not attach to the wrapper itself

    # -- engine hooks (overridden by the Horovod engine) --------------------------------------
    # Keras divides the loss by the number of replicas under a strategy, so a SUM is the mean.
    _reduce_op = "sum"

    def _communicator(self) -> Communicator:
        counter = self.exchange.counter()
        strategy = tf.distribute.get_strategy()
        if strategy.num_replicas_in_sync > 1:
            return ReplicaCommunicator(strategy, counter)
        return LocalCommunicator(counter)

    def _verify_same_model(self, var_list) -> None:
        strategy = tf.distribute.get_strategy()
        if strategy.num_replicas_in_sync > 1:
            comm, run = eager_collectives(strategy)
            verify_same_model(var_list, comm, run=run)

    # -- Keras optimizer API -------------------------------------------------------------------
    def build(self, var_list):
        self.exchange.build(self, var_list)
        if self.averaging is not None:
            self.averaging.build(self, var_list)
        self._accumulators = []
        if self.accumulation_steps > 1 or self.variable_accumulation:
            self._build_accumulation(
                [self.add_variable_from_reference(v, name="accumulator") for v in var_list])
        if self.verify_model and tf.executing_eagerly():
            self._verify_same_model(var_list)
        super().build(var_list)
        if self.averaging is not None:
            self.averaging.optimizer_state = lambda: optimizer_slots(self.inner_optimizer)

    def _build_accumulation(self, buffers: list) -> None:
        """Gradient accumulation state: the `buffers` and the micro-step counters."""
        self._accumulators = buffers
        self._micro_steps = self.add_variable(
            shape=(), dtype="int64", initializer="zeros", aggregation="none", name="micro_steps")
        self._accumulation_target = self.add_variable(
            shape=(), dtype="int64", aggregation="none", name="accumulation_steps",
            initializer=lambda shape, dtype: tf.constant(self.accumulation_steps, tf.int64))

    @property
    def compressor(self):
        return self.exchange.compressor

    def _per_replica_variables(self) -> list:
        """Variables whose value differs between replicas (residuals, accumulators...)."""
        return self.exchange.per_replica_variables() + list(self._accumulators)

    def save_own_variables(self, store):
        """Keras' optimizer state, plus every replica's copy of per-replica state.

        Keras saves one value per variable (replica 0's). Error-feedback residuals, DGC buffers
        and accumulators differ between replicas, so all copies are stored as `"<i>.replicas"`.
        """
        super().save_own_variables(store)
        per_replica = {id(v) for v in self._per_replica_variables()}
        for i, var in enumerate(self.variables):
            copies = _replica_copies(var)
            if id(var) in per_replica and len(copies) > 1:
                store[f"{i}.replicas"] = np.stack([c.numpy() for c in copies])

    def load_own_variables(self, store):
        """Inverse of `save_own_variables`. With a different number of replicas than saved,
        each replica starts from the mean of the saved copies."""
        own = [k for k in store.keys() if not k.endswith(".replicas")]  # noqa: SIM118 (H5 store)
        if len(own) != len(self.variables):
            super().load_own_variables({k: store[k] for k in own})
            return
        for i, var in enumerate(self.variables):
            var.assign(store[str(i)])
            key = f"{i}.replicas"
            if key in store.keys():  # noqa: SIM118 (H5 store)
                saved = np.asarray(store[key])
                copies = _replica_copies(var)
                values = saved if len(saved) == len(copies) else [saved.mean(axis=0)] * len(copies)
                for copy, value in zip(copies, values):
                    copy.assign(value)

    @property
    def bytes_sent(self) -> float:
        """Total bytes this worker has sent (ring-algorithm accounting, see `tfdist.comm`)."""
        return self.exchange.bytes_sent

    @property
    def communication_rounds(self) -> int:
        """How many times gradients were exchanged."""
        return self.exchange.communication_rounds

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
        if self._accumulators:
            self._accumulate(comm, grads, variables)
        elif self.local_sgd is not None:
            self._local_step(comm, grads, variables)
        else:
            self._reduce_and_apply(comm, grads, variables)
        self._iterations.assign_add(1)

    def set_accumulation_steps(self, steps: int) -> None:
        """Changes the micro-steps per optimizer step during training (eagerly, between steps).

        Needs `variable_accumulation=True` (or `accumulation_steps > 1`). A pending accumulation
        completes as soon as it has `steps` micro-steps.
        """
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
            raise ValueError(f"`steps` must be an integer >= 1. Received: steps={steps!r}")
        if not self.built or not self._accumulators:
            raise ValueError("set_accumulation_steps needs a built optimizer created with "
                             "variable_accumulation=True (or accumulation_steps > 1).")
        self._accumulation_target.assign(int(steps))

    @property
    def current_accumulation_steps(self) -> int:
        if self.built and self._accumulators:
            return int(self._accumulation_target.numpy())
        return self.accumulation_steps

    def _accumulate(self, comm, grads, variables):
        """Adds one micro-batch; on the last micro-step of an optimizer step, applies the mean."""
        self._add_micro_batch(comm, grads, variables)
        micro = self._micro_steps + 1
        self._micro_steps.assign(micro)
        present = [g is not None for g in grads]

        def step():  # reads this replica's accumulators; captures no per-replica tensor
            self._apply_accumulated(comm, variables, present)
            for acc in self._accumulators:
                acc.assign(tf.zeros_like(acc))
            self._micro_steps.assign(0)

        replica_cond(micro >= self._accumulation_target, step, lambda: None)

    def _add_micro_batch(self, comm, grads, variables):
        self.exchange.track(self._unscale(grads), variables)  # per micro-batch, unscaled
        for v, g in zip(variables, grads):
            if g is not None:
                acc = self._accumulators[self._get_variable_index(v)]
                acc.assign_add(tf.cast(g, acc.dtype))

    def _apply_accumulated(self, comm, variables, present):
        k = self._micro_steps
        accs = [self._accumulators[self._get_variable_index(v)] for v in variables]
        mean = [acc / tf.cast(k, acc.dtype) if p else None for acc, p in zip(accs, present)]
        self._reduce_and_apply(comm, mean, variables, track=False)

    def _reduce_and_apply(self, comm, grads, variables, track=True):
        """Reduces this replica's gradients (None for unused variables) and applies them.

        Gradients are unscaled first, so error-feedback state does not depend on the loss scale."""
        self.exchange.exchange(comm, self._unscale(grads), variables,
                               lambda reduced: self._apply_reduced(reduced, variables),
                               reduce_op=self._reduce_op, track=track)

    def average_also(self, variables) -> None:
        """Adds variables (e.g. `model.non_trainable_variables`) to local SGD's averaging.

        Call before training starts (before the train step is traced)."""
        if self.averaging is None:
            raise ValueError("average_also needs `local_sgd`: this optimizer averages nothing.")
        self.averaging.also_averaged = list(variables)

    def set_averaging_period(self, period: int) -> None:
        """Changes local SGD's averaging period during training (eagerly, between steps).

        The next averaging round comes once `period` local steps have passed since the last."""
        if self.averaging is None:
            raise ValueError("set_averaging_period needs an optimizer with `local_sgd`.")
        self.averaging.set_period(period)

    @property
    def averaging_period(self) -> int:
        return self.averaging.period if self.averaging is not None else 1

    def _local_step(self, comm, grads, variables):
        assert self.averaging is not None
        # Keras divides the loss by the number of replicas; a local step undoes it.
        self.averaging.step(
            self.exchange, comm, grads, variables,
            synchronous=lambda full: self._reduce_and_apply(comm, full, variables),
            apply_local=lambda full: self._apply_reduced(self._unscale(full), variables),
            local_scale=comm.world_size if self._reduce_op == "sum" else 1)

    def _unscale(self, grads):
        if not self.dynamic:
            return grads
        return [None if g is None else g / tf.cast(self.dynamic_scale, g.dtype) for g in grads]

    def _apply_reduced(self, reduced, variables):
        if not self.dynamic:
            self.inner_optimizer.apply(reduced, variables)
            return
        holes = Holes(reduced)
        full, values = holes.refill, holes.values
        scale = self.dynamic_scale
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in values])

        def apply_finite(*reduced):
            self.inner_optimizer.apply(full(reduced), variables)
            count = tf.convert_to_tensor(self.step_counter)
            grow = tf.equal(count, self.dynamic_growth_steps - 1)
            self.step_counter.assign(tf.where(grow, tf.zeros_like(count), count + 1))
            self.dynamic_scale.assign(tf.where(grow, scale * 2.0, scale))

        def skip_non_finite(*reduced):
            self.step_counter.assign(0)
            self.dynamic_scale.assign(scale * 0.5)

        # Per-replica tensors go through `args`, not closures (see replica_cond).
        replica_cond(finite, apply_finite, skip_non_finite, args=values)

    def get_config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "accumulation_steps": self.accumulation_steps,
            "loss_scale": self.loss_scale,
            "initial_scale": self.initial_scale,
            "dynamic_growth_steps": self.dynamic_growth_steps,
            "verify_model": self.verify_model,
            **self.exchange.get_config(),
            "variable_accumulation": self.variable_accumulation,
            **(self.averaging.get_config() if self.averaging is not None
               else {"local_sgd": None, "slowmo": None, "averaging_topology": "all", "sma": None,
                     "average_optimizer_state": False}),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = ModelAveraging.from_config(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)
