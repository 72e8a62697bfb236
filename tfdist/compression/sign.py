"""Sign compressors with 1 bit per element on the wire (packed into int32 words).

* `SignSGD`: scaled sign, x -> mean(|x|) * sign(x) (Bernstein et al. 2018; the scale as in
  EF-signSGD, Karimireddy et al. 2019).
* `OneBit`: 1-bit SGD (Seide et al. 2014): positives become the mean of the positive entries,
  the rest the mean of the non-positive ones.
Both are biased: wrap them in `ErrorFeedback`.
"""

from __future__ import annotations

import tensorflow as tf

from tfdist.compression import packing
from tfdist.compression.base import Compressor, register


def _signs(x):
    flat = tf.cast(tf.reshape(x, [-1]), tf.float32)
    positive = flat > 0
    return flat, positive, packing.pack(tf.cast(positive, tf.int32), 1)


@register("signsgd")
class SignSGD(Compressor):
    """x -> mean(|x|) * sign(x); 1 bit per element plus one float32 scale."""

    def compress(self, x, state, step, rank=0):
        flat, _, bits = _signs(x)
        scale = tf.reduce_mean(tf.abs(flat))[None]
        return (scale, bits), (x.shape, x.dtype, flat.shape[0]), state

    def decompress(self, payload, ctx):
        scale, bits = payload
        shape, dtype, n = ctx
        sign = tf.cast(packing.unpack(bits, 1, n), tf.float32) * 2.0 - 1.0
        return tf.cast(tf.reshape(sign * scale[0], shape), dtype)


@register("onebit")
class OneBit(Compressor):
    """1-bit SGD: two reconstruction values (mean of positives, mean of the rest) plus 1 bit each."""

    def compress(self, x, state, step, rank=0):
        flat, positive, bits = _signs(x)
        pos = tf.cast(positive, tf.float32)
        mean_pos = tf.math.divide_no_nan(tf.reduce_sum(flat * pos), tf.reduce_sum(pos))
        mean_neg = tf.math.divide_no_nan(tf.reduce_sum(flat * (1 - pos)), tf.reduce_sum(1 - pos))
        return (tf.stack([mean_pos, mean_neg]), bits), (x.shape, x.dtype, flat.shape[0]), state

    def decompress(self, payload, ctx):
        means, bits = payload
        shape, dtype, n = ctx
        positive = tf.cast(packing.unpack(bits, 1, n), tf.bool)
        return tf.cast(tf.reshape(tf.where(positive, means[0], means[1]), shape), dtype)
