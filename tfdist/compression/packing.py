"""Bit packing for low-bit payloads: b-bit codes packed into int32 words, so 1-bit signs cost
1 bit each on the wire (int32 because every collective backend carries it).

With W words, code i sits in word i mod W at bit position b (i div W): each of the 32/b bit
positions takes one contiguous run of W codes, so packing is 32/b shifted ORs of contiguous int32
slices (no int64, no strided access). Unsigned 32-bit arithmetic throughout."""

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
    codes = tf.pad(tf.cast(codes, tf.uint32), [[0, words * per_word - n]])
    runs = tf.reshape(codes, [per_word, words])
    word = runs[0]
    for position in range(1, per_word):
        word = tf.bitwise.bitwise_or(word, tf.bitwise.left_shift(
            runs[position], tf.constant(bits * position, tf.uint32)))
    return tf.bitcast(word, tf.int32)


def unpack(words: tf.Tensor, bits: int, n: int) -> tf.Tensor:
    """Inverse of `pack`: the first n codes as int32."""
    per_word = 32 // bits
    w = tf.bitcast(words, tf.uint32)[None, :]
    shifts = tf.constant([[bits * i] for i in range(per_word)], tf.uint32)
    codes = tf.bitwise.bitwise_and(tf.bitwise.right_shift(w, shifts),
                                   tf.constant((1 << bits) - 1, tf.uint32))
    return tf.cast(tf.reshape(codes, [-1])[:n], tf.int32)
