"""`DistributedOptimizer`: a Keras 3 optimizer wrapper assembled from parts, on any engine.

    opt = tfdist.DistributedOptimizer(
        keras.optimizers.Adam(1e-3),
        tfdist.optimizers.Accumulation(4),                       # the parts, in the order run
        tfdist.optimizers.LocalSGD(PeriodicSchedule(8, warmup_steps=200), outer=SlowMo(0.5)),
        tfdist.optimizers.GradientExchange(C.PowerSGD(rank=2)))

    opt = tfdist.DistributedOptimizer(keras.optimizers.Adam(1e-3),  # or the keyword shortcuts,
                                      accumulation_steps=4,          # which build that list
                                      local_sgd=PeriodicSchedule(8, warmup_steps=200),
                                      slowmo=SlowMo(0.5), compressor=C.PowerSGD(rank=2))

The parts (see `tfdist.optimizers.parts`) run in the order given, as optax's `chain`; the keyword
shortcuts build the usual order (`parts_from_shortcuts`): gradient-norm tracking, accumulation,
local SGD, the gradient exchange. The wrapper puts its non-finite check (dynamic loss scaling,
from `loss_scale`, or `nan_policy`) first, and a dense exchange last when no part exchanges.
It resolves its engine when it is built (the tf.distribute strategy in scope, or the engine
`tfdist.horovod.init()` activated), so one class serves every engine and a saved optimizer loads
on whichever engine runs.
"""

from __future__ import annotations

import json
from typing import Any

import keras
import tensorflow as tf

from tfdist._hooks.optimizer import (
    built_variables,
    count_apply,
    disable_gradient_all_reduce,
    fuse_update,
)
from tfdist.arguments import check_bool, check_choice, check_int, check_number
from tfdist.averaging import optimizer_slots
from tfdist.averaging import outer as outer_rules
from tfdist.comm import Engine, get_engine
from tfdist.compression import Adaptive
from tfdist.optimizers.accumulation import Accumulation
from tfdist.optimizers.auto import AutoExchange
from tfdist.optimizers.chain import Chain, own_values
from tfdist.optimizers.exchange import DEFAULT_BUCKET_BYTES, GradientExchange
from tfdist.optimizers.local_sgd import LocalSGD, schedule_from_config
from tfdist.optimizers.loss_scaling import DynamicLossScaling
from tfdist.optimizers.nan_policy import POLICIES, KeptState, NanPolicy
from tfdist.optimizers.norms import TrackNorms
from tfdist.optimizers.parts import PARTS, Part

LOSS_SCALE_MODES = ("auto", "dynamic", None)
ALGORITHMS = (None, "auto")
SHORTCUTS = ("algorithm", "accumulation_steps", "variable_accumulation", "compressor",
             "min_compress_size", "compress_1d", "compression_start_step",
             "bucket_bytes", "track_norms", "local_sgd", "slowmo", "sma", "outer",
             "averaging_topology", "average_optimizer_state")


def parts_from_shortcuts(algorithm: str | None = None, accumulation_steps: int = 1,
                         variable_accumulation: bool = False,
                         compressor=None, min_compress_size: int = 1024,
                         compress_1d: bool = False, compression_start_step: int = 0,
                         bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
                         track_norms: bool = False, local_sgd=None,
                         slowmo=None, sma=None, outer=None, averaging_topology: str = "all",
                         average_optimizer_state: bool = False) -> list[Part]:
    """The parts that the keyword shortcuts of `DistributedOptimizer` build, in the order they
    run: gradient-norm tracking, accumulation, local SGD, the exchange.

    Example:
        ```python
        parts = tfdist.optimizers.parts_from_shortcuts(accumulation_steps=4, compressor="fp16")
        print(parts)  # [Accumulation(...), GradientExchange(compressor=FP16(...))]
        opt = tfdist.DistributedOptimizer(keras.optimizers.Adam(), *parts)
        ```
    """
    check_choice("algorithm", algorithm, ALGORITHMS)
    if algorithm == "auto" and compressor is not None:
        raise ValueError(f"`algorithm='auto'` picks the compressor itself; give no `compressor`. "
                         f"Received: compressor={compressor!r}")
    exchange = (AutoExchange() if algorithm == "auto" else
                GradientExchange(compressor, min_compress_size, compress_1d,
                                 compression_start_step, bucket_bytes))
    parts: list[Part] = []
    if check_bool("track_norms", track_norms):
        parts.append(TrackNorms())
    if accumulation_steps != 1 or isinstance(accumulation_steps, bool) or variable_accumulation:
        parts.append(Accumulation(accumulation_steps, variable_accumulation))
    rules = {name: value for name, value in (("slowmo", slowmo), ("sma", sma), ("outer", outer))
             if value is not None}
    if len(rules) > 1:
        raise ValueError(f"Give one outer rule; received {', '.join(rules)}. Use either `slowmo` "
                         "or `sma` (or `outer`).")
    options = {**rules, "average_optimizer_state": average_optimizer_state or None,
               "averaging_topology": None if averaging_topology == "all" else averaging_topology}
    if local_sgd is None:
        for arg, value in options.items():
            if value is not None:
                raise ValueError(f"`{arg}` needs `local_sgd`. "
                                 f"Received: {arg}={value!r}, local_sgd=None")
        return [*parts, exchange]
    if isinstance(local_sgd, dict):  # a saved config
        local_sgd = schedule_from_config(local_sgd)
    ((name, rule),) = rules.items() if rules else (("outer", None),)
    if isinstance(rule, dict) and "name" not in rule:  # a saved config: {"momentum": ...}
        rule = outer_rules.get({"name": name, **rule})
    parts.append(LocalSGD(local_sgd, rule, averaging_topology, average_optimizer_state))
    return [*parts, exchange]


@keras.saving.register_keras_serializable(package="tfdist")
class DistributedOptimizer(keras.optimizers.LossScaleOptimizer):
    """Wraps a Keras optimizer so that it trains synchronously over all replicas / workers.

    On the tf.distribute engine (MirroredStrategy, `tfdist.MultiWorkerMirroredStrategy`) the
    world is the strategy's replicas; under `horovodrun` (after `tfdist.horovod.init()`) the
    Horovod ranks; with neither, a single worker. Every exchange counts its bytes and collective
    calls in optimizer variables: `bytes_sent`, `collective_calls` and `communication_rounds`
    survive checkpoints.

    Parts (positional, run in the order given; see `tfdist.optimizers.parts`): e.g.
    `TrackNorms()`, `Accumulation(steps)`, `LocalSGD(schedule, outer=...)`,
    `GradientExchange(compressor, ...)` (dense when no part exchanges). They compose: e.g. local
    SGD whose synchronous warm-up steps are accumulated and compressed. A part after the
    exchange sees the reduced gradients.

    Loss scaling: this wrapper is a `LossScaleOptimizer` so that Keras does not wrap it again
    under the `mixed_float16` policy. Unlike Keras' own, it checks the *reduced* gradients for
    inf/NaN, so every worker makes the same skip decision.

    Keyword shortcuts (instead of the parts: they build the list of parts, in the usual
    order; `parts_from_shortcuts`): `algorithm="auto"` (an
    `AutoExchange`: the exchange picked from the measured link); `accumulation_steps`,
    `variable_accumulation` (an `Accumulation`); `compressor`, `min_compress_size`,
    `compress_1d`, `compression_start_step`, `bucket_bytes` (a `GradientExchange`);
    `track_norms`
    (a `TrackNorms`); `local_sgd` (a schedule), `slowmo` / `sma` / `outer`,
    `averaging_topology`, `average_optimizer_state` (a `LocalSGD`).

    Args:
        inner_optimizer: The Keras optimizer that updates the weights (not itself a
            `LossScaleOptimizer`).
        *parts: The parts of the step.
        loss_scale: `"dynamic"`, `None` (no loss scaling), or `"auto"`: dynamic when the global
            dtype policy is `mixed_float16` when this optimizer is created. Defaults to `"auto"`.
        initial_scale: Initial dynamic loss scale. Defaults to 2**15.
        dynamic_growth_steps: Finite steps before the scale doubles. Defaults to 2000.
        verify_model: All-gather a fingerprint of the model when the optimizer is built and raise
            a clear error on every worker if the workers' models differ. Defaults to True.
        nan_policy: Without dynamic loss scaling: "raise" (the default) stops training with an
            error naming the step and the ranks whose gradients were non-finite; "skip" skips
            the step on every worker (see `tfdist.optimizers.NanPolicy`). With dynamic loss
            scaling such steps are skipped and the scale lowered.
        engine: A `tfdist.comm.Engine` or its name ("distribute", "horovod", "local"); None
            (the default) resolves it when the optimizer is built.
        fused_update: True: an `Adam` or `AdamW` inner optimizer runs its own update of all
            a device's variables as one XLA-compiled function (Keras' arithmetic fused by XLA
            into one pass over each variable, about ten ops otherwise; its weights differ from
            Keras' only where XLA contracts a multiply and an add into one rounding), and an
            `SGD` updates each variable in one TensorFlow kernel
            (`ResourceApplyKerasMomentum`, `ResourceApplyGradientDescent`: Keras' arithmetic to
            the bit). Measured: the overhead benchmark. Other optimizers, and sparse gradients,
            keep Keras' update. "xla": any inner optimizer compiled as Adam is. The function
            is compiled at the first update. False keeps Keras' update for all. Defaults to
            True.
        name: Optional name.

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))
        with strategy.scope():
            model = build_model()
            opt = tfdist.DistributedOptimizer(keras.optimizers.Adam(1e-3), accumulation_steps=4)
            model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=64, epochs=1)
        print(opt.bytes_sent / opt.communication_rounds, "bytes per round")
        ```
    """

    _tfdist_no_exchange = True  # a strategy must not attach parts to the wrapper itself
    _checks_gradients = True  # ZeroOptimizer's sharded exchange checks them itself

    def __init__(self, inner_optimizer: keras.optimizers.Optimizer, *parts: Part,
                 loss_scale: str | None = "auto", initial_scale: float = 2.0**15,
                 dynamic_growth_steps: int = 2000, verify_model: bool = True,
                 nan_policy: str = "raise", engine: Engine | str | None = None,
                 fused_update: bool | str = True, name: str | None = None, **shortcuts):
        _check_inner(inner_optimizer)
        unknown = sorted(set(shortcuts) - set(SHORTCUTS))
        if unknown:
            raise TypeError(f"DistributedOptimizer got unexpected keyword argument(s) "
                            f"{', '.join(unknown)}; the shortcuts are {', '.join(SHORTCUTS)}.")
        check_choice("loss_scale", loss_scale, LOSS_SCALE_MODES)
        check_number("initial_scale", initial_scale, 0, low_open=True)
        check_int("dynamic_growth_steps", dynamic_growth_steps, 1)
        check_bool("verify_model", verify_model)
        if not (isinstance(fused_update, bool) or fused_update == "xla"):
            raise ValueError(f"`fused_update` must be True, False or 'xla'. Received: "
                             f"fused_update={fused_update!r}")
        if parts and shortcuts:
            raise ValueError(
                f"Give the parts or the keyword shortcuts, not both: the shortcuts "
                f"({', '.join(sorted(shortcuts))}) build a list of parts themselves. Put the parts "
                f"they stand for in your list (`tfdist.optimizers.parts_from_shortcuts(...)` "
                f"returns them). Received parts: {list(parts)!r}")
        given = list(parts) if parts else parts_from_shortcuts(**shortcuts)
        if not any(getattr(p, "reduces", False) for p in given):
            given.append(GradientExchange())
        if any(isinstance(getattr(p, "compressor", None), Adaptive) for p in given) and \
                not any(isinstance(p, TrackNorms) for p in given):
            given.insert(0, TrackNorms())  # Accordion decides from the gradient norms
        dynamic = loss_scale == "dynamic" or (
            loss_scale == "auto" and keras.config.dtype_policy().name == "mixed_float16")
        if dynamic:
            check: list[Part] = [DynamicLossScaling()]  # skips non-finite steps, lowers the scale
        elif self._checks_gradients:
            check = [NanPolicy(nan_policy)]
        elif nan_policy not in POLICIES:
            raise ValueError(f"`nan_policy` must be one of {POLICIES}. Received: "
                             f"nan_policy={nan_policy!r}")
        else:
            check = []
        chain = Chain(check + given, get_engine(engine))
        inner_scale_factor = inner_optimizer.loss_scale_factor
        super().__init__(inner_optimizer, initial_scale=initial_scale,
                         dynamic_growth_steps=dynamic_growth_steps, name=name)
        self.chain = chain
        self.given_parts = tuple(given)  # what get_config saves (the check comes from options)
        self.loss_scale = loss_scale
        self.dynamic = dynamic
        self.verify_model = verify_model
        self.nan_policy = nan_policy
        if not self.dynamic:
            # LossScaleOptimizer cleared it; without dynamic scaling the user's factor stands.
            self.inner_optimizer.loss_scale_factor = inner_scale_factor
        disable_gradient_all_reduce(self.inner_optimizer)
        self.fused_update = fused_update
        fuse_update(self.inner_optimizer, fused_update)

    # -- Keras optimizer API ---------------------------------------------------------------------
    def build(self, var_list):
        self.chain.build(self, var_list)
        if self.verify_model and tf.executing_eagerly():
            self.verify_workers(var_list)
        super().build(var_list)
        for part in self.chain.parts:  # local SGD's (and AutoExchange's) view of the slots
            if hasattr(part, "optimizer_state"):
                part.optimizer_state = lambda: optimizer_slots(self.inner_optimizer)

    def verify_workers(self, var_list) -> None:
        """Checks, with a collective every worker must join, that all workers train the same
        model (`var_list`: shapes and dtypes) with the same optimizer configuration; raises the
        same clear error on every worker otherwise. `build` runs it; an elastic job runs it
        again when ranks join (`tfdist.horovod.elastic.KerasState`)."""
        self.engine.verify_same_model(var_list)
        self.engine.verify_same_setup({"optimizer configuration": self._setup()})

    def _setup(self) -> str:
        """The configuration every worker must share: the parts' and the inner optimizer's
        kind (a compressor, period or accumulation that differs would desynchronise the
        collectives)."""
        parts = [[type(p).__name__, p.get_config()] for p in self.chain.parts]
        return json.dumps([type(self.inner_optimizer).__name__, parts], sort_keys=True,
                          default=repr)

    @property
    def engine(self) -> Engine:
        """The engine this optimizer runs on (resolved when it is built)."""
        if self.chain.engine is None:
            raise ValueError("The optimizer's engine is resolved when it is built.")
        return self.chain.engine

    def scale_loss(self, loss):
        """Keras' `train_step` calls it on the loss before the backward pass: the loss scale
        (mixed precision), times the factor that spares the step passes over the gradients
        (`Chain.loss_factor`: Horovod's 1/N, local SGD's N on local steps)."""
        loss = super().scale_loss(loss) if self.dynamic else self.inner_optimizer.scale_loss(loss)
        factor = self.chain.loss_factor()
        return loss if factor is None else loss * tf.cast(factor, loss.dtype)

    def apply(self, grads, trainable_variables=None):
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        if tf.distribute.in_cross_replica_context():
            raise ValueError("apply() must be called in a replica context.")
        variables = list(trainable_variables or built_variables(self))
        self.chain.update(list(grads), variables,
                          lambda reduced: self.inner_optimizer.apply(reduced, variables))
        count_apply(self)  # every call, micro-steps included

    # -- checkpoints: every replica's copy of per-replica state ---------------------------------
    def save_own_variables(self, store):
        """Keras' optimizer state, plus every replica's copy of per-replica state.

        Keras saves one value per variable (replica 0's). Error-feedback residuals, DGC buffers
        and accumulators differ between replicas, so all copies are stored as `"<i>.replicas"`.
        """
        super().save_own_variables(store)
        self.chain.save_replicas(self.variables, store)

    def load_own_variables(self, store):
        """Inverse of `save_own_variables`, on whichever engine loads it. With as many replicas
        as saved, each replica takes the copy of its global rank (a Horovod rank takes its own
        from a file saved under MirroredStrategy); otherwise each starts from the copies' mean."""
        own = own_values(store)
        if len(own) != len(self.variables):
            super().load_own_variables(own)  # Keras' error, naming both counts
            return
        for i, var in enumerate(self.variables):
            var.assign(own[str(i)])
        self.chain.load_replicas(self.variables, store)

    # -- counters --------------------------------------------------------------------------------
    @property
    def bytes_sent(self) -> float:
        """Total bytes this worker has sent (ring-algorithm accounting, see `tfdist.comm`)."""
        return self.chain.bytes_sent

    @property
    def collective_calls(self) -> int:
        """Collective calls this worker has made (one all-reduce of many tensors is one call)."""
        return self.chain.collective_calls

    @property
    def communication_rounds(self) -> int:
        """Gradient exchanges and model-averaging rounds so far."""
        return self.chain.communication_rounds

    # -- the parts -------------------------------------------------------------------------------
    @property
    def exchange(self) -> GradientExchange | None:
        return self.chain.part(GradientExchange)

    @property
    def compressor(self):
        """The gradient exchange's compressor (None for a dense or sharded exchange)."""
        exchange = self.chain.part(GradientExchange)
        return None if exchange is None else exchange.compressor

    @property
    def averaging(self) -> LocalSGD | None:
        """The `LocalSGD` part, or None."""
        return self.chain.part(LocalSGD)

    @property
    def local_sgd(self):
        """Local SGD's schedule, or None (synchronous every step)."""
        return None if self.averaging is None else self.averaging.schedule

    @property
    def accumulation_steps(self) -> int:
        accumulation = self.chain.part(Accumulation)
        return 1 if accumulation is None else accumulation.steps

    @property
    def current_accumulation_steps(self) -> int:
        accumulation = self.chain.part(Accumulation)
        return 1 if accumulation is None else accumulation.current_steps

    def set_accumulation_steps(self, steps: int) -> None:
        """Changes the micro-steps per optimizer step during training (eagerly, between steps).

        Needs an `Accumulation` part (`variable_accumulation=True` or `accumulation_steps > 1`).
        A pending accumulation completes as soon as it has `steps` micro-steps.
        """
        accumulation = self.chain.part(Accumulation)
        if accumulation is None or not accumulation.built:
            raise ValueError("set_accumulation_steps needs a built optimizer created with "
                             "variable_accumulation=True (or accumulation_steps > 1).")
        accumulation.set_steps(steps)

    def skip_also(self, variables) -> None:
        """Makes a skipped step (non-finite gradients under `nan_policy="skip"` or dynamic loss
        scaling) leave `variables` as they were too: pass `model.non_trainable_variables`, whose
        BatchNorm moving statistics the forward pass has already updated from the step's
        (non-finite) batch. Costs two copies of them per step. Call before training starts
        (before the optimizer is built). `tfdist train` does this itself.

        Example:
            ```python
            optimizer = tfdist.DistributedOptimizer(keras.optimizers.Adam(), nan_policy="skip")
            optimizer.skip_also(model.non_trainable_variables)
            ```"""
        if self.built:
            raise ValueError("skip_also must be called before the optimizer is built (before "
                             "fit, or before the first apply).")
        skipping = self._skipping_parts()
        if not skipping:
            raise ValueError("skip_also needs a step that can be skipped: nan_policy='skip' or "
                             "dynamic loss scaling (loss_scale='dynamic', or mixed_float16).")
        for part in skipping:
            part.kept = KeptState(variables)

    def _skipping_parts(self) -> list:
        return [p for p in self.chain.parts if isinstance(p, (NanPolicy, DynamicLossScaling))
                and (not isinstance(p, NanPolicy) or p.policy == "skip")]

    @property
    def skips_steps(self) -> bool:
        """Whether a step with non-finite gradients is skipped (not raised): `skip_also` then
        applies."""
        return bool(self._skipping_parts())

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

    # -- serialization ---------------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "loss_scale": self.loss_scale,
            "initial_scale": self.initial_scale,
            "dynamic_growth_steps": self.dynamic_growth_steps,
            "verify_model": self.verify_model,
            "nan_policy": self.nan_policy,
            "fused_update": self.fused_update,
            "parts": [{"class_name": _saved_name(p), "config": p.get_config()}
                      for p in self.given_parts],
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"),
                                                      custom_objects=custom_objects)
        parts = [_part_from_config(p) for p in config.pop("parts", [])]
        return cls(inner, *parts, **config)  # older configs: their keys are the shortcuts


def _saved_name(part: Part) -> str:
    name = PARTS.name_for(type(part))
    if name is None:
        raise ValueError(f"Cannot save {part!r}: its class is not registered and cannot be "
                         "imported by name. Define it at a module's top level, or decorate it "
                         "with @tfdist.optimizers.register('a name').")
    return name


def _part_from_config(spec: dict) -> Part:
    return PARTS.lookup(spec["class_name"]).from_config(spec["config"])


def _check_inner(inner_optimizer) -> None:
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        raise ValueError("`inner_optimizer` must be a Keras optimizer. "
                         f"Received: inner_optimizer={inner_optimizer!r}")
    if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "`inner_optimizer` must not be a LossScaleOptimizer: pass its inner optimizer and "
            "`loss_scale='dynamic'` instead. "
            f"Received: inner_optimizer={type(inner_optimizer).__name__}")
    if inner_optimizer.gradient_accumulation_steps:
        raise ValueError(
            "Set gradient accumulation on the wrapper (`accumulation_steps`), not on the inner "
            "optimizer. Received: inner_optimizer.gradient_accumulation_steps="
            f"{inner_optimizer.gradient_accumulation_steps}")
