"""Bit packing for low-bit payloads: b-bit codes packed into int32 words, so 1-bit signs cost
1 bit each on the wire (int32 because every collective backend carries it)."""

from __future__ import annotations

import tensorflow as tf


def packed_words(n: int, bits: int) -> int:
    """int32 words needed for n codes of `bits` bits (bits divides 32)."""
    per_word = 32 // bits
    return -(-n // per_word)


def pack(codes: tf.Tensor, bits: int) -> tf.Tensor:
    """Packs a 1-D tensor of non-negative integer codes < 2**bits into int32 words."""
    if 32 % bits:
        raise ValueError(f"`bits` must divide 32. Received: bits={bits}")
    per_word = 32 // bits
    n = codes.shape[0]
    words = packed_words(n, bits)
    codes = tf.cast(codes, tf.int64)
    codes = tf.pad(codes, [[0, words * per_word - n]])
    codes = tf.reshape(codes, [words, per_word])
    shifts = tf.constant([bits * i for i in range(per_word)], tf.int64)
    word = tf.reduce_sum(tf.bitwise.left_shift(codes, shifts), axis=1)  # distinct bits: sum == or
    return tf.bitcast(tf.cast(word, tf.uint32), tf.int32)


def unpack(words: tf.Tensor, bits: int, n: int) -> tf.Tensor:
    """Inverse of `pack`: the first n codes as int32."""
    per_word = 32 // bits
    w = tf.cast(tf.bitcast(words, tf.uint32), tf.int64)[:, None]
    shifts = tf.constant([bits * i for i in range(per_word)], tf.int64)
    codes = tf.bitwise.bitwise_and(tf.bitwise.right_shift(w, shifts), (1 << bits) - 1)
    return tf.cast(tf.reshape(codes, [-1])[:n], tf.int32)
