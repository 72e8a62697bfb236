"""Accordion (Agarwal et al., MLSys 2021): communicate more in critical learning regimes.

A regime is *critical* for a tensor when its gradient norm (the RMS of its micro-batch gradient
norms over an interval, so independent of the batch size) changed a lot since the last interval:
|‖g_prev‖ - ‖g_now‖| / ‖g_prev‖ >= eta (0.5 in the paper). Rank 0 decides from its own norms and
broadcasts the decision, so every worker switches together. Two modes, as in the paper:

* "compression": each tensor of an `Adaptive(low, high)` compressor uses `low` (light) compression
  while critical and `high` (strong) otherwise;
* "batch_size": the effective batch grows outside critical regimes, through the optimizer's
  gradient accumulation (`small_steps` micro-steps per update while any tensor is critical,
  `large_steps` otherwise).
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tfdist.arguments import check_choice, check_int, check_number
from tfdist.comm import resolve
from tfdist.optimizers import GradientExchange, TrackNorms, chain_of

MODES = ("compression", "batch_size")


def critical_regimes(previous: np.ndarray | None, current: np.ndarray, eta: float) -> np.ndarray:
    """Per tensor: did the gradient norm change by at least `eta` (relative) since last time?

    With no previous interval every tensor is critical (training starts critical).

    Example:
        ```python
        flags = tfdist.callbacks.critical_regimes(np.array([1.0, 1.0]), np.array([1.2, 2.0]), eta=0.5)
        assert flags.tolist() == [False, True]  # only the second norm changed by 50% or more
        ```
    """
    if previous is None:
        return np.ones_like(current, dtype=bool)
    change = np.abs(previous - current) / np.maximum(previous, 1e-12)
    return change >= eta


class Accordion(keras.callbacks.Callback):
    """Switches compression level (or batch size) per critical-regime detection.

    Args:
        eta: Relative change of the gradient norm that marks a critical regime. Defaults to 0.5.
        interval: Decide every `interval` training batches; None decides at each epoch end.
        mode: "compression" (needs an `Adaptive` compressor) or "batch_size" (needs
            `DistributedOptimizer(..., variable_accumulation=True, track_norms=True)`).
        small_steps, large_steps: Accumulation micro-steps in and outside critical regimes
            ("batch_size" mode). Defaults to 1 and 4.
        verbose: Print each decision.

    After each decision, `decisions` holds the per-tensor critical flags, oldest first.

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))
        adaptive = tfdist.compression.Adaptive(low=tfdist.compression.TopK(0.5),
                                               high=tfdist.compression.TopK(0.05))
        with strategy.scope():
            model = build_model()
            model.compile(optimizer=tfdist.DistributedOptimizer(
                keras.optimizers.SGD(0.1), compressor=adaptive, min_compress_size=256),
                          loss="sparse_categorical_crossentropy")
        accordion = tfdist.callbacks.Accordion(eta=0.5, interval=5)
        model.fit(x, y, batch_size=64, epochs=1, callbacks=[accordion])
        print(accordion.decisions[-1])  # per tensor: in a critical regime (low compression)?
        ```
    """

    def __init__(self, eta: float = 0.5, interval: int | None = None, mode: str = "compression",
                 small_steps: int = 1, large_steps: int = 4, verbose: int = 0):
        super().__init__()
        check_number("eta", eta, 0, low_open=True)
        if interval is not None:
            check_int("interval", interval, 1)
        check_choice("mode", mode, MODES)
        if not 1 <= small_steps <= large_steps:
            raise ValueError("Need 1 <= small_steps <= large_steps. Received: "
                             f"small_steps={small_steps}, large_steps={large_steps}")
        self.eta, self.interval, self.mode = float(eta), interval, mode
        self.small_steps, self.large_steps = int(small_steps), int(large_steps)
        self.verbose = verbose
        self.decisions: list[np.ndarray] = []
        self._previous: np.ndarray | None = None
        self._batches = 0

    def on_train_begin(self, logs=None):
        optimizer = self.model.optimizer
        chain = chain_of(optimizer)
        self._norms = None if chain is None else chain.part(TrackNorms)
        if self._norms is None:
            raise ValueError(
                "Accordion needs a tfdist optimizer that tracks gradient norms: an Adaptive "
                "compressor, or DistributedOptimizer(..., track_norms=True).")
        self._indices = sorted(self._norms.grad_sq)
        exchange = chain.part(GradientExchange)
        state = exchange.compression_state if exchange is not None else {}
        self._flags = {i: s["critical"] for i, s in state.items() if "critical" in s}
        if self.mode == "compression" and not self._flags:
            raise ValueError("Accordion(mode='compression') needs an Adaptive(low, high) "
                             "compressor with at least one tensor large enough to compress.")
        if self.mode == "batch_size":
            self._optimizer = optimizer
            while not hasattr(self._optimizer, "set_accumulation_steps"):
                self._optimizer = getattr(self._optimizer, "inner_optimizer", None)
                if self._optimizer is None:
                    raise ValueError("Accordion(mode='batch_size') needs tfdist."
                                     "DistributedOptimizer(..., variable_accumulation=True).")
        self._engine = resolve(self.model.distribute_strategy)

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        if self.interval is not None and self._batches % self.interval == 0:
            self._decide(logs)

    def on_epoch_end(self, epoch, logs=None):
        if self.interval is None:
            self._decide(logs)

    def _decide(self, logs) -> None:
        norms = self._norms.mean_gradient_norms()
        mine = critical_regimes(self._previous, norms, self.eta).astype(np.float32)
        # Rank 0's decision (and norms) for everyone.
        shared = self._engine.run(lambda comm: comm.broadcast(
            [tf.constant(mine), tf.constant(norms, tf.float32)], root=0))
        critical = np.asarray(shared[0]) > 0.5
        self._previous = np.asarray(shared[1], dtype=np.float64)
        self.decisions.append(critical)
        self._norms.reset()
        if self.mode == "compression":
            for pos, i in enumerate(self._indices):
                if i in self._flags:
                    self._flags[i].assign(int(critical[pos]))
        else:
            self._optimizer.set_accumulation_steps(
                self.small_steps if critical.any() else self.large_steps)
        fraction = float(critical.mean())
        if logs is not None:
            logs["accordion_critical"] = fraction
        if self.verbose:
            print(f"\nAccordion: {int(critical.sum())}/{len(critical)} tensors critical")
