"""Stochastic quantization to a few levels: QSGD (uniform levels) and NUQSGD (exponential levels).

Alistarh et al., "QSGD", NeurIPS 2017; Ramezani-Kebrya et al., "NUQSGD", JMLR 2021. Each bucket
of `bucket_size` elements is sent as its L2 norm (float32) and, per element, a sign and a level
index, rounded up or down at random so that the estimate is unbiased. Codes are bit-packed.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfdist.arguments import check_int
from tfdist.compression import packing
from tfdist.compression.base import Compressor, register, stateless_seed


def _code_bits(num_codes: int) -> int:
    for bits in (1, 2, 4, 8, 16):
        if num_codes <= 2**bits:
            return bits
    raise ValueError(f"too many quantization codes: {num_codes}")


@register("qsgd")
class QSGD(Compressor):
    """Unbiased stochastic quantization of each bucket to `levels` uniform levels in [0, 1].

    Args:
        levels: Quantization levels s >= 1 (codes in [-s, s]).
        bucket_size: Elements per bucket, each with its own norm. Defaults to 512.
        seed: Seed of the stochastic rounding (combined with the step and the worker's rank).
    """

    unbiased = True

    def __init__(self, levels: int = 8, bucket_size: int = 512, seed: int = 0):
        self.levels = check_int("levels", levels, 1, 32767)
        self.bucket_size = check_int("bucket_size", bucket_size, 1, 2**24)
        self.seed = check_int("seed", seed, 0, 2**31 - 1)

    def level_values(self) -> np.ndarray:
        """The quantization points in [0, 1], increasing, starting at 0 and ending at 1."""
        return np.linspace(0.0, 1.0, self.levels + 1, dtype=np.float32)

    def init_state(self, shape, dtype, seed=0):
        return {"tensor_seed": tf.constant(seed, tf.int64)}

    def compress(self, x, state, step, rank=0):
        points = tf.constant(self.level_values())
        top = len(self.level_values()) - 1
        flat = tf.cast(tf.reshape(x, [-1]), tf.float32)
        n = flat.shape[0]
        buckets = -(-n // self.bucket_size)
        padded = tf.reshape(tf.pad(flat, [[0, buckets * self.bucket_size - n]]),
                           [buckets, self.bucket_size])
        norms = tf.norm(padded, axis=1)
        r = tf.math.divide_no_nan(tf.abs(padded), norms[:, None])
        r = tf.minimum(r, 1.0)
        lower = tf.clip_by_value(tf.searchsorted(points, tf.reshape(r, [-1]), side="right") - 1,
                                 0, top - 1)
        lower = tf.reshape(lower, r.shape)
        lo, hi = tf.gather(points, lower), tf.gather(points, lower + 1)
        p_up = (r - lo) / (hi - lo)
        u = tf.random.stateless_uniform(r.shape, seed=stateless_seed(
            self.seed, state["tensor_seed"], rank, step))
        index = lower + tf.cast(u < p_up, lower.dtype)
        signed = tf.where(padded < 0, -index, index)
        codes = tf.reshape(signed + top, [-1])[:n]  # in [0, 2 * top]
        bits = _code_bits(2 * top + 1)
        return (norms, packing.pack(codes, bits)), (x.shape, x.dtype, n, bits), state

    def decompress(self, payload, ctx):
        norms, words = payload
        shape, dtype, n, bits = ctx
        points = tf.constant(self.level_values())
        top = len(self.level_values()) - 1
        signed = packing.unpack(words, bits, n) - top
        magnitude = tf.gather(points, tf.abs(signed)) * tf.sign(tf.cast(signed, tf.float32))
        scale = tf.repeat(norms, self.bucket_size)[:n]
        return tf.cast(tf.reshape(magnitude * scale, shape), dtype)

    def get_config(self):
        return {"levels": self.levels, "bucket_size": self.bucket_size, "seed": self.seed}


@register("nuqsgd")
class NUQSGD(QSGD):
    """QSGD with exponentially spaced levels {0, 2^(1-s), ..., 1/2, 1}: finer near zero, where
    most normalized gradient entries lie."""

    def level_values(self) -> np.ndarray:
        s = self.levels
        return np.array([0.0] + [2.0 ** (j - s) for j in range(1, s + 1)], dtype=np.float32)
