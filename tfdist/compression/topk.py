"""Top-k sparsification (Aji & Heafield 2017; Stich et al. 2018): keep the k largest magnitudes.

Biased: wrap it in `ErrorFeedback`. Payload: k values and k int32 indices, all-gathered.
"""

from __future__ import annotations

import tensorflow as tf

from tfdist.compression.base import Compressor, check_ratio, num_kept, register


def scatter(values: tf.Tensor, indices: tf.Tensor, shape: tf.TensorShape, dtype) -> tf.Tensor:
    n = shape.num_elements()
    dense = tf.scatter_nd(indices[:, None], tf.cast(values, dtype), [n])
    return tf.reshape(dense, shape)


@register("topk")
class TopK(Compressor):
    """Keeps the `ratio` share of elements with the largest magnitude.

    Args:
        ratio: Share of elements kept, in (0, 1]. 0.01 keeps 1%.
    """

    def __init__(self, ratio: float):
        self.ratio = check_ratio(ratio)

    def compress(self, x, state, step, rank=0):
        flat = tf.reshape(x, [-1])
        k = num_kept(flat.shape[0], self.ratio)
        _, indices = tf.math.top_k(tf.abs(flat), k=k, sorted=False)
        return (tf.gather(flat, indices), indices), (x.shape, x.dtype), state

    def decompress(self, payload, ctx):
        values, indices = payload
        return scatter(values, indices, *ctx)

    def get_config(self):
        return {"ratio": self.ratio}
