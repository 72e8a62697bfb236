"""Half-precision casts: FP16 and BF16 (summable; half the bytes of float32)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.compression.base import Compressor, register


class _Cast(Compressor):
    summable = True
    keeps_nonfinite = True
    wire_dtype: tf.DType

    def compress(self, x, state, step, rank=0):
        return (tf.cast(x, self.wire_dtype),), x.dtype, state

    def decompress(self, payload, ctx):
        return tf.cast(payload[0], ctx)


@register("fp16")
class FP16(_Cast):
    """IEEE half precision on the wire (Horovod's `Compression.fp16`). Large sums can overflow
    float16's range (65504): prefer BF16 for gradients of unscaled large magnitude.

    Example:
        ```python
        codec = tfdist.compression.FP16()
        gradient = tf.random.normal([64, 100])
        payload, ctx, _ = codec.compress(gradient, codec.init_state(gradient.shape, gradient.dtype), step=0)
        approx = codec.decompress(payload, ctx)  # float16 on the wire: half the bytes
        assert approx.dtype == tf.float32 and payload[0].dtype == tf.float16
        ```
    """

    wire_dtype = tf.float16


@register("bf16")
class BF16(_Cast):
    """bfloat16 on the wire: float32's range, 8 bits of mantissa.

    Example:
        ```python
        codec = tfdist.compression.BF16()
        gradient = tf.random.normal([64, 100])
        payload, ctx, _ = codec.compress(gradient, codec.init_state(gradient.shape, gradient.dtype), step=0)
        approx = codec.decompress(payload, ctx)  # bfloat16 on the wire: half the bytes
        assert payload[0].dtype == tf.bfloat16
        ```
    """

    wire_dtype = tf.bfloat16
