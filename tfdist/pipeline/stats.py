"""What a run of a pipeline's schedule kept for the backward, per stage."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PipelineStats:
    """What the last built run of the schedule kept for the backward, per stage.

    `peak_microbatches[j]`: the most micro-batches whose forward ran on stage j and whose backward
    had not; `peak_bytes[j]`: the most bytes of tensors stage j kept for them at once (its inputs
    with re-materialization; also every layer's output without), None where shapes are dynamic.

    Example:
        ```python
        stages = [[keras.layers.Flatten(), keras.layers.Dense(64)], [keras.layers.Dense(10)]]
        model = tfdist.pipeline.PipelineModel(
            tfdist.pipeline.Pipeline(stages, devices=tfdist.devices.local_devices(2),
                                     num_microbatches=4, schedule="1f1b"), input_shape=(8, 8, 1))
        model.compile("adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=64, epochs=1, verbose=0)
        print(model.pipeline.stats.peak_microbatches)  # [2, 1]: 1F1B keeps at most k - j per stage
        ```
    """

    schedule: str
    num_microbatches: int
    peak_microbatches: list[int] = field(default_factory=list)
    peak_bytes: list[int | None] = field(default_factory=list)


def nbytes(tensors) -> int | None:
    total = 0
    for t in tensors:
        if not t.shape.is_fully_defined():
            return None
        total += t.shape.num_elements() * t.dtype.size
    return total
