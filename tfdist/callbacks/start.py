"""Starting `fit` in the middle of a run: at a given global step, the data positioned there.

`StartAt(step, steps_per_epoch)` makes `fit` begin in epoch `step // steps_per_epoch` and pass
that epoch's first `step % steps_per_epoch` steps without running them (no data read, nothing
trained), so epochs, callbacks and learning-rate schedules count as in a run never stopped.
`BackupAndRestore` resumes its backups this way; a parameter-server worker that comes back
resumes at the step the servers hold for it.
"""

from __future__ import annotations

import keras

from tfdist._hooks.training import set_initial_epoch
from tfdist.arguments import check_int


class SkippedSteps:
    """Replaces `model.train_function` so that its next `count` calls run nothing (they return
    the metrics as they are, or no logs before the metrics are built); then puts the original
    back."""

    def __init__(self, model, count: int):
        self.model = model
        self.remaining = count
        self.skipping = False
        self._original = original = model.train_function

        def train_function(iterator):
            if self.remaining > 0:
                self.remaining -= 1
                self.skipping = True
                try:
                    return model.get_metrics_result()
                except ValueError:  # the metrics are built by the first step that runs
                    return {}
            self.remove()
            return original(iterator)

        train_function.skipped_steps = self  # type: ignore[attr-defined]  # read by `skipping`
        model.train_function = train_function

    def remove(self) -> None:
        self.skipping = False
        if self._original is not None:
            self.model.train_function = self._original
            self._original = None


def skipping(model) -> bool:
    """Whether the batch `fit` is on is a finished step passed over (`SkippedSteps`: nothing
    ran): callbacks that time steps or count what they sent leave it out."""
    skipped = getattr(getattr(model, "train_function", None), "skipped_steps", None)
    return skipped is not None and skipped.skipping


class StartAt(keras.callbacks.Callback):
    """Begins `fit` at global step `step` (see the module docstring); feed `fit` data that
    starts at that step (e.g. `tfdist.data.global_batches(..., start=step)`).

    Args:
        step: Steps already trained (>= 0).
        steps_per_epoch: `fit`'s steps per epoch (>= 1).

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))
        with strategy.scope():
            model = build_model()
            model.compile(optimizer=tfdist.DistributedOptimizer(keras.optimizers.Adam()),
                          loss="sparse_categorical_crossentropy")
        # start at global step 30 of 22-step epochs: epoch 2, its 9th batch
        start = tfdist.callbacks.StartAt(30, steps_per_epoch=22)
        data = tfdist.data.distribute(strategy, x, y, 64, start=30)
        model.fit(data, epochs=2, steps_per_epoch=22, callbacks=[start])
        ```
    """

    def __init__(self, step: int, steps_per_epoch: int):
        super().__init__()
        self.step = check_int("step", step, 0)
        self.steps_per_epoch = check_int("steps_per_epoch", steps_per_epoch, 1)
        self._skipped: SkippedSteps | None = None

    def on_train_begin(self, logs=None):
        epoch, batch = divmod(self.step, self.steps_per_epoch)
        if epoch or batch:
            set_initial_epoch(self.model, epoch)
        if batch:
            self._skipped = SkippedSteps(self.model, batch)

    def on_train_end(self, logs=None):
        if self._skipped is not None:
            self._skipped.remove()
            self._skipped = None
        set_initial_epoch(self.model, None)
