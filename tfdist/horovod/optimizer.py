"""The Horovod engine's optimizer: `tfdist.DistributedOptimizer` over a HorovodCommunicator."""

from __future__ import annotations

import keras

from tfdist.comm import verify_same_model
from tfdist.comm.horovod import HorovodCommunicator
from tfdist.optimizers.distributed import DistributedOptimizer as _DistributedOptimizer
from tfdist.zero.optimizer import ZeroOptimizer as _ZeroOptimizer


class _HorovodEngine:
    """The Horovod engine's two hooks, shared by every tfdist optimizer it runs."""

    # No strategy divides the loss by the world size here: average instead of sum.
    _reduce_op = "mean"

    def _communicator(self):
        return HorovodCommunicator(self.exchange.counter())

    def _verify_same_model(self, var_list) -> None:
        verify_same_model(var_list, HorovodCommunicator())


@keras.saving.register_keras_serializable(package="tfdist.horovod")
class DistributedOptimizer(_HorovodEngine, _DistributedOptimizer):
    """Averages gradients over Horovod ranks under Keras 3 `model.fit`.

    Horovod's own `horovod.tensorflow.keras.DistributedOptimizer` reduces gradients in methods
    Keras 3 never calls, so it trains each rank on its own data without a word; this one reduces
    in `apply`, which Keras 3 does call. Same arguments as `tfdist.DistributedOptimizer`
    (accumulation, loss scaling, model check); launch with `horovodrun` and call
    `tfdist.horovod.init()` first.

    Example:
        ```python
        import tfdist.horovod as thvd
        thvd.init()
        opt = thvd.DistributedOptimizer(keras.optimizers.Adam(1e-3 * thvd.size()))
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
        model.fit(ds, callbacks=[thvd.callbacks.BroadcastGlobalVariables(0),
                                 thvd.callbacks.MetricAverage()])
        ```
    """


@keras.saving.register_keras_serializable(package="tfdist.horovod")
class ZeroOptimizer(_HorovodEngine, _ZeroOptimizer):
    """`tfdist.ZeroOptimizer` over Horovod ranks: each rank keeps and updates one shard of the
    optimizer state (stage 1) and of the gradients (stage 2), via `hvd.reducescatter` and
    `hvd.allgather`. Same arguments as `tfdist.ZeroOptimizer`; call `tfdist.horovod.init()`
    first and broadcast the initial weights (`callbacks.BroadcastGlobalVariables(0)`)."""
