"""`GradientExchange`: the part of a step that reduces gradients over the workers.

Dense, or through a compressor: tensors large enough are encoded by the compressor, which sees
every compressed tensor of the exchange at once and states its rounds of communication; the
transport (`tfdist.comm.reduce_encoded`) packs each round into one collective call. The rest go
dense, in buckets. The exchange switches between phases (a dense start, DGC's sparsity
warm-up) and keeps compressor state (residuals, PowerSGD's Q, DGC's buffers) as variables of
the owner optimizer, so checkpoints carry it.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tfdist import compression
from tfdist.arguments import check_bool, check_int
from tfdist.comm import bucketed_all_reduce, reduce_encoded
from tfdist.comm.holes import Holes
from tfdist.optimizers.nan_policy import all_finite
from tfdist.optimizers.parts import Part, register
from tfdist.plan.costs import DEFAULT_BUCKET_BYTES, MIN_COMPRESS_SIZE, compresses


@register("GradientExchange")
class GradientExchange(Part):
    """Dense or compressed gradient reduction.

    Args:
        compressor: A compressor, its registry name or config, or None (dense all-reduce).
        min_compress_size: Tensors with fewer elements are sent dense. Defaults to 1024.
        compress_1d: Also compress 1-D tensors. Defaults to False.
        start_step: Exchanges sent dense before compression starts. Defaults to 0.
        bucket_bytes: The dense exchange all-reduces the gradients in buckets of about this
            many bytes, last layers first, one collective call each, so reducing the last
            layers' gradients overlaps the backward pass of the first ones. None: one
            all-reduce of every gradient after the backward pass, as Keras does. Defaults to
            25 MiB (`DEFAULT_BUCKET_BYTES`: ResNet-50 steps 0.84-0.90x Keras' at 1 Gbit/s,
            4 MiB gained less; models under 25 MiB of gradients stay one call). An
            embedding's gradient rows (`Chain.sparse_exchange`) are all-gathered in their place
            in that order, after the buckets of the layers above it.

    Example:
        ```python
        opt = tfdist.DistributedOptimizer(
            keras.optimizers.Adam(1e-3),
            tfdist.optimizers.GradientExchange(tfdist.compression.PowerSGD(rank=2),
                                               start_step=100))
        ```
    """

    reduces = True

    def __init__(self, compressor=None, min_compress_size: int = MIN_COMPRESS_SIZE,
                 compress_1d: bool = False,
                 start_step: int = 0, bucket_bytes: int | None = DEFAULT_BUCKET_BYTES):
        self.min_compress_size = check_int("min_compress_size", min_compress_size, 0)
        self.start_step = check_int("compression_start_step", start_step, 0)
        self.compressor = compression.get(compressor)
        self.compress_1d = check_bool("compress_1d", compress_1d)
        self.bucket_bytes = (None if bucket_bytes is None
                             else check_int("bucket_bytes", bucket_bytes, 1))
        self.compression_state: dict[int, dict[str, Any]] = {}

    def build(self, owner, var_list, engine) -> None:
        self.compression_state = {}
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
        self._exchanges = None
        if self.compression_state:  # the step that seeds stochastic compressors and phases
            self._exchanges = owner.add_variable(shape=(), dtype="int64", initializer="zeros",
                                                 aggregation="none", name="gradient_exchanges")
        self.phases = self._phases()
        self.built = True

    def should_compress(self, var) -> bool:
        shape = tf.TensorShape(var.shape)
        return (self.compressor is not None
                and compresses(shape.as_list(), self.min_compress_size, self.compress_1d)
                and self.compressor.applies_to(shape))

    def _phases(self) -> list[tuple[int, Any]]:
        """(first exchange, compressor or None for dense) for each phase of training."""
        if self.compressor is None or not self.compression_state:
            return [(0, None)]
        default: list[tuple[int, Any]] = [(0, self.compressor)]
        phases = getattr(self.compressor, "phases", lambda: default)()
        dense: list[tuple[int, Any]] = [(0, None)] if self.start_step > 0 else []
        return dense + [(self.start_step + first, c) for first, c in phases]

    def variables(self) -> list:
        return self.per_replica_variables() + ([self._exchanges] if self._exchanges is not None
                                               else [])

    def per_replica_variables(self) -> list:
        """Compressor state: it differs between replicas (residuals, DGC buffers)."""
        return [v for vars_ in self.compression_state.values() for v in vars_.values()]

    # -- the step ------------------------------------------------------------------------------
    def step(self, ctx, grads, next) -> None:
        holes = Holes(grads)
        variables = [ctx.variables[i] for i in holes.present]
        ctx.traffic.note_dense(ctx.comm.world_size, variables)
        step = (tf.constant(0, tf.int64) if self._exchanges is None
                else tf.convert_to_tensor(self._exchanges))

        def phase(p):
            def run(*values):
                next(ctx, holes.refill(self._reduce(ctx, list(values), variables,
                                                    self.phases[p][1], step)))
            return run

        def chain(p, *values):  # phase p runs while step < the next phase's first step
            if p == len(self.phases) - 1:
                phase(p)(*values)
            else:
                ctx.comm.cond(step < self.phases[p + 1][0], phase(p),
                              lambda *v: chain(p + 1, *v), args=values)

        chain(0, *holes.values)
        ctx.traffic.add_round()
        if self._exchanges is not None:
            self._exchanges.assign_add(1)

    def _reduce(self, ctx, values, variables, compressor, step) -> list:
        comm, op = ctx.comm, "sum"  # gradients come divided by the replicas (parts.py)
        if compressor is None:
            return bucketed_all_reduce(comm, values, self.bucket_bytes, op=op)
        found = [self.compression_state.get(ctx.index(v)) for v in variables]
        states: dict[int, dict[str, Any]] = {j: st for j, st in enumerate(found) if st is not None}
        dense = [j for j, st in enumerate(found) if st is None]
        packed = list(states)
        out: list[Any] = [None] * len(values)
        # A compressor may drop a non-finite element (top-k and DGC select by comparisons that
        # are false for NaN), so each worker then also sends, in the dense all-reduce it makes
        # anyway, whether its compressed inputs were finite; one worker's NaN then makes the
        # exchange's output NaN on every worker (and loss scaling / nan_policy see it).
        flagged = not compressor.keeps_nonfinite
        dense_values = [values[j] for j in dense]
        if flagged:
            dtype = dense_values[0].dtype if dense_values else tf.float32
            bad = tf.logical_not(all_finite([values[j] for j in packed]))
            dense_values.append(tf.reshape(tf.cast(bad, dtype), [1]))
        dense_reduced = comm.all_reduce(dense_values, op=op) if dense_values else []
        for j, r in zip(dense, dense_reduced):
            out[j] = r
        current = [{k: tf.convert_to_tensor(v) for k, v in states[j].items()} for j in packed]
        step = tf.cast(step, tf.int64)
        reduced, new_states = reduce_encoded(compressor, [values[j] for j in packed], current,
                                             step, comm, op=op)
        if flagged:  # a cond: no pass over the tensors when every worker was finite
            reduced = tf.cond(dense_reduced[-1][0] > 0,
                              lambda: [r + tf.constant(float("nan"), r.dtype) for r in reduced],
                              lambda: list(reduced))
        # State moves on only if the whole exchange came out finite: the reduced values are the
        # same on every worker, so one worker's inf/NaN (which a summed payload spreads, as
        # PowerSGD's P does) leaves every worker's residuals, Q and buffers as they were.
        finite = all_finite(reduced)
        for j, r, state, new in zip(packed, reduced, current, new_states):
            out[j] = r
            for k, v in new.items():
                if v is not state[k]:  # a cond, not a select: no pass over the tensor
                    states[j][k].assign(tf.cond(finite, lambda v=v: v,
                                                lambda old=state[k]: old))
        return out

    def passes_rows(self) -> bool:
        return self.compressor is None  # dense: an embedding's rows are all-gathered as rows

    def get_config(self) -> dict[str, Any]:
        return {"compressor": compression.serialize(self.compressor),
                "min_compress_size": self.min_compress_size, "compress_1d": self.compress_1d,
                "start_step": self.start_step, "bucket_bytes": self.bucket_bytes}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GradientExchange:
        # An optimizer saved by tfdist 0.2 holds "batched" (encode one tensor at a time when
        # false): the sums are the same either way, so it is read as the batched exchange.
        return cls(**{k: v for k, v in config.items() if k != "batched"})

    def __repr__(self) -> str:
        return f"GradientExchange(compressor={self.compressor!r})"
