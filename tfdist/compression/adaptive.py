"""Two compression levels per tensor, switched during training (the Accordion paper's mechanism).

Agarwal et al., "Accordion: Adaptive Gradient Communication via Critical Learning Regime
Identification", MLSys 2021. Each tensor carries a `critical` flag (state): while it is set the
tensor goes through the `low` (light) compressor, otherwise through the `high` (strong) one. The
decision (which needs every tensor's gradient norm over an interval, tracked by the exchange, and
must be the same on every worker) is made by the `tfdist.callbacks.Accordion` callback, which
writes the flags.
"""

from __future__ import annotations

import tensorflow as tf

from tfdist.comm.transport import Choice
from tfdist.compression.base import Compressor, get, register, serialize


@register("adaptive")
class Adaptive(Compressor):
    """Switches each tensor between a `low` and a `high` compression setting.

    Args:
        low: Compressor used in critical regimes (e.g. `PowerSGD(rank=4)`, `TopK(0.1)`).
        high: Compressor used otherwise (e.g. `PowerSGD(rank=1)`, `TopK(0.01)`).

    Training starts in the critical regime (low compression), as Accordion does.

    Example:
        ```python
        codec = tfdist.compression.Adaptive(low=tfdist.compression.TopK(0.5),
                                            high=tfdist.compression.TopK(0.05))
        # per tensor, tfdist.callbacks.Accordion picks low compression in critical regimes
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))
        with strategy.scope():
            model = build_model()
            model.compile(optimizer=tfdist.DistributedOptimizer(
                keras.optimizers.SGD(0.1), compressor=codec, min_compress_size=256),
                loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=64, epochs=1, callbacks=[tfdist.callbacks.Accordion(interval=5)])
        ```
    """

    has_error_feedback = True  # wrap `low` and `high` themselves in ErrorFeedback if needed

    def __init__(self, low: Compressor, high: Compressor):
        for name, c in (("low", low), ("high", high)):
            if not isinstance(c, Compressor) or isinstance(c, Adaptive):
                raise ValueError(f"`{name}` must be a (non-adaptive) Compressor. Received: {c!r}")
        self.low, self.high = low, high
        self.summable = low.summable and high.summable
        self.keeps_nonfinite = low.keeps_nonfinite and high.keeps_nonfinite

    def applies_to(self, shape):
        return self.low.applies_to(shape) and self.high.applies_to(shape)

    def init_state(self, shape, dtype, seed=0):
        state = {"critical": tf.constant(1, tf.int32)}
        for prefix, c in (("low", self.low), ("high", self.high)):
            state.update({f"{prefix}.{k}": v for k, v in c.init_state(shape, dtype, seed).items()})
        return state

    @staticmethod
    def _split(state, prefix):
        return {k[len(prefix) + 1:]: v for k, v in state.items() if k.startswith(prefix + ".")}

    def encode(self, xs, states, step, rank=0):
        """Each tensor follows its own flag: a choice per tensor between `low`'s rounds and
        `high`'s, made alike on every worker (rank 0's flag, broadcast by Accordion)."""
        totals, new_states = [], []
        for x, state in zip(xs, states):
            total, new_state = yield from self._encode_one(x, state, step)
            totals.append(total)
            new_states.append(new_state)
        return totals, new_states

    def _encode_one(self, x, state, step):
        low_state, high_state = self._split(state, "low"), self._split(state, "high")
        low_keys, high_keys = sorted(low_state), sorted(high_state)
        flat = [low_state[k] for k in low_keys] + [high_state[k] for k in high_keys]

        def rounds(use_low):
            def branch(rank, x, *flat):  # per-replica values come in as arguments (Choice)
                lows = dict(zip(low_keys, flat[:len(low_keys)]))
                highs = dict(zip(high_keys, flat[len(low_keys):]))
                if use_low:
                    (out,), (lows,) = yield from self.low.encode([x], [lows], step, rank)
                else:
                    (out,), (highs,) = yield from self.high.encode([x], [highs], step, rank)
                return [out, *[lows[k] for k in low_keys], *[highs[k] for k in high_keys]]
            return branch

        outputs = yield Choice(tf.equal(state["critical"], 1), rounds(True), rounds(False),
                               args=[x, *flat])
        out, rest = outputs[0], outputs[1:]
        new_state = dict(state)
        for k, v in zip(low_keys, rest[:len(low_keys)]):
            new_state[f"low.{k}"] = v
        for k, v in zip(high_keys, rest[len(low_keys):]):
            new_state[f"high.{k}"] = v
        return out, new_state

    # The single-worker view follows the strong setting (used only outside `reduce`).
    def compress(self, x, state, step, rank=0):
        return self.high.compress(x, self._split(state, "high"), step, rank)

    def decompress(self, payload, ctx):
        return self.high.decompress(payload, ctx)

    def get_config(self):
        return {"low": serialize(self.low), "high": serialize(self.high)}

    @classmethod
    def from_config(cls, config):
        if set(config) != {"low", "high"}:
            raise ValueError("Adaptive takes two arguments, `low` and `high` (compressors or "
                             f"their configs). Received: {sorted(config)}")
        return cls(get(config["low"]), get(config["high"]))
