"""Keras `fit` internals: the epoch a resumed `fit` starts from, and how a step's logs are
reduced over workers.

Keras 3 `fit` starts at `model._initial_epoch` when it is set (what its own BackupAndRestore
sets in `on_train_begin`); `fit` reads it after `on_train_begin` and clears nothing, so it is set
back to None at the end of training.

Keras' TensorFlow trainer reduces the logs of every training and test step with
`keras.src.backend.tensorflow.trainer.reduce_per_replica(values, strategy, "auto")`; under a
multi-worker strategy that is one cross-worker all-reduce per value (the loss and each metric)
at every step, a synchronisation of all workers per step.
"""

from __future__ import annotations


def set_initial_epoch(model, epoch: int | None) -> None:
    """Makes the `fit` now starting (set in `on_train_begin`) begin at `epoch` (None: fit's
    own `initial_epoch`)."""
    if not hasattr(model, "_initial_epoch"):
        raise RuntimeError("keras.Model has no `_initial_epoch` any more: tfdist's "
                           "BackupAndRestore needs an update for this Keras version.")
    model._initial_epoch = epoch


def keep_step_logs_local() -> None:
    """Makes the steps of strategies whose `step_logs` is "local" return the worker's own logs
    (its first replica's), without a collective. Epoch logs are unchanged: `fit` reads them
    from the metrics' variables, which it reduces over every worker. Idempotent."""
    from keras.src.backend.tensorflow import trainer

    original = trainer.reduce_per_replica
    if getattr(original, "tfdist_local_step_logs", False):
        return

    def reduce_per_replica(values, strategy, reduction):
        if reduction == "auto" and getattr(strategy, "step_logs", None) == "local":
            reduction = "first"
        return original(values, strategy, reduction)

    reduce_per_replica.tfdist_local_step_logs = True  # type: ignore[attr-defined]
    trainer.reduce_per_replica = reduce_per_replica
