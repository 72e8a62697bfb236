"""TernGrad (Wen et al., NeurIPS 2017): each element becomes -1, 0 or +1 times the tensor's
largest magnitude, rounded at random so the estimate is unbiased. 2 bits per element, packed."""

from __future__ import annotations

import tensorflow as tf

from tfdist.arguments import check_int
from tfdist.compression import packing
from tfdist.compression.base import Compressor, register, stateless_seed, xla


@xla
def _ternary_payload(flat, u):
    scale = tf.reduce_max(tf.abs(flat))
    p = tf.math.divide_no_nan(tf.abs(flat), scale)
    keep = tf.cast(u < p, tf.int32)
    codes = tf.where(flat < 0, -keep, keep) + 1  # {0, 1, 2}
    return scale[None], packing.pack(codes, 2)


@xla
def _ternary_values(scale, words, n):
    return tf.cast(packing.unpack(words, 2, n) - 1, tf.float32) * scale[0]


@register("terngrad")
class TernGrad(Compressor):
    """Unbiased ternary quantization with a per-tensor scale max|x|.

    Args:
        seed: Seed of the stochastic rounding (combined with the step and the worker's rank).

    Example:
        ```python
        codec = tfdist.compression.TernGrad()
        gradient = tf.random.normal([64, 100])
        payload, ctx, _ = codec.compress(gradient, codec.init_state(gradient.shape, gradient.dtype), step=0)
        approx = codec.decompress(payload, ctx)  # each value -max|g|, 0 or max|g|, unbiased
        assert len(np.unique(np.abs(approx.numpy()))) <= 2
        ```
    """

    unbiased = True

    def __init__(self, seed: int = 0):
        self.seed = check_int("seed", seed, 0, 2**31 - 1)

    def init_state(self, shape, dtype, seed=0):
        return {"tensor_seed": tf.constant(seed, tf.int64)}

    def compress(self, x, state, step, rank=0):
        flat = tf.cast(tf.reshape(x, [-1]), tf.float32)
        # The random numbers come from TensorFlow's kernel (XLA's CPU generator is far slower).
        u = tf.random.stateless_uniform(flat.shape, seed=stateless_seed(
            self.seed, state["tensor_seed"], rank, step))
        return _ternary_payload(flat, u), (x.shape, x.dtype, flat.shape[0]), state

    def decompress(self, payload, ctx):
        shape, dtype, n = ctx
        return tf.cast(tf.reshape(_ternary_values(*payload, n), shape), dtype)

    def get_config(self):
        return {"seed": self.seed}
