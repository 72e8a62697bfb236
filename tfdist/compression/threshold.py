"""Threshold sparsification (Strom 2015): send the elements whose magnitude reaches a threshold.

Collectives need static sizes, so at most `max_ratio` of the elements are sent (the largest
first); slots below the threshold carry zeros. Biased: wrap it in `ErrorFeedback`.
"""

from __future__ import annotations

import tensorflow as tf

from tfdist.arguments import check_number, check_ratio
from tfdist.compression.base import Compressor, register
from tfdist.compression.topk import SparsePayload, largest, scatter
from tfdist.plan.costs import num_kept


@register("threshold")
class Threshold(SparsePayload, Compressor):
    """Sends elements with |x| >= `threshold`, at most a `max_ratio` share of them.

    Args:
        threshold: Magnitude threshold (> 0).
        max_ratio: Payload capacity as a share of the elements, in (0, 1]. Defaults to 0.01.

    Example:
        ```python
        codec = tfdist.compression.Threshold(2.0, max_ratio=0.05)
        gradient = tf.random.normal([64, 100])
        payload, ctx, _ = codec.compress(gradient, codec.init_state(gradient.shape, gradient.dtype), step=0)
        approx = codec.decompress(payload, ctx)  # only the values with |g| >= 2, at most 5% of them
        kept = approx.numpy()[approx.numpy() != 0]
        assert len(kept) <= 320 and np.all(np.abs(kept) >= 2.0)
        ```
    """

    def __init__(self, threshold: float, max_ratio: float = 0.01):
        self.threshold = check_number("threshold", threshold, 0, low_open=True)
        self.max_ratio = check_ratio(max_ratio, "max_ratio")

    def compress(self, x, state, step, rank=0):
        flat = tf.reshape(x, [-1])
        k = num_kept(flat.shape[0], self.max_ratio)
        indices = largest(tf.abs(flat), k)
        values = tf.gather(flat, indices)
        values = tf.where(tf.abs(values) >= self.threshold, values, tf.zeros_like(values))
        return (values, indices), (x.shape, x.dtype), state

    def decompress(self, payload, ctx):
        return scatter(payload[0], payload[1], *ctx)

    def get_config(self):
        return {"threshold": self.threshold, "max_ratio": self.max_ratio}
