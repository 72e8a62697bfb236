"""`GradientExchange`: how gradients cross the workers, with its state and byte counters.

The algorithm core that both entry points share: `DistributedOptimizer` (a wrapper, either
engine) and the tfdist strategies (which attach one to the user's own Keras optimizer). It sends
each tensor dense or through a compressor, switches between phases (a dense start, DGC's sparsity
warm-up), keeps compressor state and counters as variables of an owner optimizer (so checkpoints
carry them), and calls back to apply the reduced gradients inside the phase that produced them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from tfdist import compression
from tfdist.comm import ByteCounter, Communicator
from tfdist.comm.control import Holes, replica_cond


class GradientExchange:
    """Dense or compressed gradient reduction over a Communicator.

    Args:
        compressor: A compressor, its registry name or config, or None (dense all-reduce).
        min_compress_size: Tensors with fewer elements are sent dense. Defaults to 1024.
        compress_1d: Also compress 1-D tensors. Defaults to False.
        start_step: Exchanges sent dense before compression starts. Defaults to 0.
        track_norms: Accumulate each tensor's local squared gradient norm in `grad_sq` (what
            `tfdist.callbacks.Accordion` reads). Always on with an `Adaptive` compressor.
    """

    def __init__(self, compressor=None, min_compress_size: int = 1024, compress_1d: bool = False,
                 start_step: int = 0, track_norms: bool = False):
        for arg, value in (("min_compress_size", min_compress_size),
                           ("compression_start_step", start_step)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"`{arg}` must be an integer >= 0. Received: {arg}={value!r}")
        self.compressor = compression.get(compressor)
        self.min_compress_size = int(min_compress_size)
        self.compress_1d = bool(compress_1d)
        self.start_step = int(start_step)
        self.track_norms = bool(track_norms) or isinstance(self.compressor, compression.Adaptive)
        self.built = False

    def build(self, owner, var_list) -> None:
        """Creates counters and compressor state as variables of `owner` (a Keras optimizer)."""
        self.owner = owner
        self._bytes_sent = owner.add_variable(
            shape=(), dtype="float64", initializer="zeros", aggregation="none", name="bytes_sent")
        self._rounds = owner.add_variable(
            shape=(), dtype="int64", initializer="zeros", aggregation="none",
            name="communication_rounds")
        self.compression_state: dict[int, dict[str, Any]] = {}
        for index, var in enumerate(var_list):
            if self.compressor is not None and self.should_compress(var):
                self.compression_state[index] = {
                    key: owner.add_variable(
                        shape=value.shape, dtype=value.dtype.name, aggregation="none",
                        initializer=lambda shape, dtype, value=value: value,
                        name=f"compression_{key.replace('.', '_')}")
                    for key, value in self.compressor.init_state(var.shape, var.dtype,
                                                                 seed=index).items()
                }
        self.grad_sq: dict[int, Any] = {}
        if self.track_norms:
            self.grad_sq = {index: owner.add_variable(shape=(), dtype="float32", aggregation="none",
                                                      initializer="zeros", name="grad_sq")
                            for index in range(len(var_list))}
            self.norm_samples = owner.add_variable(shape=(), dtype="int64", aggregation="none",
                                                   initializer="zeros", name="norm_samples")
        self.phases = self._phases()
        self.built = True

    def should_compress(self, var) -> bool:
        shape = tf.TensorShape(var.shape)
        return (self.compressor is not None
                and shape.num_elements() >= self.min_compress_size
                and (shape.rank >= 2 or self.compress_1d)
                and self.compressor.applies_to(shape))

    def _phases(self) -> list[tuple[int, Any]]:
        """(first exchange, compressor or None for dense) for each phase of training."""
        if self.compressor is None or not self.compression_state:
            return [(0, None)]
        default: list[tuple[int, Any]] = [(0, self.compressor)]
        phases = getattr(self.compressor, "phases", lambda: default)()
        dense: list[tuple[int, Any]] = [(0, None)] if self.start_step > 0 else []
        return dense + [(self.start_step + first, c) for first, c in phases]

    # -- state -------------------------------------------------------------------------------
    def counter(self) -> ByteCounter:
        return ByteCounter(self._bytes_sent)

    @property
    def bytes_sent(self) -> float:
        """Total bytes this worker has sent (ring-algorithm accounting, see `tfdist.comm`)."""
        return float(self._bytes_sent.numpy()) if self.built else 0.0

    @property
    def communication_rounds(self) -> int:
        """How many times gradients were exchanged."""
        return int(self._rounds.numpy()) if self.built else 0

    def add_round(self) -> None:
        """Counts one exchange made outside `exchange` (e.g. by ZeroOptimizer)."""
        self._rounds.assign_add(1)

    def dense_bytes_per_exchange(self) -> float | None:
        """Bytes a dense float32 all-reduce of the same gradients would send (once traced)."""
        from tfdist.comm import ring_bytes

        if not hasattr(self, "world_size"):
            return None
        return ring_bytes("all_reduce", self.dense_bytes, self.world_size)

    def own_variables(self) -> list:
        """The variables this exchange created on its owner (counters, compressor state)."""
        if not self.built:
            return []
        return ([self._bytes_sent, self._rounds] + self.per_replica_variables()
                + list(self.grad_sq.values()) + ([self.norm_samples] if self.grad_sq else []))

    def per_replica_variables(self) -> list:
        """State whose value differs between replicas (error-feedback residuals, DGC buffers)."""
        return [v for vars_ in self.compression_state.values() for v in vars_.values()]

    # -- the exchange ------------------------------------------------------------------------
    def track(self, grads: list, variables: list) -> None:
        """Adds one micro-batch's local squared gradient norms (if norms are tracked)."""
        if not self.grad_sq:
            return
        for g, v in zip(grads, variables):
            if g is not None:
                self.grad_sq[self.owner._get_variable_index(v)].assign_add(
                    tf.reduce_sum(tf.square(tf.cast(g, tf.float32))))
        self.norm_samples.assign_add(1)

    def mean_gradient_norms(self) -> np.ndarray:
        """RMS over the micro-batches since `reset_norms` of each tensor's local gradient norm."""
        samples = max(int(self.norm_samples.numpy()), 1)
        return np.sqrt([float(self.grad_sq[i].numpy()) / samples for i in sorted(self.grad_sq)])

    def reset_norms(self) -> None:
        for v in self.grad_sq.values():
            v.assign(0.0)
        self.norm_samples.assign(0)

    def exchange(self, comm: Communicator, grads: list, variables: list,
                 apply_fn: Callable[[list], None], reduce_op: str = "sum",
                 track: bool = True) -> None:
        """Reduces this replica's `grads` (None for unused variables) and calls
        `apply_fn(reduced_grads)` in replica context, inside the phase that reduced them.
        `track=False` when the caller already tracked the micro-batches' norms."""
        holes = Holes(grads)
        step = tf.convert_to_tensor(self._rounds)  # exchanges so far
        self.world_size = comm.world_size
        self.dense_bytes = sum(4 * int(np.prod(variables[i].shape)) for i in holes.present)
        if track:
            self.track(grads, variables)

        def phase(p):
            def run(*values):
                reduced = self._reduce(comm, list(values), [variables[i] for i in holes.present],
                                       self.phases[p][1], step, reduce_op)
                apply_fn(holes.refill(reduced))
            return run

        def chain(p, *values):  # phase p runs while step < the next phase's first step
            if p == len(self.phases) - 1:
                phase(p)(*values)
            else:
                replica_cond(step < self.phases[p + 1][0], phase(p),
                             lambda *v: chain(p + 1, *v), args=values)

        chain(0, *holes.values)
        self._rounds.assign_add(1)

    def average(self, comm: Communicator, variables: list, outer=None,
                anchors: list | None = None, buffers: list | None = None, first=False,
                group_size: int | None = None) -> None:
        """Replaces each variable by its mean over workers (one model-averaging round).

        With `outer` (a `tfdist.averaging.SlowMo` or `SMA`), the first len(anchors) variables
        take its update (`outer.update`) from the round's mean, with their `anchors` and
        `buffers`; `first` tells it this is the first round. With `group_size`, the mean is over
        each group of that many consecutive replicas (a host) only. In replica context each
        replica updates its own copy."""
        values = [tf.convert_to_tensor(v) for v in variables]
        means = (comm.all_reduce(values, op="mean") if group_size is None
                 else comm.group_all_reduce(values, group_size, op="mean"))
        anchors, buffers = anchors or [], buffers or []
        n_outer = len(anchors) if outer is not None else 0
        for i, (var, mean) in enumerate(zip(variables, means)):
            if i < n_outer:
                mean, anchor, buffer = outer.update(values[i], tf.cast(mean, values[i].dtype),
                                                    anchors[i], buffers[i], comm.world_size, first)
                anchors[i].assign(anchor)
                buffers[i].assign(buffer)
            var.assign(mean)
        self._rounds.assign_add(1)

    def gossip(self, comm: Communicator, variables: list) -> None:
        """One decentralized round (BAGUA-style ring gossip): each replica replaces each variable
        by the mean of its own and its two ring neighbours' copies (of the one other copy when
        there are two replicas). The copies travel by all-gather, whose bytes are what is counted:
        (N - 1) x the variable's size per replica."""
        n = comm.world_size
        rank = tf.cast(comm.rank, tf.int32)
        for var in variables:
            mine = tf.convert_to_tensor(var)
            copies = comm.all_gather(mine[None])
            if n == 2:
                mixed = tf.reduce_mean(copies, axis=0)
            else:
                left, right = tf.gather(copies, (rank - 1) % n), tf.gather(copies, (rank + 1) % n)
                mixed = (left + mine + right) / 3.0
            var.assign(mixed)
        self._rounds.assign_add(1)

    def _reduce(self, comm, values, variables, compressor, step, reduce_op):
        if compressor is None:
            return comm.all_reduce(values, op=reduce_op)
        states = [self.compression_state.get(self.owner._get_variable_index(v))
                  for v in variables]
        dense = [j for j, st in enumerate(states) if st is None]
        out: list[Any] = [None] * len(values)
        for j, r in zip(dense, comm.all_reduce([values[j] for j in dense], op=reduce_op)):
            out[j] = r
        for j, state_vars in enumerate(states):
            if state_vars is None:
                continue
            state = {k: tf.convert_to_tensor(v) for k, v in state_vars.items()}
            out[j], new_state = compressor.reduce(values[j], state, tf.cast(step, tf.int64), comm,
                                                  op=reduce_op)
            for k, v in new_state.items():
                if v is not state[k]:
                    state_vars[k].assign(v)
        return out

    def get_config(self) -> dict[str, Any]:
        return {"compressor": compression.serialize(self.compressor),
                "min_compress_size": self.min_compress_size, "compress_1d": self.compress_1d,
                "compression_start_step": self.start_step, "track_norms": self.track_norms}
