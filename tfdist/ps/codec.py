"""What a worker's push carries for each variable: its gradient, or a compressor's payload.

The compressors of `tfdist.compression` compress worker-to-server pushes: the worker runs
`compress` (its error-feedback residual and other state stay on the worker), the server runs
`decompress` on each worker's payload. A compressor qualifies when decompressing needs nothing
but the payload and static facts (shape, dtype, sizes): FP16, BF16, top-k, QSGD, TernGrad,
sign and 1-bit, PowerSGD's low-rank factors, each with error feedback. Random-k does not: its
indices come from a seed and the worker's step, which the server does not know. As in the
all-reduce exchange, tensors under `min_size` elements, and 1-D ones unless `compress_1d`, go
as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from tfdist.compression import Compressor
from tfdist.plan.costs import MIN_COMPRESS_SIZE


@dataclass(frozen=True)
class Codec:
    """How one variable's gradient travels: `compressor`'s payload of `specs`, rebuilt with
    the static `ctx`."""

    compressor: Compressor
    ctx: Any
    specs: tuple[tf.TensorSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(s.shape)) * s.dtype.size for s in self.specs)


MIN_SIZE = MIN_COMPRESS_SIZE  # the all-reduce exchange's default `min_compress_size`


def codec_for(compressor: Compressor | None, shape, dtype, seed: int = 0,
              min_size: int = MIN_SIZE, compress_1d: bool = False) -> Codec | None:
    """The codec of a variable of `shape` and `dtype`, or None (sent as it is).

    Raises:
        ValueError: `compressor` needs more than the payload to decompress.
    """
    shape = tf.TensorShape(shape)
    if (compressor is None or shape.num_elements() < min_size
            or (shape.rank < 2 and not compress_1d) or not compressor.applies_to(shape)):
        return None
    dtype = tf.as_dtype(dtype)
    state = compressor.init_state(shape, dtype, seed)
    with tf.init_scope():
        payload, ctx, _ = compressor.compress(tf.zeros(shape, dtype), state,
                                              tf.constant(0, tf.int64), 0)
    if any(tf.is_tensor(leaf) for leaf in tf.nest.flatten(ctx)):
        raise ValueError(
            f"The {type(compressor).__name__} compressor cannot compress pushes to a parameter "
            "server: decompressing needs tensors only the worker has (e.g. random-k's indices "
            "from the worker's step). Use fp16, bf16, topk, qsgd, terngrad, sign, onebit or "
            "powersgd (with or without error feedback).")
    return Codec(compressor, ctx, tuple(tf.TensorSpec(p.shape, p.dtype) for p in payload))


def codecs_for(compressor: Compressor | None, variables, min_size: int = MIN_SIZE,
               compress_1d: bool = False) -> list[Codec | None]:
    return [codec_for(compressor, v.shape, v.dtype, i, min_size, compress_1d)
            for i, v in enumerate(variables)]


def push_specs(codecs: list[Codec | None], variables) -> list[tf.TensorSpec]:
    """The tensors a push carries for `variables`, in order."""
    specs: list[tf.TensorSpec] = []
    for codec, v in zip(codecs, variables):
        specs += list(codec.specs) if codec else [tf.TensorSpec(v.shape, v.dtype)]
    return specs


def push_nbytes(codecs: list[Codec | None], variables) -> int:
    return sum(int(np.prod(s.shape)) * s.dtype.size for s in push_specs(codecs, variables))


def decode(codecs: list[Codec | None], parts: list[np.ndarray]) -> list[np.ndarray]:
    """The gradients of a push: each variable's part, or its payload decompressed."""
    grads, at = [], 0
    for codec in codecs:
        if codec is None:
            grads.append(parts[at])
            at += 1
            continue
        n = len(codec.specs)
        payload = tuple(tf.constant(p) for p in parts[at:at + n])
        grads.append(codec.compressor.decompress(payload, codec.ctx).numpy())
        at += n
    return grads
