"""Deep Gradient Compression (Lin et al., ICLR 2018).

Top-k sparsification of an accumulated *velocity* with the paper's four techniques:
momentum correction (accumulate u = m u + g, not g), local gradient clipping, momentum factor
masking (sent coordinates are cleared in both u and the accumulator v), and sparsity warm-up
(the kept share shrinks exponentially over the first `warmup_steps` exchanges, e.g. 25% -> 6.25%
-> 1.56% -> 0.4% -> `ratio`). The momentum lives here: give DGC a plain SGD inner optimizer.
"""

from __future__ import annotations

import tensorflow as tf

from tfdist.arguments import check_int, check_number, check_ratio
from tfdist.compression.base import Compressor, register
from tfdist.compression.topk import SparsePayload, largest, scatter
from tfdist.plan.costs import num_kept


@register("dgc")
class DGC(SparsePayload, Compressor):
    """Deep gradient compression. Keeps its own error feedback (the accumulator v).

    Args:
        ratio: Share of elements sent after warm-up, in (0, 1]. Defaults to 0.001.
        momentum: Momentum m of the correction, in [0, 1). Defaults to 0.9.
        clip_norm: Clip each local gradient tensor to this L2 norm first; None to skip.
        warmup_steps: Exchanges over which the kept share decreases to `ratio`. Defaults to 0.
        warmup_ratios: Kept shares during warm-up, used in equal spans of `warmup_steps`.

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))
        with strategy.scope():
            model = build_model()
            # plain SGD inside: DGC keeps the momentum itself (momentum correction)
            model.compile(optimizer=tfdist.DistributedOptimizer(
                keras.optimizers.SGD(0.1), compressor=tfdist.compression.DGC(0.01, momentum=0.9),
                min_compress_size=256), loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=64, epochs=1)
        ```
    """

    has_error_feedback = True

    def __init__(self, ratio: float = 0.001, momentum: float = 0.9, clip_norm: float | None = None,
                 warmup_steps: int = 0, warmup_ratios=(0.25, 0.0625, 0.015625, 0.004)):
        self.ratio = check_ratio(ratio)
        self.momentum = check_number("momentum", momentum, 0, 1, high_open=True)
        self.clip_norm = (None if clip_norm is None
                          else check_number("clip_norm", clip_norm, 0, low_open=True))
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        if not isinstance(warmup_ratios, (list, tuple)) or len(warmup_ratios) > 64:
            raise ValueError("`warmup_ratios` must be a list of at most 64 shares in (0, 1]. "
                             f"Received: warmup_ratios={warmup_ratios!r:.80}")
        self.warmup_ratios = tuple(check_ratio(r, "warmup_ratios") for r in warmup_ratios)

    def phases(self) -> list[tuple[int, DGC]]:
        """(first step, compressor) for each sparsity stage; the optimizer switches between them."""
        if not self.warmup_steps or not self.warmup_ratios:
            return [(0, self)]
        span = max(1, self.warmup_steps // len(self.warmup_ratios))
        stages = [(i * span, self._with_ratio(r)) for i, r in enumerate(self.warmup_ratios)
                  if r > self.ratio]
        return [*stages, (len(stages) * span if stages else 0, self._with_ratio(self.ratio))]

    def _with_ratio(self, ratio: float) -> DGC:
        return DGC(ratio, self.momentum, self.clip_norm, 0, ())

    def init_state(self, shape, dtype, seed=0):
        return {"momentum": tf.zeros(shape, dtype), "velocity": tf.zeros(shape, dtype)}

    def compress(self, x, state, step, rank=0):
        g = x if self.clip_norm is None else tf.clip_by_norm(x, self.clip_norm)
        u = self.momentum * state["momentum"] + g
        v = state["velocity"] + u
        flat = tf.reshape(v, [-1])
        k = num_kept(flat.shape[0], self.ratio)
        indices = largest(tf.abs(flat), k)
        values = tf.gather(flat, indices)

        def cleared(t):  # t with the sent coordinates set to zero (momentum factor masking)
            return tf.reshape(tf.tensor_scatter_nd_update(
                tf.reshape(t, [-1]), indices[:, None], tf.zeros([k], t.dtype)), t.shape)

        finite = tf.reduce_all(tf.math.is_finite(v))
        new_state = {"momentum": tf.cond(finite, lambda: cleared(u), lambda: state["momentum"]),
                     "velocity": tf.cond(finite, lambda: cleared(v), lambda: state["velocity"])}
        return (values, indices), (x.shape, x.dtype), new_state

    def decompress(self, payload, ctx):
        return scatter(payload[0], payload[1], *ctx)

    def get_config(self):
        return {"ratio": self.ratio, "momentum": self.momentum, "clip_norm": self.clip_norm,
                "warmup_steps": self.warmup_steps, "warmup_ratios": list(self.warmup_ratios)}
