"""Keras `fit` internals: the epoch a resumed `fit` starts from.

Keras 3 `fit` starts at `model._initial_epoch` when it is set (what its own BackupAndRestore
sets in `on_train_begin`); `fit` reads it after `on_train_begin` and clears nothing, so it is set
back to None at the end of training.
"""

from __future__ import annotations


def set_initial_epoch(model, epoch: int | None) -> None:
    """Makes the `fit` now starting (set in `on_train_begin`) begin at `epoch` (None: fit's
    own `initial_epoch`)."""
    if not hasattr(model, "_initial_epoch"):
        raise RuntimeError("keras.Model has no `_initial_epoch` any more: tfdist's "
                           "BackupAndRestore needs an update for this Keras version.")
    model._initial_epoch = epoch
