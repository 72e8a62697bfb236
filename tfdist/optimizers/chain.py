"""`Chain`: one optimizer's distributed step: its parts in order, their counters, its engine.

Both entry points carry one: `tfdist.DistributedOptimizer` (a wrapper, any engine) builds its
own, and a tfdist strategy attaches one to the user's own Keras optimizer when that is built.
`chain_of(optimizer)` finds it behind any optimizer, so callbacks and tools read the same
counters (`bytes_sent`, `collective_calls`, `communication_rounds`) and the same parts
(`chain.part(LocalSGD)`) in every form, and checkpoints hold every replica's copy of the parts'
per-replica state in one format (`save_replicas` / `load_replicas`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
import tensorflow as tf

from tfdist._hooks.optimizer import attachment
from tfdist.comm import Engine, resolve
from tfdist.optimizers.parts import Part, StepContext, Traffic, check_order, dense_gradient, run_chain
from tfdist.plan.costs import gathers_rows

P = TypeVar("P", bound=Part)
REPLICAS_SUFFIX = ".replicas"  # a variable store's entry of every replica's copy: "<i>.replicas"


def own_values(store) -> dict:
    """A Keras variable store without the `"<i>.replicas"` entries `Chain.save_replicas` adds."""
    return {k: store[k] for k in store.keys()  # noqa: SIM118 (an H5 store)
            if not k.endswith(REPLICAS_SUFFIX)}


class Chain:
    """The parts of a distributed step, in the order they run, with the counters they share.

    Args:
        parts: The parts, in order, exactly one of them an exchange (see
            `tfdist.optimizers.parts.check_order`).
        engine: The engine to run on; None resolves it when the owner optimizer is built (the
            strategy in scope, or the engine `tfdist.horovod.init()` activated).

    Example:
        ```python
        opt = tfdist.DistributedOptimizer(keras.optimizers.Adam(), accumulation_steps=2,
                                          compressor="powersgd")
        chain = opt.chain
        print(chain.parts)  # [NanPolicy('raise'), Accumulation(steps=2), GradientExchange(...)]
        print(chain.part(tfdist.optimizers.GradientExchange).compressor)
        ```
    """

    def __init__(self, parts: Sequence[Part], engine: Engine | None = None):
        self.parts = check_order(parts)
        self.engine: Engine | None = engine
        self.traffic = Traffic()
        self.owner = None
        # Set while a step is traced between `loss_factor` (the owner's `scale_loss`) and
        # `update`: the backward pass then yields the gradients in the chain's units.
        self._loss_prescaled = False

    def build(self, owner, var_list) -> None:
        """Resolves the engine and creates every part's state as variables of `owner`."""
        self.owner = owner
        if self.engine is None:
            self.engine = resolve()
        self.traffic.build(owner)
        for part in self.parts:
            part.build(owner, var_list, self.engine)

    @property
    def built(self) -> bool:
        return self.traffic.built

    def loss_factor(self) -> tf.Tensor | None:
        """What the owner's `scale_loss` multiplies this step's loss by (None: nothing), so
        that the backward pass yields gradients in the chain's units, which would otherwise
        take a pass over every gradient: 1/N on engines whose loss is each replica's own mean
        (Horovod; parts.py's convention), and N on local SGD's local steps (each replica
        steps on its own whole gradient). A multiple of a scalar in place of passes over the
        model's size; the next `update` traced takes the gradients as they come. Not with
        gradient-norm tracking or accumulation, whose norms and buffers stay in the chain's
        units (a checkpoint taken between micro-steps resumes on any engine): parts that
        `keeps_gradient_units`."""
        engine = self.engine
        if (not self.built or engine is None or engine.world_size == 1
                or any(p.keeps_gradient_units for p in self.parts)):
            return None
        n = engine.world_size
        share = 1.0 if engine.loss_divided_by_replicas else 1.0 / n
        wanted = [f for f in (p.loss_factor(n) for p in self.parts) if f is not None]
        if not wanted and share == 1.0:
            return None
        self._loss_prescaled = True
        factor = tf.constant(share)
        for f in wanted:
            factor = f * factor
        return factor

    def update(self, grads: list, variables: list, apply: Callable[[list], None]) -> None:
        """Runs one step: `grads` through the parts, ending in `apply(reduced grads)`."""
        assert self.engine is not None and self.owner is not None
        engine = self.engine
        comm = engine.communicator(self.traffic.counter())
        prescaled, self._loss_prescaled = self._loss_prescaled, False
        share = (1.0 / engine.world_size  # Keras' convention under a strategy (parts.py)
                 if not (engine.loss_divided_by_replicas or prescaled)
                 and engine.world_size > 1 else None)
        sparse = self.sparse_exchange and engine.world_size > 1
        grads = list(grads)
        for i, (g, v) in enumerate(zip(grads, variables)):
            if sparse and isinstance(g, tf.IndexedSlices) and _rows_pay(g, v, engine.world_size):
                # summed as rows by the exchange
                values = g.values if share is None else g.values * tf.cast(share, g.dtype)
                grads[i] = tf.IndexedSlices(values, tf.cast(g.indices, tf.int32),
                                            dense_shape=tf.constant(v.shape.as_list(), tf.int64))
            else:
                g = dense_gradient(g, v)
                grads[i] = g if share is None or g is None else g * tf.cast(share, g.dtype)
        ctx = StepContext(engine, comm, list(variables), apply, self.traffic, self.owner,
                          loss_prescaled=prescaled)
        run_chain(self.parts, ctx, grads)

    @property
    def sparse_exchange(self) -> bool:
        """Whether embedding gradients (rows and indices) are exchanged as rows: when every
        part passes rows (the dense exchange, and nothing that keeps gradients per replica:
        accumulation, local SGD, compression)."""
        return all(p.passes_rows() for p in self.parts)

    def part(self, kind: type[P]) -> P | None:
        """This chain's part of type `kind` (a subclass included), or None."""
        return next((p for p in self.parts if isinstance(p, kind)), None)

    def variables(self) -> list:
        return self.traffic.variables() + [v for p in self.parts for v in p.variables()]

    def per_replica_variables(self) -> list:
        return [v for p in self.parts for v in p.per_replica_variables()]

    # -- checkpoints: every replica's copy of per-replica state ---------------------------------
    own_values = staticmethod(own_values)

    def save_replicas(self, owner_variables: Sequence, store, sharded: Sequence = ()) -> None:
        """Adds to a Keras variable store (the owner's `save_own_variables`), which holds one
        value per variable (replica 0's), every replica's copy of the per-replica state
        (error-feedback residuals, DGC buffers, accumulators), as `"<i>.replicas"`. Variables
        in `sharded` are left out: their owner saves them whole (ZeRO's consolidated shards)."""
        per_replica = ({id(v) for v in self.per_replica_variables()}
                       - {id(v) for v in sharded})
        assert self.engine is not None
        for i, var in enumerate(owner_variables):
            copies = self.engine.replica_copies(var)
            if id(var) in per_replica and len(copies) > 1:
                store[f"{i}{REPLICAS_SUFFIX}"] = np.stack([c.numpy() for c in copies])

    def load_replicas(self, owner_variables: Sequence, store) -> None:
        """Inverse of `save_replicas`, on whichever engine loads it (the owner has loaded its
        own values). With as many replicas as saved, each replica takes the copy of its global
        rank (a Horovod rank takes its own from a file saved under MirroredStrategy); otherwise
        each starts from the copies' mean."""
        assert self.engine is not None
        keys = list(store.keys())  # an H5 store: keys() only
        for i, var in enumerate(owner_variables):
            key = f"{i}{REPLICAS_SUFFIX}"
            if key in keys:
                saved = np.asarray(store[key])
                copies = self.engine.replica_copies(var)
                values = ([saved[r] for r in self.engine.local_ranks()]
                          if len(saved) == self.engine.world_size
                          else [saved.mean(axis=0)] * len(copies))
                for copy, value in zip(copies, values):
                    copy.assign(value)

    # -- the counters ----------------------------------------------------------------------------
    @property
    def bytes_sent(self) -> float:
        """Total bytes this worker has sent (ring-algorithm accounting, see `tfdist.comm`)."""
        return self.traffic.bytes_sent

    @property
    def collective_calls(self) -> int:
        """Collective calls this worker has made."""
        return self.traffic.collective_calls

    @property
    def communication_rounds(self) -> int:
        """Gradient exchanges and model-averaging rounds so far."""
        return self.traffic.communication_rounds

    def dense_bytes_per_exchange(self) -> float | None:
        return self.traffic.dense_bytes_per_exchange()


def _rows_pay(grad: tf.IndexedSlices, variable, world_size: int) -> bool:
    """Whether an embedding's gradient goes as its rows (`gathers_rows`): fewer bytes than the
    whole table's all-reduce, or a row count unknown when traced."""
    size = grad.values.dtype.size
    row = size * int(np.prod(variable.shape[1:]))
    return gathers_rows(grad.values.shape[0], row, row * int(variable.shape[0]), world_size)


def chain_of(optimizer) -> Chain | None:
    """The `Chain` behind an optimizer: a tfdist wrapper's, or the one a tfdist strategy attached
    to a Keras optimizer (also inside Keras' LossScaleOptimizer); None for any other.

    Example:
        ```python
        strategy = tfdist.CompressedStrategy("powersgd", devices=tfdist.devices.local_devices(2))
        with strategy.scope():
            model = build_model()
            model.compile(optimizer=keras.optimizers.Adam(), loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=64, epochs=1, verbose=0)
        chain = tfdist.optimizers.chain_of(model.optimizer)  # your own Adam's, attached
        print(chain.bytes_sent, "bytes sent in", chain.communication_rounds, "exchanges")
        ```
    """
    while optimizer is not None:
        chain = getattr(optimizer, "chain", None)
        if isinstance(chain, Chain):
            return chain
        attached = attachment(optimizer)
        if attached is not None:
            return attached
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return None
