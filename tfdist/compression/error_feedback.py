"""Error feedback (Seide et al. 2014; Karimireddy et al. 2019): remember what compression
dropped and add it to the next gradient, which makes biased compressors converge."""

from __future__ import annotations

import tensorflow as tf

from tfdist.compression.base import Compressor, get, register, serialize


@register("error_feedback")
class ErrorFeedback(Compressor):
    """Wraps any compressor with a residual: compress(x + e); e <- (x + e) - decompress(...).

    If x + e holds inf or NaN (an overflowing mixed-precision step), the residual is kept as it
    was, so one bad step does not poison all later ones; the non-finite values still reach the
    reduced gradient, where loss scaling sees them and skips the step.

    Args:
        inner: The compressor whose error is fed back.

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))
        top_1_percent = tfdist.compression.ErrorFeedback(tfdist.compression.TopK(0.01))
        with strategy.scope():
            model = build_model()
            model.compile(optimizer=tfdist.DistributedOptimizer(
                keras.optimizers.SGD(0.1), compressor=top_1_percent, min_compress_size=256),
                loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=64, epochs=1)
        ```
    """

    def __init__(self, inner: Compressor):
        if not isinstance(inner, Compressor):
            raise ValueError(f"`inner` must be a Compressor. Received: inner={inner!r}")
        if getattr(inner, "has_error_feedback", False) or isinstance(inner, ErrorFeedback):
            raise ValueError(
                f"{type(inner).__name__} already keeps its own error feedback; do not wrap it in "
                "ErrorFeedback.")
        self.inner = inner
        self.summable = inner.summable
        self.keeps_nonfinite = inner.keeps_nonfinite

    def applies_to(self, shape):
        return self.inner.applies_to(shape)

    def init_state(self, shape, dtype, seed=0):
        inner = self.inner.init_state(shape, dtype, seed)
        return {"residual": tf.zeros(shape, dtype), **{f"inner.{k}": v for k, v in inner.items()}}

    def compress(self, x, state, step, rank=0):
        inner_state = {k[len("inner."):]: v for k, v in state.items() if k.startswith("inner.")}
        corrected = x + tf.cast(state["residual"], x.dtype)
        payload, ctx, inner_state = self.inner.compress(corrected, inner_state, step, rank)
        residual = self.inner.residual(corrected, payload, ctx)
        finite = tf.reduce_all(tf.math.is_finite(corrected))
        old = tf.cast(state["residual"], residual.dtype)
        residual = tf.cond(finite, lambda: residual, lambda: old)
        return payload, ctx, {"residual": residual,
                              **{f"inner.{k}": v for k, v in inner_state.items()}}

    def decompress(self, payload, ctx):
        return self.inner.decompress(payload, ctx)

    def decompress_sum(self, payloads, ctx):
        return self.inner.decompress_sum(payloads, ctx)

    def get_config(self):
        return {"inner": serialize(self.inner)}

    @classmethod
    def from_config(cls, config):
        if set(config) != {"inner"}:
            raise ValueError("Error feedback takes one argument, `inner` (a compressor or its "
                             f"config). Received: {sorted(config)}")
        return cls(get(config["inner"]))
