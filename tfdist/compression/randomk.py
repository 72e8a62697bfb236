"""Random-k sparsification with a shared seed (Stich et al. 2018; Wangni et al. 2018).

Every worker draws the same k distinct indices at a given step (a stateless draw from the seed
and the step), so the payloads line up and can be summed by an all-reduce; only values travel. Values are
scaled by n/k, which makes the estimate unbiased.
"""

from __future__ import annotations

import tensorflow as tf

from tfdist.arguments import check_bool, check_int, check_ratio
from tfdist.compression.base import Compressor, register
from tfdist.compression.topk import scatter, subtract_sparse
from tfdist.plan.costs import num_kept


@register("randomk")
class RandomK(Compressor):
    """Keeps a random `ratio` share of elements, the same ones on every worker.

    Args:
        ratio: Share of elements kept, in (0, 1].
        seed: Shared seed (all workers must use the same).
        scale: Scale kept values by n/k (unbiased). Defaults to True.

    Example:
        ```python
        codec = tfdist.compression.RandomK(0.01)
        gradient = tf.random.normal([64, 100])
        payload, ctx, _ = codec.compress(gradient, codec.init_state(gradient.shape, gradient.dtype), step=0)
        approx = codec.decompress(payload, ctx)  # 64 of the 6,400 values, scaled by 100
        assert int(tf.math.count_nonzero(approx)) == 64
        ```
    """

    summable = True
    unbiased = True

    def __init__(self, ratio: float, seed: int = 0, scale: bool = True):
        self.ratio = check_ratio(ratio)
        self.seed = check_int("seed", seed, 0, 2**31 - 1)
        self.scale = check_bool("scale", scale)

    def init_state(self, shape, dtype, seed=0):
        return {"tensor_seed": tf.constant(seed, tf.int64)}

    def _indices(self, n, k, step, tensor_seed):
        """k distinct indices, uniformly at random: the first k distinct ones of a sequence of
        independent uniform draws (what drawing without replacement is), in O(k); in the rare
        case the draws hold fewer than k distinct ones, the k first of a random permutation."""
        seed = tf.stack([tf.cast(self.seed, tf.int64) * 1_000_003 + tensor_seed,
                         tf.cast(step, tf.int64)])
        # Expected repeats among m draws from n: about m^2 / 2n; draw enough to cover them.
        draws = min(4 * n, int(k + 2 * k * k / n + 8 * (k * k / n) ** 0.5 + 64))
        distinct = tf.unique(tf.random.stateless_uniform(
            [draws], seed=seed, maxval=n, dtype=tf.int32)).y

        def permutation():
            return tf.argsort(tf.random.stateless_uniform([n], seed=seed))[:k]

        indices = tf.cond(tf.size(distinct) >= k, lambda: distinct[:k], permutation)
        return tf.ensure_shape(indices, [k])

    def compress(self, x, state, step, rank=0):
        flat = tf.reshape(x, [-1])
        n = flat.shape[0]
        k = num_kept(n, self.ratio)
        indices = self._indices(n, k, step, state["tensor_seed"])
        values = tf.gather(flat, indices)
        if self.scale:
            values = values * tf.cast(n / k, values.dtype)
        return (values,), (x.shape, x.dtype, indices), state

    def decompress(self, payload, ctx):
        shape, dtype, indices = ctx
        return scatter(payload[0], indices, shape, dtype)

    def residual(self, x, payload, ctx):
        return subtract_sparse(x, payload[0], ctx[2])

    def get_config(self):
        return {"ratio": self.ratio, "seed": self.seed, "scale": self.scale}
