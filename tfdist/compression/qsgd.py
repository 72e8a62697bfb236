"""Stochastic quantization to a few levels: QSGD (uniform levels) and NUQSGD (exponential levels).

Alistarh et al., "QSGD", NeurIPS 2017; Ramezani-Kebrya et al., "NUQSGD", JMLR 2021. Each bucket
of `bucket_size` elements is sent as its L2 norm (float32) and, per element, a sign and a level
index, rounded up or down at random so that the estimate is unbiased. Codes are bit-packed.

The level below a value is arithmetic (uniform: floor(r s); exponential: from r's binary
exponent), not a search, and quantizing and restoring are each one XLA-compiled kernel.
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from tfdist.arguments import check_int
from tfdist.compression import packing
from tfdist.compression.base import Compressor, register, stateless_seed, xla


def _code_bits(num_codes: int) -> int:
    for bits in (1, 2, 4, 8, 16):
        if num_codes <= 2**bits:
            return bits
    raise ValueError(f"too many quantization codes: {num_codes}")


# -- levels: "uniform" j / s, or "exponential" 0 and 2^(j - s) for j >= 1 --------------------------
def round_down(r, levels: int, spacing: str):
    """(index of the largest level <= r, the probability of rounding up instead) for r in
    [0, 1], so that the rounded value's expectation is r."""
    s = float(levels)
    if spacing == "uniform":
        scaled = r * s
        lower = tf.minimum(tf.floor(scaled), s - 1.0)
        return tf.cast(lower, tf.int32), tf.clip_by_value(scaled - lower, 0.0, 1.0)
    if levels > 100:  # levels below float32's normal range: the general formula
        exponent = tf.floor(tf.math.log(tf.maximum(r, 2.0 ** -126)) / math.log(2.0))
        lower = tf.clip_by_value(exponent + s, 0.0, s - 1.0)
        lo = tf.where(lower > 0, tf.pow(2.0, lower - s), 0.0)
        hi = tf.pow(2.0, lower + 1.0 - s)
        return tf.cast(lower, tf.int32), tf.clip_by_value((r - lo) / (hi - lo), 0.0, 1.0)
    # floor(log2 r) is r's binary exponent field; 2^e is the float with that field.
    exponent = tf.bitwise.right_shift(tf.bitcast(r, tf.int32), 23) - 127
    lower = tf.clip_by_value(exponent + levels, 0, levels - 1)
    inverse_hi = tf.bitcast(tf.bitwise.left_shift(levels - 1 - lower + 127, 23), tf.float32)
    scaled = r * inverse_hi  # r / hi, in [0, 1] where r lies between the two levels
    up = tf.where(lower > 0, 2.0 * scaled - 1.0, scaled)  # lo = hi / 2, or lo = 0
    return lower, tf.clip_by_value(up, 0.0, 1.0)


def level(index, levels: int, spacing: str):
    """The value of a (non-negative int32) level index."""
    if spacing == "uniform":
        return tf.cast(index, tf.float32) / float(levels)
    if levels > 100:
        return tf.where(index > 0, tf.pow(2.0, tf.cast(index - levels, tf.float32)), 0.0)
    power = tf.bitcast(tf.bitwise.left_shift(tf.maximum(index - levels + 127, 1), 23),
                       tf.float32)  # 2^(index - levels)
    return tf.where(index > 0, power, 0.0)


@xla
def _quantize(flat, u, levels: int, bucket_size: int, spacing: str, bits: int):
    n = flat.shape[0]
    buckets = -(-n // bucket_size)
    padded = tf.reshape(tf.pad(flat, [[0, buckets * bucket_size - n]]), [buckets, bucket_size])
    norms = tf.norm(padded, axis=1)
    r = tf.minimum(tf.math.divide_no_nan(tf.abs(padded), norms[:, None]), 1.0)
    lower, p_up = round_down(r, levels, spacing)
    u = tf.reshape(u, r.shape)
    index = lower + tf.cast(u < p_up, tf.int32)
    codes = tf.reshape(tf.where(padded < 0, -index, index) + levels, [-1])[:n]  # in [0, 2 s]
    return norms, packing.pack(codes, bits)


@xla
def _restore(norms, words, n: int, levels: int, bucket_size: int, spacing: str, bits: int):
    signed = packing.unpack(words, bits, n) - levels
    magnitude = level(tf.abs(signed), levels, spacing) * tf.sign(tf.cast(signed, tf.float32))
    return magnitude * tf.repeat(norms, bucket_size)[:n]


@register("qsgd")
class QSGD(Compressor):
    """Unbiased stochastic quantization of each bucket to `levels` uniform levels in [0, 1].

    Args:
        levels: Quantization levels s >= 1 (codes in [-s, s]).
        bucket_size: Elements per bucket, each with its own norm. Defaults to 512.
        seed: Seed of the stochastic rounding (combined with the step and the worker's rank).

    Example:
        ```python
        codec = tfdist.compression.QSGD(levels=8, bucket_size=512)
        gradient = tf.random.normal([64, 100])
        payload, ctx, _ = codec.compress(gradient, codec.init_state(gradient.shape, gradient.dtype), step=0)
        approx = codec.decompress(payload, ctx)  # unbiased: the input on average
        ```
    """

    unbiased = True
    spacing = "uniform"

    def __init__(self, levels: int = 8, bucket_size: int = 512, seed: int = 0):
        self.levels = check_int("levels", levels, 1, 32767)
        self.bucket_size = check_int("bucket_size", bucket_size, 1, 2**24)
        self.seed = check_int("seed", seed, 0, 2**31 - 1)

    def level_values(self) -> np.ndarray:
        """The quantization points in [0, 1], increasing, starting at 0 and ending at 1."""
        return np.linspace(0.0, 1.0, self.levels + 1, dtype=np.float32)

    def _round_down(self, r):
        return round_down(r, self.levels, self.spacing)

    def _level(self, index):
        return level(index, self.levels, self.spacing)

    def init_state(self, shape, dtype, seed=0):
        return {"tensor_seed": tf.constant(seed, tf.int64)}

    def _layout(self) -> tuple:
        return self.levels, self.bucket_size, self.spacing, _code_bits(2 * self.levels + 1)

    def compress(self, x, state, step, rank=0):
        flat = tf.cast(tf.reshape(x, [-1]), tf.float32)
        # The random numbers come from TensorFlow's kernel (XLA's CPU generator is far slower).
        buckets = -(-flat.shape[0] // self.bucket_size)
        u = tf.random.stateless_uniform([buckets * self.bucket_size], seed=stateless_seed(
            self.seed, state["tensor_seed"], rank, step))
        payload = _quantize(flat, u, *self._layout())
        return payload, (x.shape, x.dtype, flat.shape[0]), state

    def decompress(self, payload, ctx):
        shape, dtype, n = ctx
        return tf.cast(tf.reshape(_restore(*payload, n, *self._layout()), shape), dtype)

    def get_config(self):
        return {"levels": self.levels, "bucket_size": self.bucket_size, "seed": self.seed}


@register("nuqsgd")
class NUQSGD(QSGD):
    """QSGD with exponentially spaced levels {0, 2^(1-s), ..., 1/2, 1}: finer near zero, where
    most normalized gradient entries lie.

    Example:
        ```python
        codec = tfdist.compression.NUQSGD(levels=8)
        gradient = tf.random.normal([64, 100])
        payload, ctx, _ = codec.compress(gradient, codec.init_state(gradient.shape, gradient.dtype), step=0)
        approx = codec.decompress(payload, ctx)  # unbiased, finer near zero
        ```
    """

    spacing = "exponential"

    def level_values(self) -> np.ndarray:
        s = self.levels
        return np.array([0.0] + [2.0 ** (j - s) for j in range(1, s + 1)], dtype=np.float32)
