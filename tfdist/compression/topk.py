"""Top-k sparsification (Aji & Heafield 2017; Stich et al. 2018): keep the k largest magnitudes.

Biased: wrap it in `ErrorFeedback`. Payload: k values and k int32 indices, all-gathered.
"""

from __future__ import annotations

import math

import tensorflow as tf

from tfdist.arguments import check_ratio
from tfdist.compression.base import Compressor, register
from tfdist.plan.costs import num_kept

# Below these sizes a full selection is as cheap as the sampled one.
_SAMPLED_MIN_SIZE = 1 << 16
_SAMPLED_MAX_SHARE = 1 / 16
_SAMPLE_SHARE = 1 / 64  # the share of elements sampled for the threshold


def largest(magnitudes: tf.Tensor, k: int, margin_sigmas: float = 5.0) -> tf.Tensor:
    """Indices (int32) of the k largest of the 1-D `magnitudes`: the set `tf.math.top_k`
    selects (up to ties), in some order, at a fraction of its cost when k << n.

    A threshold estimated from a random sample (as DGC estimates its threshold), set
    `margin_sigmas` standard deviations of the estimate below the k-th largest, keeps the
    candidates; if at
    least k elements reach it, the k largest are among them and a top-k over the candidates
    finds them, else the full top-k runs. Either way the result is exact.
    """
    n = int(magnitudes.shape[0])
    if n < _SAMPLED_MIN_SIZE or k > n * _SAMPLED_MAX_SHARE:
        return tf.math.top_k(magnitudes, k=k, sorted=False).indices
    size = max(1024, int(n * _SAMPLE_SHARE))
    # A fixed random sample (a strided one can align with a matrix's rows).
    sample = tf.gather(magnitudes, tf.random.stateless_uniform(
        [size], seed=[n, k], maxval=n, dtype=tf.int32))
    expected = k * size / n  # sampled elements among the k largest
    kept = max(1, min(size, int(expected + margin_sigmas * math.sqrt(expected)) + 2))
    threshold = tf.reduce_min(tf.math.top_k(sample, k=kept, sorted=False).values)
    candidates = tf.cast(tf.where(magnitudes >= threshold)[:, 0], tf.int32)

    def among_candidates():
        top = tf.math.top_k(tf.gather(magnitudes, candidates), k=k, sorted=False).indices
        return tf.gather(candidates, top)

    def full():
        return tf.math.top_k(magnitudes, k=k, sorted=False).indices

    return tf.cond(tf.size(candidates) >= k, among_candidates, full)


def subtract_sparse(x: tf.Tensor, values: tf.Tensor, indices: tf.Tensor) -> tf.Tensor:
    """x minus the sparse tensor (values at distinct flat indices): one copy of x, k updates;
    bit for bit `x - scatter(values, indices, ...)`."""
    flat = tf.tensor_scatter_nd_sub(tf.reshape(x, [-1]), indices[:, None], tf.cast(values, x.dtype))
    return tf.reshape(flat, x.shape)


class SparsePayload:
    """For compressors whose payload is (values, flat indices): the workers' payloads summed by
    one scatter (duplicate indices add up), and error feedback's residual by one update."""

    def decompress_sum(self, payloads, ctx):
        values = tf.concat([p[0] for p in payloads], 0)
        indices = tf.concat([p[1] for p in payloads], 0)
        return scatter(values, indices, *ctx)


def scatter(values: tf.Tensor, indices: tf.Tensor, shape: tf.TensorShape, dtype) -> tf.Tensor:
    n = shape.num_elements()
    dense = tf.scatter_nd(indices[:, None], tf.cast(values, dtype), [n])
    return tf.reshape(dense, shape)


@register("topk")
class TopK(SparsePayload, Compressor):
    """Keeps the `ratio` share of elements with the largest magnitude.

    Args:
        ratio: Share of elements kept, in (0, 1]. 0.01 keeps 1%.

    Example (top-1% with error feedback, as `configs/ef_topk.yaml`):
        ```python
        optimizer = tfdist.DistributedOptimizer(
            keras.optimizers.Adam(),
            compressor=tfdist.compression.ErrorFeedback(tfdist.compression.TopK(0.01)))
        ```
    """

    def __init__(self, ratio: float):
        self.ratio = check_ratio(ratio)

    def compress(self, x, state, step, rank=0):
        flat = tf.reshape(x, [-1])
        k = num_kept(flat.shape[0], self.ratio)
        indices = largest(tf.abs(flat), k)
        return (tf.gather(flat, indices), indices), (x.shape, x.dtype), state

    def decompress(self, payload, ctx):
        values, indices = payload
        return scatter(values, indices, *ctx)

    def residual(self, x, payload, ctx):
        return subtract_sparse(x, *payload)

    def get_config(self):
        return {"ratio": self.ratio}
