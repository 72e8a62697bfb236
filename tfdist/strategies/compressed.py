"""Strategies that compress gradients for the user's own Keras optimizer.

    strategy = tfdist.CompressedStrategy(compression.PowerSGD(rank=4))       # one host
    strategy = tfdist.MultiWorkerCompressedStrategy(compression.TopK(0.01))  # TF_CONFIG workers
    with strategy.scope():
        model = build_model()
        model.compile(optimizer=keras.optimizers.Adam(), loss=...)          # unchanged
    model.fit(...)

Every Keras optimizer built under the strategy's scope gets a `tfdist.optimizers.Chain` with a
`GradientExchange` (the same parts `tfdist.DistributedOptimizer` uses): large tensors are
compressed, the rest all-reduced dense; compressor state and byte counters become the
optimizer's variables (`tfdist.optimizers.chain_of(optimizer)` reads them).
Checkpoints (`model.save`, `save_weights`, `BackupAndRestore`) hold every replica's copy of
the error-feedback state, as the wrapper's do. `tfdist.DistributedOptimizer(inner,
compressor=...)` does the same as a wrapper and adds gradient accumulation and consistent loss
scaling; prefer it when those matter.
"""

from __future__ import annotations

import tensorflow as tf

from tfdist._hooks.distribute import fresh_collective_keys
from tfdist._hooks.optimizer import install_strategy_hooks
from tfdist.comm import DistributeEngine
from tfdist.optimizers import Chain, GradientExchange, TrackNorms
from tfdist.strategies.multi_worker import MultiWorkerMirroredStrategy


class _ExchangeStrategy:
    """Mixin: holds the exchange settings and attaches a fresh chain to each optimizer."""

    def _init_exchange(self, compressor, min_compress_size, compress_1d, compression_start_step):
        probe = GradientExchange(compressor, min_compress_size, compress_1d,
                                 compression_start_step)  # validates the arguments now
        if probe.compressor is None:
            raise ValueError("`compressor` is required (a tfdist.compression compressor, or its "
                             "name such as 'powersgd'). Received: compressor=None")
        self.compressor = probe.compressor
        self._exchange_args = (compressor, min_compress_size, compress_1d,
                               compression_start_step)
        install_strategy_hooks()

    def tfdist_attach(self, optimizer, variables) -> Chain:
        """A built chain for one optimizer (called when the optimizer is built)."""
        from tfdist.compression import Adaptive

        exchange = GradientExchange(*self._exchange_args)
        parts = ([TrackNorms()] if isinstance(exchange.compressor, Adaptive) else []) + [exchange]
        chain = Chain(parts, DistributeEngine(self))
        chain.build(optimizer, variables)
        return chain


class CompressedStrategy(_ExchangeStrategy, tf.distribute.MirroredStrategy):
    """MirroredStrategy (one host, many devices) whose gradient all-reduce is compressed.

    Args:
        compressor: A `tfdist.compression` compressor, or its registry name / config.
        devices: Devices to replicate over (MirroredStrategy's argument). Defaults to all GPUs,
            else the CPU.
        cross_device_ops: MirroredStrategy's argument, for the dense part.
        min_compress_size: Tensors with fewer elements are sent dense. Defaults to 1024.
        compress_1d: Also compress 1-D tensors. Defaults to False.
        compression_start_step: Exchanges sent dense first. Defaults to 0.

    Example:
        ```python
        strategy = tfdist.CompressedStrategy(tfdist.compression.PowerSGD(rank=2),
                                             devices=tfdist.devices.local_devices(2))
        with strategy.scope():
            model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                                      keras.layers.Dense(10, activation="softmax")])
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        x, y = tfdist.data.load_digits()
        model.fit(x, y, batch_size=64, epochs=1)
        ```
    """

    def __init__(self, compressor, devices=None, cross_device_ops=None,
                 min_compress_size: int = 1024, compress_1d: bool = False,
                 compression_start_step: int = 0):
        self._init_exchange(compressor, min_compress_size, compress_1d, compression_start_step)
        fresh_collective_keys()  # this strategy's collectives numbered apart from others'
        super().__init__(devices=devices, cross_device_ops=cross_device_ops)


class MultiWorkerCompressedStrategy(_ExchangeStrategy, MultiWorkerMirroredStrategy):
    """`tfdist.MultiWorkerMirroredStrategy` (TF_CONFIG workers) with a compressed exchange.

    Args: as `CompressedStrategy`, plus `cluster_resolver`, `communication_options`,
    `timeout_seconds` and `step_logs` of `tfdist.MultiWorkerMirroredStrategy`.

    Example (each worker runs it, e.g. under `python -m tfdist.launch --workers 2 -- python
    train.py`):
        ```python
        # python -m tfdist.launch --workers 2 -- python train.py  (TF_CONFIG on each worker)
        strategy = tfdist.MultiWorkerCompressedStrategy({"name": "topk", "ratio": 0.01,
                                                         "error_feedback": True})
        with strategy.scope():
            model = build_model()
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        model.fit(tfdist.data.distribute(strategy, x, y, 64), epochs=3, steps_per_epoch=20)
        ```
    """

    def __init__(self, compressor, cluster_resolver=None, communication_options=None,
                 timeout_seconds: float | None = None, min_compress_size: int = 1024,
                 compress_1d: bool = False, compression_start_step: int = 0,
                 step_logs: str = "averaged"):
        self._init_exchange(compressor, min_compress_size, compress_1d, compression_start_step)
        super().__init__(cluster_resolver=cluster_resolver,
                         communication_options=communication_options,
                         timeout_seconds=timeout_seconds, step_logs=step_logs)
