"""PowerSGD (Vogels et al., NeurIPS 2019): rank-r approximation of each gradient matrix by one
step of power iteration, with error feedback and a warm-started Q.

For M = (gradient + residual) reshaped to [n, m] (m = the last, output dimension):
P = M Q, all-reduce P, orthogonalize P, Q = M^T P, all-reduce Q; the result is P Q^T and the
residual M - P Q_local^T. Both payloads are summable, so a worker sends (n + m) r numbers per
matrix instead of n m. Tensors for which this does not pay (n m <= min_compression_rate (n + m) r)
and 1-D tensors are sent dense.
"""

from __future__ import annotations

import tensorflow as tf

from tfdist.arguments import check_bool, check_int, check_number
from tfdist.comm.transport import Sum
from tfdist.compression.base import Compressor, register, stateless_seed
from tfdist.plan.costs import POWERSGD_MIN_COMPRESSION_RATE, matrix_shape, powersgd_rank


def orthogonalize(p: tf.Tensor, eps: float = 1e-8) -> tf.Tensor:
    """Modified Gram-Schmidt on the columns of p; a zero column stays zero (no NaN)."""
    cols: list[tf.Tensor] = []
    for i in range(p.shape[1]):
        col = p[:, i]
        for q in cols:
            col = col - tf.reduce_sum(q * col) * q
        cols.append(col / (tf.norm(col) + eps))
    return tf.stack(cols, axis=1)


@register("powersgd")
class PowerSGD(Compressor):
    """Rank-`rank` PowerSGD with error feedback and warm start.

    Args:
        rank: Rank r of the approximation, >= 1.
        warm_start: Reuse last step's Q (else a fresh random Q each step). Defaults to True.
        min_compression_rate: Compress a matrix only if n m > rate (n + m) r. Defaults to 2.
        seed: Seed of the initial Q (shared by all workers).
        eps: Orthogonalization guard. Defaults to 1e-8.

    Example:
        ```python
        optimizer = tfdist.DistributedOptimizer(
            keras.optimizers.Adam(), compressor=tfdist.compression.PowerSGD(rank=2))
        ```
    """

    summable = True
    keeps_nonfinite = True  # P = M Q: a non-finite M makes P, then everything, non-finite
    has_error_feedback = True

    def __init__(self, rank: int = 2, warm_start: bool = True,
                 min_compression_rate: float = POWERSGD_MIN_COMPRESSION_RATE, seed: int = 0,
                 eps: float = 1e-8):
        self.rank = check_int("rank", rank, 1, 2**16)
        self.warm_start = check_bool("warm_start", warm_start)
        self.min_compression_rate = check_number("min_compression_rate", min_compression_rate, 0,
                                                 low_open=True)
        self.seed = check_int("seed", seed, 0, 2**31 - 1)
        self.eps = check_number("eps", eps, 0, 1, low_open=True)

    def applies_to(self, shape):
        return powersgd_rank(shape, self.rank, self.min_compression_rate) > 0

    def _r(self, shape):
        n, m = matrix_shape(shape)
        return min(self.rank, n, m)

    def init_state(self, shape, dtype, seed=0):
        n, m = matrix_shape(shape)
        q = tf.random.stateless_normal([m, self._r(shape)], seed=stateless_seed(self.seed, seed))
        return {"q": tf.cast(q, dtype), "residual": tf.zeros(shape, dtype),
                "tensor_seed": tf.constant(seed, tf.int64)}

    def _q(self, state, shape, step):
        if self.warm_start:
            return state["q"]
        n, m = matrix_shape(shape)
        q = tf.random.stateless_normal([m, self._r(shape)], seed=stateless_seed(
            self.seed, state["tensor_seed"], step))
        return tf.cast(q, state["q"].dtype)

    def encode(self, xs, states, step, rank=0):
        """Every matrix of the exchange together, in two rounds: all P's summed, then all Q's
        (two collective calls however many matrices; PyTorch's PowerSGD hook batches the same
        way)."""
        matrices = [tf.reshape(x + tf.cast(s["residual"], x.dtype), matrix_shape(x.shape))
                    for x, s in zip(xs, states)]
        p_locals = [m @ self._q(s, x.shape, step) for m, s, x in zip(matrices, states, xs)]
        ps = [orthogonalize(p, self.eps) for p in (yield Sum(p_locals))]
        q_locals = [tf.transpose(m) @ p for m, p in zip(matrices, ps)]
        qs = yield Sum(q_locals)
        out = [self._finish(x, s, m, p_local, p, q_local, q)
               for x, s, m, p_local, p, q_local, q
               in zip(xs, states, matrices, p_locals, ps, q_locals, qs)]
        return [t for t, _ in out], [new for _, new in out]

    def _finish(self, x, state, matrix, p_local, p, q_local, q):
        """The summed tensor and the new state (residual, warm-start Q) from P and Q."""
        shape = x.shape
        residual = tf.reshape(matrix - p @ tf.transpose(q_local), shape)
        total = p @ tf.transpose(q)
        # An inf or NaN anywhere in the matrix reaches this worker's P = M Q (inf * 0 is NaN),
        # so P, n x r, tells whether the matrix is finite without a pass over it.
        finite = tf.reduce_all(tf.math.is_finite(p_local))
        new_state = dict(state)
        new_state["residual"] = tf.cond(finite, lambda: residual, lambda: state["residual"])
        new_state["q"] = tf.cond(finite, lambda: q, lambda: state["q"])
        return tf.reshape(total, shape), new_state

    # Single-worker view (used for tests and by tools that compress without reducing).
    def compress(self, x, state, step, rank=0):
        shape = x.shape
        n, m = matrix_shape(shape)
        matrix = tf.reshape(x, [n, m])
        p = orthogonalize(matrix @ self._q(state, shape, step), self.eps)
        q = tf.transpose(matrix) @ p
        return (p, q), shape, {**state, "q": q}

    def decompress(self, payload, ctx):
        p, q = payload
        return tf.reshape(p @ tf.transpose(q), ctx)

    def get_config(self):
        return {"rank": self.rank, "warm_start": self.warm_start,
                "min_compression_rate": self.min_compression_rate, "seed": self.seed,
                "eps": self.eps}
