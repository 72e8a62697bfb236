"""`ZeroOptimizer`: sharded optimizer state (ZeRO stages 1 and 2) and parameters (stage 3, with
`tfdist.zero.ShardedModel`) for Keras 3 `model.fit`.

Every trainable parameter goes into one flat vector split into N equal shards (`ShardPlan`).
The inner Keras optimizer is built on a flat variable of one shard's size, so each replica keeps
and updates the optimizer state of its own shard only. A step:

1. the replica's gradients, flattened, are reduce-scattered: each replica receives the reduced
   gradient of its shard (stage 2 does this at every micro-step of gradient accumulation and
   accumulates the shard only; stage 1 accumulates full-size gradients and reduce-scatters once);
2. the inner optimizer updates the replica's parameter shard (and its shard of the state);
3. the updated shards are all-gathered and written back into the model's variables.

Bytes on the wire per step: reduce-scatter (N-1)/N x 4P plus all-gather (N-1) x 4 ceil(P/N),
i.e. a dense all-reduce's 2 (N-1)/N x 4P (plus padding), as in the ZeRO paper.

Stage 3 trains a `ShardedModel`, whose backward pass already reduce-scattered each layer's
gradients: the step is 2 only (plus one all-reduce of a non-finite flag), on the model's own
parameter shard, with no all-gather (the next forward pass gathers each layer as it runs).

Checkpoints hold the consolidated (unsharded) state, so they load with any number of replicas,
on any engine. In a multi-process job (TF_CONFIG workers, Horovod ranks) a process holds only its
own shards: saving all-gathers the others', so every process saves, as Keras' multi-worker
saving expects (`tfdist.callbacks.ModelCheckpoint` does it and writes one file).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfdist._hooks.checkpoint import ComputedCheckpointEntry, hide_from_checkpoints
from tfdist._hooks.optimizer import excludes_from_weight_decay, own_variables, replace_method
from tfdist.arguments import check_int
from tfdist.comm import resolve
from tfdist.optimizers import Accumulation, DistributedOptimizer
from tfdist.optimizers.chain import own_values
from tfdist.optimizers.nan_policy import all_finite, report_nonfinite
from tfdist.optimizers.parts import Part
from tfdist.zero import gather
from tfdist.zero.offload import Offload, OffloadedState
from tfdist.zero.plan import ShardPlan, parameter_shard_plan

# Keras optimizers whose update is element-wise, so a flat shard updates like the whole.
ELEMENTWISE = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Nadam",
               "Ftrl", "Lion")
STAGES = (1, 2, 3)


def _check_inner(inner) -> None:
    name = type(inner).__name__
    if not isinstance(inner, keras.optimizers.Optimizer) or name not in ELEMENTWISE \
            or not type(inner).__module__.startswith("keras"):
        raise ValueError(
            f"ZeroOptimizer needs a Keras optimizer with an element-wise update, one of "
            f"{', '.join(ELEMENTWISE)}. Received: {name} (optimizers such as Lamb, Adafactor and "
            "Muon use whole-tensor statistics, which a flat shard does not have).")
    if inner.clipnorm is not None or inner.global_clipnorm is not None:
        raise ValueError("ZeroOptimizer cannot clip by norm (a shard does not see the whole "
                         f"gradient). Received: clipnorm={inner.clipnorm}, "
                         f"global_clipnorm={inner.global_clipnorm}; use clipvalue.")
    if inner.use_ema:
        raise ValueError("ZeroOptimizer does not support use_ema=True on the inner optimizer.")
    if excludes_from_weight_decay(inner):
        raise ValueError("ZeroOptimizer applies weight decay to the flat shard: "
                         "exclude_from_weight_decay is not supported.")


class ZeroExchange(Part):
    """The exchange of a ZeRO step: reduce-scatter the flattened gradients (each replica gets its
    shard's reduced gradient), update the shard, all-gather the updated shards into the model."""

    reduces = True

    def __init__(self, zero: ZeroOptimizer):
        self.zero = zero

    def step(self, ctx, grads, next) -> None:
        if self.zero.stage == 3:  # already reduce-scattered, layer by layer, in the backward
            mine = tf.cast(tf.logical_not(all_finite(grads)), tf.float32)
            (count,) = ctx.comm.all_reduce([mine], "sum")
            self.zero.apply_shard(ctx, grads[0], count, mine)
        else:
            self.zero.apply_shard(ctx, *self.zero.reduce_scatter_checked(ctx.comm, grads))


class ShardedAccumulation(Accumulation):
    """Stage 2's accumulation: every micro-step reduce-scatters its gradients and adds only this
    replica's shard to one shard-sized buffer; the last micro-step updates from their mean."""

    def __init__(self, zero: ZeroOptimizer, steps: int):
        super().__init__(steps)
        self.zero = zero

    def build(self, owner, var_list, engine) -> None:
        # Non-finite counts of the pending micro-steps: every replica's, and this replica's own.
        self._nonfinite, self._local_nonfinite = (
            owner.add_variable(shape=(), dtype="float32", initializer="zeros",
                               aggregation="none", name=name)
            for name in ("zero_nonfinite", "zero_local_nonfinite"))
        super().build(owner, var_list, engine)

    def variables(self) -> list:
        return [self._nonfinite, self._local_nonfinite, *super().variables()] \
            if self.built else []

    def make_buffers(self, owner, var_list, engine) -> list:
        return [owner.add_variable(shape=(self.zero.plan.shard_size,), dtype="float32",
                                   aggregation="none", initializer="zeros",
                                   name="zero_gradient_shard")]

    def add(self, ctx, grads) -> None:
        shard, count, mine = self.zero.reduce_scatter_checked(ctx.comm, grads)
        self.buffers[0].assign_add(shard)
        self._nonfinite.assign_add(count)
        self._local_nonfinite.assign_add(mine)

    def flush(self, ctx, present, next) -> None:
        self.zero.apply_shard(ctx, self.buffers[0] / tf.cast(self._micro_steps, tf.float32),
                              tf.convert_to_tensor(self._nonfinite),
                              tf.convert_to_tensor(self._local_nonfinite))
        self._nonfinite.assign(0.0)
        self._local_nonfinite.assign(0.0)


@keras.saving.register_keras_serializable(package="tfdist")
class ZeroOptimizer(DistributedOptimizer):
    """Shards the inner optimizer's state (stage 1), gradients (stage 2) and parameters
    (stage 3, training a `tfdist.zero.ShardedModel`) over replicas.

    Use it like `tfdist.DistributedOptimizer`, on any engine: under MirroredStrategy or
    `tfdist.MultiWorkerMirroredStrategy`, or under horovodrun after `tfdist.horovod.init()`.

    Args:
        inner_optimizer: A Keras optimizer with an element-wise update (see `ELEMENTWISE`).
        stage: 1 (optimizer state sharded), 2 (gradients too: reduce-scattered at every
            micro-step, accumulated as one shard) or 3 (parameters too: the model must be a
            `tfdist.zero.ShardedModel`). Defaults to 1.
        accumulation_steps: Micro-steps per optimizer step. Defaults to 1.
        offload: None (state on the devices), "cpu" (state and update in host memory), "disk"
            (state in memory-mapped files, streamed through host memory in chunks) or a
            `tfdist.zero.Offload` naming the directory and host-memory budget.
        verify_model: Check that every replica builds the same model. Defaults to True.
        engine: As for `tfdist.DistributedOptimizer`; None resolves it when built.
        fused_update: As for `tfdist.DistributedOptimizer`: the shards' update compiled by
            XLA (Adam, AdamW; with "xla", any optimizer) or in one kernel per shard (SGD),
            offloaded or not. Defaults to True.
        name: Optional name.

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))
        with strategy.scope():
            model = build_model()
            model.compile(optimizer=tfdist.ZeroOptimizer(keras.optimizers.Adam(1e-3), stage=2),
                          loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=64, epochs=1)
        print(tfdist.zero.memory_report(model.optimizer))  # bytes per device
        ```
    """

    _checks_gradients = False  # the sharded exchange checks them itself (apply_shard)

    def __init__(self, inner_optimizer, stage: int = 1, accumulation_steps: int = 1,
                 offload: Offload | str | dict | None = None, verify_model: bool = True,
                 nan_policy: str = "raise", engine=None, fused_update: bool | str = True,
                 name: str | None = None):
        if isinstance(stage, bool) or stage not in STAGES:
            raise ValueError(f"`stage` must be one of {STAGES}. Received: stage={stage!r}")
        _check_inner(inner_optimizer)
        accumulation_steps = check_int("accumulation_steps", accumulation_steps, 1)
        offload = Offload.parse(offload)
        self.check_dtype_policy(keras.config.dtype_policy().name)
        parts: list[Part] = [ZeroExchange(self)]
        if accumulation_steps > 1:
            parts.insert(0, ShardedAccumulation(self, accumulation_steps) if stage == 2
                         else Accumulation(accumulation_steps))  # stage 3: already shards
        super().__init__(inner_optimizer, *parts, loss_scale=None, verify_model=verify_model,
                         nan_policy=nan_policy, engine=engine, fused_update=fused_update,
                         name=name)
        self.stage = stage
        self.offload = offload

    @staticmethod
    def check_dtype_policy(policy: str) -> None:
        """Raises a ValueError if ZeRO cannot train under the Keras dtype policy named `policy`
        (it does no loss scaling: not "mixed_float16"). The constructor checks the global
        policy; `tfdist train` checks `train.precision` with it before training starts."""
        if policy == "mixed_float16":
            raise ValueError("ZeroOptimizer does no loss scaling: train in float32 or "
                             "mixed_bfloat16 (dtype policy is mixed_float16).")

    # -- building ------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.engine.world_size

    def build(self, var_list):
        if self.chain.engine is None:
            self.chain.engine = resolve()
        engine = self.chain.engine
        self.plan = self._plan(var_list, engine)
        size = self.plan.shard_size
        # Counters, then the sharded variables last: a deferred tf.train.Checkpoint restore
        # matches variables by position as they are created, and the sharded ones are hidden.
        self._skipped = self.add_variable(shape=(), dtype="int64", initializer="zeros",
                                          aggregation="none", name="nonfinite_steps_skipped")
        self.chain.build(self, var_list)
        self._shard = self.parameter_shard = None
        self.offloaded = None
        if self.stage == 3:
            # The model's own parameter shard (untracked: it is not this optimizer's variable).
            replace_method(self, "parameter_shard", var_list[0])
            if self.offload is None:
                replace_method(self, "_shard", var_list[0])
            else:
                self.offloaded = OffloadedState(self.offload, self.inner_optimizer, size,
                                                len(engine.local_devices), _host(engine))
        elif self.offload is None:
            self._shard = self.add_variable(shape=(size,), dtype="float32", aggregation="none",
                                            initializer="zeros", name="zero_param_shard")
        else:
            self.offloaded = OffloadedState(self.offload, self.inner_optimizer, size,
                                            len(engine.local_devices), _host(engine))
        # (stage 3's replicas hold different shards of one model: nothing to compare)
        if self.verify_model and tf.executing_eagerly() and self.stage < 3:
            engine.verify_same_model(var_list)
        # The state exists for one shard only (offloaded: off the device, the inner optimizer
        # keeps its step counter and learning rate).
        self.inner_optimizer.build([] if self._shard is None else [self._shard])
        self._hook_inner_checkpoints()
        keras.optimizers.Optimizer.build(self, var_list)

    def _plan(self, var_list, engine):
        if self.stage < 3:
            return ShardPlan([v.shape for v in var_list], engine.world_size)
        plans = [parameter_shard_plan(v) for v in var_list]
        if len(var_list) != 1 or plans[0] is None:
            raise ValueError("ZeroOptimizer(stage=3) trains a tfdist.zero.ShardedModel (whose "
                             "parameters are sharded): wrap the model, "
                             "`model = tfdist.zero.ShardedModel(model)`, under the strategy's "
                             f"scope. Received {len(var_list)} unsharded variables.")
        if plans[0].world_size != engine.world_size:
            raise ValueError(f"The ShardedModel was sharded over {plans[0].world_size} replicas "
                             f"and this optimizer runs on {engine.world_size}: create both "
                             "under the same strategy.")
        return plans[0]

    @property
    def accumulators(self) -> list:
        """The gradient buffers: full-size (stage 1) or one shard (stage 2); none without
        accumulation."""
        accumulation = self.chain.part(Accumulation)
        return [] if accumulation is None else list(accumulation.buffers)

    def sharded_variables(self) -> list:
        """Variables holding one shard per replica: the parameter shard, the inner optimizer's
        per-element state and (stage 2) the gradient shard."""
        size = self.plan.shard_size
        out = [] if self._shard is None or self.stage == 3 else [self._shard]
        out += [v for v in self.inner_optimizer.variables if tuple(v.shape) == (size,)]
        if self.stage >= 2:
            out += self.accumulators
        return out

    # -- the step ------------------------------------------------------------------------------
    def reduce_scatter_checked(self, comm, grads):
        """Reduce-scatters the flattened gradients with one more element per shard: whether this
        replica's gradients were non-finite, so every replica learns how many were. Returns
        (this replica's gradient shard, that count, this replica's own flag)."""
        n, size = self.plan.world_size, self.plan.shard_size
        mine = tf.cast(tf.logical_not(all_finite(grads)), tf.float32)
        flat = tf.reshape(self.plan.flatten(grads), [n, size])
        chunk = comm.reduce_scatter(tf.reshape(tf.concat([flat, tf.fill([n, 1], mine)], 1), [-1]),
                                    op="sum")
        return chunk[:size], chunk[size], mine

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for non-finite gradients (nan_policy="skip")."""
        return int(self._skipped.numpy()) if self.built else 0

    def apply_shard(self, ctx, grad_shard, nonfinite, mine) -> None:
        """Updates this replica's parameter shard from its reduced gradient shard and all-gathers
        the updated shards into the model's variables, if no replica's gradients were
        non-finite (`nonfinite`, the same on every replica); else applies `nan_policy`."""
        variables, comm = ctx.variables, ctx.comm

        def update(grad_shard, mine):
            if self.stage == 3:
                self._update_parameter_shard(comm, variables[0], grad_shard)
                return
            own = self.plan.shard(self.plan.flatten([tf.convert_to_tensor(v) for v in variables]),
                                  comm.rank)
            if self.offloaded is not None:
                inner = self.inner_optimizer
                updated = self.offloaded.update(comm.rank, inner.iterations, inner.learning_rate,
                                                grad_shard, own)
                inner.iterations.assign_add(1)
            else:
                self._shard.assign(own)  # the model's current values (set_weights, loading) win
                self.inner_optimizer.apply([grad_shard], [self._shard])
                updated = tf.convert_to_tensor(self._shard)
            full = comm.all_gather(updated)
            for var, value in zip(variables, self.plan.unflatten(full)):
                var.assign(tf.cast(value, var.dtype))

        def reject(grad_shard, mine):  # every replica is here: no state moves
            row = tf.one_hot(tf.cast(comm.rank, tf.int32), comm.world_size) * mine
            report_nonfinite(comm, self.nan_policy, self.inner_optimizer.iterations, row,
                             instead="nan_policy='skip'")
            self._skipped.assign_add(1)

        comm.cond(tf.equal(nonfinite, 0.0), update, reject, args=[grad_shard, mine])
        ctx.traffic.add_round()

    def _update_parameter_shard(self, comm, shard, grad_shard) -> None:
        """Stage 3: the update of the model's own parameter shard; nothing to gather."""
        inner = self.inner_optimizer
        if self.offloaded is None:
            inner.apply([grad_shard], [shard])
            return
        updated = self.offloaded.update(comm.rank, inner.iterations, inner.learning_rate,
                                        grad_shard, tf.convert_to_tensor(shard))
        inner.iterations.assign_add(1)
        shard.assign(updated)

    # -- checkpoints: consolidated, re-sharded on load -------------------------------------------
    # Keras saves the wrapper's own variables and, as a separate object, the inner optimizer's;
    # both go through `_save` / `_load`, so sharded state is consolidated wherever it lives.
    def _hook_inner_checkpoints(self) -> None:
        inner = self.inner_optimizer
        # tf.train.Checkpoint: the sharded variables leave the wrapper's and the inner
        # optimizer's object graphs and come back as one consolidated entry.
        def hidden():  # (stage 3: with the model's parameter shard, which the model saves)
            return self.sharded_variables() + (
                [] if self.parameter_shard is None else [self.parameter_shard])

        hide_from_checkpoints(self, hidden)
        hide_from_checkpoints(inner, hidden)
        self.zero_state = ComputedCheckpointEntry(self._save_consolidated,
                                                  self._load_consolidated)
        replace_method(inner, "save_own_variables", self._save_inner)
        replace_method(inner, "load_own_variables", self._load_inner)

    def _save_inner(self, store):
        if self.offloaded is not None:
            self._save_offloaded(store)
        else:
            self._save(self.inner_optimizer.variables, store)

    def _load_inner(self, store):
        if self.offloaded is not None:
            self._load_offloaded(store)
        else:
            self._load(self.inner_optimizer.variables, store)

    # Offloaded, the inner optimizer's checkpoint has the layout it has on the device (its
    # scalars, then each state slot consolidated), so either kind of checkpoint loads into
    # either kind of ZeroOptimizer.
    def _offloaded_layout(self) -> list:
        """("scalar", inner variable) or ("slot", k), in the inner optimizer's variable order."""
        updater = self.offloaded.updaters[0]
        scalars = iter(self.inner_optimizer.variables)
        slots = {id(v): k for k, v in enumerate(updater.slots)}
        return [("slot", slots[id(v)]) if id(v) in slots else ("scalar", next(scalars))
                for v in updater.optimizer.variables]

    def _save_offloaded(self, store):
        state = self.offloaded
        for i, (kind, item) in enumerate(self._offloaded_layout()):
            store[str(i)] = (self._consolidate([state.slot(r, item)
                                                for r in range(state.replicas)])
                             if kind == "slot" else self.engine.replica_copies(item)[0].numpy())

    def _load_offloaded(self, store):
        state, layout = self.offloaded, self._offloaded_layout()
        self._check_count(store, layout)
        for i, (kind, item) in enumerate(layout):
            value = np.asarray(store[str(i)])
            if kind == "scalar":
                for copy in self.engine.replica_copies(item):
                    copy.assign(value)
                continue
            shards = self._local_shards(value, state.replicas)
            for r, shard in enumerate(shards):
                state.set_slot(r, item, shard)

    # -- every replica's shard, wherever it lives ------------------------------------------------
    def _consolidate(self, shards: list) -> np.ndarray:
        """The length-P value of a sharded variable from this process's `shards` (a collective
        in a multi-process job: every process must be saving)."""
        return gather.consolidate(self.plan, self.engine, shards)

    def _local_shards(self, value, held: int) -> list:
        return gather.local_shards(self.plan, self.engine, value, held)

    @staticmethod
    def _check_count(store, variables) -> None:
        keys = list(own_values(store))
        if len(keys) != len(variables):
            raise ValueError(f"The checkpoint holds {len(keys)} optimizer variables where "
                             f"{len(variables)} are expected (a different inner optimizer, "
                             "stage or accumulation?).")

    # tf.train.Checkpoint's entry: the inner optimizer's variables in the layout of its Keras
    # checkpoint (scalars, then each state slot consolidated) and, stage 2, the gradient shard.
    # (no "/" in the key: tf.train.Checkpoint escapes it one way on save, another on restore)
    _GRADIENT_SHARD = "gradient_shard_"

    def _save_consolidated(self) -> dict:
        store: dict = {}
        self._save_inner(store)
        if self.stage >= 2 and self.accumulators:
            gradient: dict = {}
            self._save(self.accumulators, gradient)
            store.update({self._GRADIENT_SHARD + k: v for k, v in gradient.items()})
        return store

    def _load_consolidated(self, store: dict) -> None:
        prefix = self._GRADIENT_SHARD
        self._load_inner({k: v for k, v in store.items() if not k.startswith(prefix)})
        if self.stage >= 2 and self.accumulators:
            self._load(self.accumulators,
                       {k[len(prefix):]: v for k, v in store.items() if k.startswith(prefix)})

    def save_own_variables(self, store):
        """The wrapper's variables; sharded ones consolidated into their unsharded length-P
        values, so a checkpoint loads with any number of replicas. The parameter shard is not
        state (it is read from the model at every step) and is left out, so checkpoints with
        and without offload have one layout."""
        self._save(self._checkpointed(), store)

    def load_own_variables(self, store):
        self._load(self._checkpointed(), store)

    def _checkpointed(self) -> list:
        return [v for v in own_variables(self) if v is not self._shard]

    def _save(self, variables, store):
        """One value per variable (a sharded one consolidated), then every replica's copy of the
        per-replica state in the format every tfdist optimizer uses (`Chain.save_replicas`)."""
        sharded_variables = self.sharded_variables()
        sharded = {id(v) for v in sharded_variables}
        for i, var in enumerate(variables):
            copies = self.engine.replica_copies(var)
            store[str(i)] = (self._consolidate([c.numpy() for c in copies]) if id(var) in sharded
                             else copies[0].numpy())
        self.chain.save_replicas(variables, store, sharded=sharded_variables)

    def _load(self, variables, store):
        sharded = {id(v) for v in self.sharded_variables()}
        self._check_count(store, variables)
        for i, var in enumerate(variables):
            value = np.asarray(store[str(i)])
            copies = self.engine.replica_copies(var)
            values = (self._local_shards(value, len(copies)) if id(var) in sharded
                      else [value] * len(copies))
            for copy, v in zip(copies, values):
                copy.assign(v)
        self.chain.load_replicas(variables, store)

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name,
                "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
                "stage": self.stage, "accumulation_steps": self.accumulation_steps,
                "offload": None if self.offload is None else self.offload.get_config(),
                "verify_model": self.verify_model, "nan_policy": self.nan_policy,
                "fused_update": self.fused_update}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"),
                                                      custom_objects=custom_objects)
        return cls(inner, **config)


def _host(engine) -> str:
    """The host CPU of this process's first device (where offloaded state is updated)."""
    return tf.DeviceSpec.from_string(engine.local_devices[0]).replace(
        device_type="CPU", device_index=0).to_string()
