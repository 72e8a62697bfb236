"""Linear learning-rate scaling with gradual warm-up for large global batches.

Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour" (2017): with N workers
the learning rate is multiplied by N (the linear scaling rule), and reached gradually over the
first epochs: lr(t) = base_lr * (1 + (scale - 1) * t / warmup_epochs), t in epochs (fractional,
updated every batch), then base_lr * scale.
"""

from __future__ import annotations

import keras


def warmup_learning_rate(base_lr: float, scale: float, warmup_epochs: float, epoch: float) -> float:
    """The warm-up schedule as a pure function of the (fractional) epoch.

    Example:
        ```python
        assert tfdist.callbacks.warmup_learning_rate(0.1, 4, warmup_epochs=2, epoch=1) == 0.25
        ```
    """
    if warmup_epochs <= 0 or epoch >= warmup_epochs:
        return base_lr * scale
    return base_lr * (1.0 + (scale - 1.0) * epoch / warmup_epochs)


class LearningRateWarmup(keras.callbacks.Callback):
    """Ramps the learning rate from `base_lr` to `base_lr * scale` over `warmup_epochs`.

    Args:
        warmup_epochs: Length of the warm-up in epochs (> 0).
        base_lr: The single-worker learning rate. Defaults to the optimizer's learning rate when
            training starts.
        scale: The multiplier reached after warm-up. Defaults to the number of replicas of the
            current `tf.distribute` strategy (the Horovod variant: the number of ranks).
        steps_per_epoch: Batches per epoch. Defaults to what `fit` reports.
        verbose: Print the learning rate at the end of each warm-up epoch.

    The optimizer's learning rate must be a value (not a `LearningRateSchedule`).

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))
        with strategy.scope():
            model = build_model()
            model.compile(optimizer=tfdist.DistributedOptimizer(keras.optimizers.Adam()),
                          loss="sparse_categorical_crossentropy")
        # from the compiled rate to 2x it over the first epoch (Goyal et al.'s warm-up)
        model.fit(x, y, batch_size=64, epochs=2,
                  callbacks=[tfdist.callbacks.LearningRateWarmup(warmup_epochs=1, scale=2)])
        ```
    """

    def __init__(
        self,
        warmup_epochs: float,
        base_lr: float | None = None,
        scale: float | None = None,
        steps_per_epoch: int | None = None,
        verbose: int = 0,
    ):
        super().__init__()
        if warmup_epochs <= 0:
            raise ValueError(f"`warmup_epochs` must be > 0. Received: warmup_epochs={warmup_epochs}")
        if scale is not None and scale <= 0:
            raise ValueError(f"`scale` must be > 0. Received: scale={scale}")
        if steps_per_epoch is not None and steps_per_epoch < 1:
            raise ValueError(
                f"`steps_per_epoch` must be >= 1. Received: steps_per_epoch={steps_per_epoch}"
            )
        self.warmup_epochs = float(warmup_epochs)
        self.base_lr = base_lr
        self.scale = scale
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self._epoch = 0

    def _default_scale(self) -> float:
        return float(self.model.distribute_strategy.num_replicas_in_sync)

    def on_train_begin(self, logs=None):
        optimizer = self.model.optimizer
        current = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
        try:
            optimizer.learning_rate = current
        except TypeError as e:
            raise ValueError(
                "LearningRateWarmup needs a learning rate value, not a LearningRateSchedule; "
                "fold the warm-up into the schedule instead."
            ) from e
        if self.base_lr is None:
            self.base_lr = current
        if self.scale is None:
            self.scale = self._default_scale()
        if self.steps_per_epoch is None:
            self.steps_per_epoch = (self.params or {}).get("steps")
        if not self.steps_per_epoch:
            raise ValueError(
                "LearningRateWarmup needs `steps_per_epoch`: pass it, or give `fit` a dataset "
                "of known length or `steps_per_epoch`."
            )

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        t = self._epoch + batch / self.steps_per_epoch
        if t <= self.warmup_epochs + 1.0 / self.steps_per_epoch:
            self.model.optimizer.learning_rate = warmup_learning_rate(
                self.base_lr, self.scale, self.warmup_epochs, t
            )

    def on_epoch_end(self, epoch, logs=None):
        lr = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        if logs is not None:
            logs["learning_rate"] = lr
        if self.verbose and epoch < self.warmup_epochs:
            print(f"\nEpoch {epoch + 1}: learning rate {lr:.6g}")
