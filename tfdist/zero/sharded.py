"""`ShardedModel`: ZeRO stage 3, the model's parameters sharded over the replicas.

Each replica keeps 1/N of every layer's parameters in one flat variable (`LayerShardPlan`);
nothing else holds them: the wrapped model's own parameter variables give up their storage.
A layer's parameters exist whole only while that layer runs:

- forward: the layer's shards are all-gathered, the layer runs on the gathered values (through
  `keras.StatelessScope`), and the gathered copy is dropped;
- backward: they are all-gathered again, the layer's forward is recomputed to get the gradients,
  and the parameter gradients are reduce-scattered: each replica receives the summed gradient of
  its own shard only.

A recurrent layer (any `keras.layers.RNN`) is one unit, its cell included: the cell runs inside
a loop, where no collective may run, so the layer's parameters are gathered once per call.

Per step that is 2 all-gathers and 1 reduce-scatter of the parameters: 1.5x a dense all-reduce's
bytes, as in the ZeRO paper. `ZeroOptimizer(inner, stage=3)` then updates each replica's shard
with its gradient shard, with no further exchange.
"""

from __future__ import annotations

import threading
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfdist._hooks.checkpoint import ComputedCheckpointEntry, hide_from_checkpoints
from tfdist._hooks.variables import (
    current_autocast,
    in_shape_inference,
    nested_layers,
    own_trainable_variables,
    read_uncast,
    release_storage,
)
from tfdist.comm import resolve
from tfdist.optimizers import DistributedOptimizer
from tfdist.zero import gather
from tfdist.zero.optimizer import ZeroOptimizer
from tfdist.zero.plan import LayerShardPlan, record_parameter_shard

SHARDED = "This parameter is sharded (ZeRO stage 3)"


class _Forward(threading.local):
    """The shard and communicator of the forward pass running in this thread (each replica of a
    MirroredStrategy runs in its own thread)."""

    shard: Any = None
    comm: Any = None


class _Hidden:
    """The wrapped model and its layers with parameters, where Keras does not look."""

    def __init__(self, model, layers):
        self.model, self.layers = model, layers


class ShardedModel(keras.Model):
    """Wraps a built Keras model so that its parameters are sharded over the replicas (ZeRO 3).

    Create it under the strategy's scope (or after `tfdist.horovod.init()`), compile it with a
    Keras optimizer (wrapped in `tfdist.ZeroOptimizer(inner, stage=3)`) and train it with
    `fit`. The wrapped model's parameter variables give up their storage; read the weights
    through this model (`get_weights`, `set_weights`, `save_weights`, `load_weights`), which
    gathers or re-shards them (`model.save` is refused: save the weights, or `load_into` a
    fresh build). Its checkpoints hold the unsharded weights in the wrapped model's order, so
    they load with any number of replicas and into the unwrapped model (`load_into`).

    Non-trainable variables (BatchNorm statistics) stay whole on every replica, as in ZeRO.

    Args:
        model: A built Keras model. Layers that share a parameter, weight or activity
            regularizers, and layers that hold parameters beside sublayers with parameters are
            refused. A recurrent layer (its cell runs in a loop) is gathered whole, once per
            call.
        name: Optional name.

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))
        with strategy.scope():
            model = tfdist.zero.ShardedModel(build_model())  # each replica holds half
            model.compile(optimizer=keras.optimizers.Adam(1e-3),  # in ZeroOptimizer(stage=3)
                          loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=64, epochs=1, verbose=0)
        ```
    """

    def __init__(self, model: keras.Model, name: str | None = None):
        if not isinstance(model, keras.Model):
            raise TypeError(f"ShardedModel wraps a keras.Model; received {type(model).__name__}.")
        if not model.built:
            raise ValueError(f"Build model {model.name!r} before sharding it (give it an Input "
                             "shape or call it once on data).")
        super().__init__(name=name or f"{model.name}_sharded")
        # Out of Keras' sight (it would count, save and load the wrapped model's layers and
        # variables as this model's): the parameters are ours.
        self._hidden = _Hidden(model, _layers_with_parameters(model))
        self.engine = resolve()
        groups = [variables for _, variables in self._hidden.layers]
        self.plan = LayerShardPlan([[v.shape for v in g] for g in groups], self.engine.world_size)
        initial = _flat([v.numpy() for v in self._parameters])
        self.shard = self.add_weight(shape=(self.plan.shard_size,), initializer="zeros",
                                     dtype="float32", trainable=True, aggregation="none",
                                     autocast=False,  # gathered in fp32, cast by each layer
                                     name="zero3_parameter_shard")
        record_parameter_shard(self.shard, self.plan)  # what ZeroOptimizer(stage=3) trains
        self._set_flat(initial)
        # The wrapped model's state (BatchNorm statistics): this model's non-trainable weights.
        self.wrapped_state = list(model.non_trainable_weights)
        for variable in self._parameters:
            release_storage(variable, _unmapped_read(variable))
        self._forward = _Forward()
        for index, (layer, variables) in enumerate(self._hidden.layers):
            layer.call = self._gathering_call(index, layer, variables, layer.call)
        hide_from_checkpoints(self, lambda: [self.shard])
        # tf.train.Checkpoint: the wrapped model's weights, unsharded, as `get_weights` lists.
        self.zero3_weights = ComputedCheckpointEntry(
            lambda: {str(i): w for i, w in enumerate(self._unsharded_weights())},
            lambda store: self.set_weights([store[str(i)] for i in range(len(store))]))
        self.built = True

    def wrapped(self) -> keras.Model:
        """The wrapped model (its parameters hold no storage: `load_into` gives a usable copy)."""
        return self._hidden.model

    @property
    def _parameters(self) -> list:
        return [v for _, variables in self._hidden.layers for v in variables]

    def sharded_variables(self) -> list:
        """Variables holding a different shard on each replica: the parameter shard."""
        return [self.shard]

    # -- the forward pass ----------------------------------------------------------------------
    def call(self, inputs, training=None):
        model = self._hidden.model
        if in_shape_inference():
            return model(inputs, training=training)
        if self.engine.name == "distribute" and not _in_replicas(self.plan.world_size):
            # Outside the replicas (an eager call): gather on the host.
            values = self._unflattened(self._consolidated())
            with keras.StatelessScope(list(zip(self._parameters, values))):
                return model(inputs, training=training)
        forward = self._forward
        previous = (forward.shard, forward.comm)
        forward.shard, forward.comm = tf.convert_to_tensor(self.shard), self._communicator()
        try:
            return model(inputs, training=training)
        finally:
            forward.shard, forward.comm = previous

    def _communicator(self):
        """The engine's collectives, counted in the optimizer's `bytes_sent` once it is built."""
        chain = getattr(getattr(self, "optimizer", None), "chain", None)
        traffic = None if chain is None else chain.traffic
        return self.engine.communicator(traffic.counter() if traffic is not None and traffic.built
                                        else None)

    def _gathering_call(self, index, layer, variables, original):
        plan = self.plan.layers[index]
        forward = self._forward

        def call(*args, **kwargs):
            if forward.shard is None:  # shape inference, or the host path above
                return original(*args, **kwargs)
            return _gathered(forward.comm, plan, variables, layer, original,
                             self.plan.layer_shard(forward.shard, index), args, kwargs)

        return call

    # -- weights: gathered for reading, re-sharded for writing ---------------------------------
    def _unflattened(self, flat) -> list:
        values, start = [], 0
        for v in self._parameters:
            n = int(np.prod(v.shape))
            values.append(np.asarray(flat[start:start + n]).reshape(v.shape).astype(v.dtype))
            start += n
        return values

    def _consolidated(self) -> np.ndarray:
        copies = self.engine.replica_copies(self.shard)
        return gather.consolidate(self.plan, self.engine, [c.numpy() for c in copies],
                                  what="the model's parameters")

    def _set_flat(self, flat) -> None:
        copies = self.engine.replica_copies(self.shard)
        for copy, shard in zip(copies, gather.local_shards(self.plan, self.engine,
                                                           np.asarray(flat, np.float32),
                                                           len(copies))):
            copy.assign(shard)

    def _unsharded_weights(self) -> list:
        """The wrapped model's weights, in its `weights` order (parameters gathered)."""
        values = dict(zip(map(id, self._parameters), self._unflattened(self._consolidated())))
        return [values[id(v)] if id(v) in values else v.numpy() for v in self._hidden.model.weights]

    def count_params(self) -> int:
        """The wrapped model's parameter count (not the shard's)."""
        return self._hidden.model.count_params()

    def get_weights(self) -> list:
        """The wrapped model's weights (as its `get_weights` would give them unsharded)."""
        return self._unsharded_weights()

    def set_weights(self, weights) -> None:
        """Sets the wrapped model's weights (its `weights` order), re-sharding the parameters."""
        targets = self._hidden.model.weights
        if len(weights) != len(targets):
            raise ValueError(f"Expected {len(targets)} weights (the wrapped model's), got "
                             f"{len(weights)}.")
        parameters = {id(v) for v in self._parameters}
        flat = {}
        for target, value in zip(targets, weights):
            value = np.asarray(value)
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(f"Weight {target.path} has shape {tuple(target.shape)}; "
                                 f"received {value.shape}.")
            if id(target) in parameters:
                flat[id(target)] = value
            else:
                target.assign(value)
        self._set_flat(_flat([flat[id(v)] for v in self._parameters]))

    def load_into(self, model: keras.Model) -> keras.Model:
        """Copies the unsharded weights into `model` (a model of the wrapped one's architecture,
        e.g. a fresh build of it) and returns it: for export and single-device inference."""
        model.set_weights(self._unsharded_weights())
        return model

    def save_own_variables(self, store):
        for i, value in enumerate(self._unsharded_weights()):
            store[str(i)] = value

    def load_own_variables(self, store):
        keys = [k for k in store.keys() if k.isdigit()]  # noqa: SIM118 (H5 store)
        self.set_weights([np.asarray(store[str(i)]) for i in range(len(keys))])

    # -- training ------------------------------------------------------------------------------
    def compile(self, optimizer="rmsprop", *args, **kwargs):
        """As `keras.Model.compile`; a Keras optimizer (or its name) is wrapped in
        `tfdist.ZeroOptimizer(optimizer, stage=3)`, which updates each replica's shard from its
        own gradient shard. Pass that wrapper yourself for its options (offload, accumulation)."""
        if isinstance(optimizer, DistributedOptimizer):
            if getattr(optimizer, "stage", None) != 3:
                raise ValueError("A ShardedModel trains with tfdist.ZeroOptimizer(inner, "
                                 "stage=3), or with a plain Keras optimizer, which it wraps in "
                                 f"one; received {optimizer!r}.")
        else:
            optimizer = ZeroOptimizer(keras.optimizers.get(optimizer), stage=3)
        super().compile(optimizer, *args, **kwargs)

    def get_config(self) -> dict[str, Any]:
        raise NotImplementedError(
            "A ShardedModel is not serialized as a model config: save the wrapped model's "
            "weights (save_weights / a checkpoint) and shard a fresh build of it when loading.")


def _layers_with_parameters(model) -> list[tuple[Any, list]]:
    """(layer, its own trainable variables) for every layer with parameters, checked."""
    found, seen = [], set()
    # A recurrent layer runs its cell inside a loop, where no collective may run: the layer,
    # cell included, is gathered once per call, outside the loop.
    looped = {id(sub) for layer in nested_layers(model) if isinstance(layer, keras.layers.RNN)
              for sub in nested_layers(layer)}
    for layer in nested_layers(model):
        if id(layer) in looped:
            continue
        recurrent = isinstance(layer, keras.layers.RNN)
        own = list(layer.trainable_weights) if recurrent else own_trainable_variables(layer)
        if not own:
            continue
        inner = [] if recurrent else [sub for sub in nested_layers(layer)
                                      if own_trainable_variables(sub)]
        if inner:
            raise ValueError(f"Layer {layer.name!r} holds parameters and also has sublayers "
                             f"with parameters ({inner[0].name!r}); ZeRO stage 3 gathers one "
                             "layer's own parameters at a time. Move its parameters into a "
                             "sublayer.")
        if getattr(layer, "activity_regularizer", None) is not None:
            raise ValueError(f"Layer {layer.name!r} has an activity regularizer, which "
                             "ShardedModel does not support: add the penalty to the loss.")
        for v in own:
            if id(v) in seen:
                raise ValueError(f"Parameter {v.path} is shared by several layers; ZeRO stage "
                                 "3 needs each parameter in one layer.")
            if getattr(v, "regularizer", None) is not None:
                raise ValueError(f"Parameter {v.path} has a regularizer, which ShardedModel "
                                 "does not support: add the penalty to the loss, or use "
                                 "AdamW's weight decay.")
            seen.add(id(v))
        found.append((layer, own))
    missing = [v.path for v in model.trainable_weights if id(v) not in seen]
    if missing:
        raise ValueError(f"ShardedModel found no layer owning {missing[:3]}.")
    if not found:
        raise ValueError(f"Model {model.name!r} has no trainable parameters to shard.")
    return found


def _flat(arrays) -> np.ndarray:
    """The arrays as one float32 vector, in order."""
    return np.concatenate([np.zeros(0, np.float32)]
                          + [np.asarray(a, np.float32).reshape(-1) for a in arrays])


def _in_replicas(world_size: int) -> bool:
    """Whether this runs in one replica of a strategy with `world_size` replicas."""
    ctx = tf.distribute.get_replica_context()
    return ctx is not None and ctx.num_replicas_in_sync == world_size


def _unmapped_read(variable):
    def read(shape, dtype=None):
        if tf.executing_eagerly():
            raise RuntimeError(f"{SHARDED}: {variable.path} has no storage of its own. Read "
                               "the weights through the ShardedModel (get_weights, load_into).")
        return tf.zeros(shape, dtype or variable.dtype)  # traced only, for shapes
    return read


def _gathered(comm, plan, variables, layer, original, shard, args, kwargs):
    """`original(*args, **kwargs)` on the layer's all-gathered parameters, differentiable:
    the backward all-gathers them again, recomputes the layer, and reduce-scatters their
    gradient into `shard`'s."""
    flat = tf.nest.flatten((args, kwargs))
    positions = [i for i, a in enumerate(flat)
                 if tf.is_tensor(a) and a.dtype.is_floating]
    updated = layer.non_trainable_variables
    structure: list = []
    autocast = current_autocast()  # mixed precision: the recomputation casts as the forward

    def run(values, tensors, state=()):
        items = list(flat)
        for i, t in zip(positions, tensors):
            items[i] = t
        a, k = tf.nest.pack_sequence_as((args, kwargs), items)
        mapping = [(v, tf.cast(x, v.dtype)) for v, x in zip(variables, values)]
        mapping += list(zip(updated, state))
        with keras.StatelessScope(mapping) as scope:
            out = original(*a, **k)
        return out, scope

    def parameters(shard):
        return plan.unflatten(comm.all_gather(shard))

    @tf.custom_gradient
    def forward(shard, *tensors):
        # The layer's own state as the forward finds it (seeds, statistics): the recomputation
        # starts from it too, so dropout draws the same mask.
        state = [read_uncast(v) for v in updated]
        out, scope = run(parameters(shard), tensors)
        for v in updated:  # e.g. BatchNorm statistics: applied once, in the forward pass
            new = scope.get_current_value(v)
            if new is not None:
                v.assign(new)
        structure.append(out)

        def backward(*upstream, variables=None):
            values = parameters(shard)
            with tf.GradientTape() as tape, autocast:
                tape.watch(values)
                tape.watch(list(tensors))
                again, _ = run(values, tensors, state)
            grads = tape.gradient(tf.nest.flatten(again), values + list(tensors),
                                  output_gradients=list(upstream))
            shard_grad = comm.reduce_scatter(plan.flatten(grads[:len(values)]), "sum")
            inputs = [shard_grad, *grads[len(values):]]
            return (inputs, [None] * len(variables)) if variables else inputs

        outputs = tf.nest.flatten(out)
        return (outputs[0] if len(outputs) == 1 else outputs), backward

    result = forward(shard, *[flat[i] for i in positions])
    return tf.nest.pack_sequence_as(structure[0], tf.nest.flatten(result))
