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
from tfdist.compression.base import Compressor, register, xla


@xla
def _sign_payload(flat):
    return tf.reduce_mean(tf.abs(flat))[None], packing.pack(tf.cast(flat > 0, tf.int32), 1)


@xla
def _sign_values(scale, bits, n):
    return (tf.cast(packing.unpack(bits, 1, n), tf.float32) * 2.0 - 1.0) * scale[0]


@xla
def _onebit_payload(flat):
    pos = tf.cast(flat > 0, tf.float32)
    mean_pos = tf.math.divide_no_nan(tf.reduce_sum(flat * pos), tf.reduce_sum(pos))
    mean_neg = tf.math.divide_no_nan(tf.reduce_sum(flat * (1 - pos)), tf.reduce_sum(1 - pos))
    return tf.stack([mean_pos, mean_neg]), packing.pack(tf.cast(pos, tf.int32), 1)


@xla
def _onebit_values(means, bits, n):
    return tf.where(packing.unpack(bits, 1, n) > 0, means[0], means[1])


def _flat(x):
    return tf.cast(tf.reshape(x, [-1]), tf.float32)


@register("signsgd")
class SignSGD(Compressor):
    """x -> mean(|x|) * sign(x); 1 bit per element plus one float32 scale.

    Example:
        ```python
        codec = tfdist.compression.SignSGD()
        gradient = tf.random.normal([64, 100])
        payload, ctx, _ = codec.compress(gradient, codec.init_state(gradient.shape, gradient.dtype), step=0)
        approx = codec.decompress(payload, ctx)  # mean(|g|) * sign(g): 1 bit per value
        assert len(np.unique(np.abs(approx.numpy()))) == 1
        ```
    """

    def compress(self, x, state, step, rank=0):
        flat = _flat(x)
        return _sign_payload(flat), (x.shape, x.dtype, flat.shape[0]), state

    def decompress(self, payload, ctx):
        shape, dtype, n = ctx
        return tf.cast(tf.reshape(_sign_values(*payload, n), shape), dtype)


@register("onebit")
class OneBit(Compressor):
    """1-bit SGD: two reconstruction values (mean of positives, mean of the rest) plus 1 bit each.

    Example:
        ```python
        codec = tfdist.compression.OneBit()
        gradient = tf.random.normal([64, 100])
        payload, ctx, _ = codec.compress(gradient, codec.init_state(gradient.shape, gradient.dtype), step=0)
        approx = codec.decompress(payload, ctx)  # two values: the mean of the positives, the mean of the rest
        assert len(np.unique(approx.numpy())) == 2
        ```
    """

    def compress(self, x, state, step, rank=0):
        flat = _flat(x)
        return _onebit_payload(flat), (x.shape, x.dtype, flat.shape[0]), state

    def decompress(self, payload, ctx):
        shape, dtype, n = ctx
        return tf.cast(tf.reshape(_onebit_values(*payload, n), shape), dtype)
