"""Splitting a list of layers into K contiguous stages of similar cost.

`balance_by_size` weighs each layer by its parameter count (the memory each stage holds),
`balance_by_time` by the measured time of its forward and backward on a sample batch. Both
return the number of layers per stage, for `Pipeline.from_layers` / `split`; the split minimizes
the cost of the most expensive stage (the pipeline's bottleneck).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf

__all__ = ["balance_by_size", "balance_by_time", "split", "partition"]


def partition(costs: Sequence[float], k: int) -> list[int]:
    """Sizes of K contiguous, non-empty parts of `costs` whose largest sum is smallest.

    Example:
        ```python
        assert tfdist.pipeline.partition([1, 1, 1, 1, 4], 2) == [4, 1]  # sums 4 and 4
        ```
    """
    n = len(costs)
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"The number of stages must be a positive integer, got {k!r}.")
    if k > n:
        raise ValueError(f"Cannot split {n} layers into {k} stages: every stage needs at least "
                         f"one layer; use at most {n} stages.")
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(costs, dtype=np.float64))])
    # best[p][i]: the smallest bottleneck of the first i layers in p parts; cut[p][i]: last cut.
    best = np.full((k + 1, n + 1), np.inf)
    cut = np.zeros((k + 1, n + 1), dtype=int)
    best[0][0] = 0.0
    for p in range(1, k + 1):
        for i in range(p, n - (k - p) + 1):
            for c in range(p - 1, i):
                value = max(best[p - 1][c], prefix[i] - prefix[c])
                if value < best[p][i]:
                    best[p][i], cut[p][i] = value, c
    sizes, i = [], n
    for p in range(k, 0, -1):
        sizes.append(i - cut[p][i])
        i = cut[p][i]
    return sizes[::-1]


def split(layers: Sequence[keras.layers.Layer], sizes: Sequence[int]) -> list[list]:
    """`layers` cut into consecutive stages of the given sizes.

    Example:
        ```python
        layers = [keras.layers.Dense(8) for _ in range(5)]
        stages = tfdist.pipeline.split(layers, [3, 2])
        assert [len(s) for s in stages] == [3, 2]
        ```
    """
    if sum(sizes) != len(layers) or any(s < 1 for s in sizes):
        raise ValueError(f"Stage sizes {list(sizes)} must be positive and add up to the "
                         f"{len(layers)} layers.")
    stages, start = [], 0
    for size in sizes:
        stages.append(list(layers[start:start + size]))
        start += size
    return stages


def _built(layers, input_shape) -> None:
    x = keras.KerasTensor(tuple(input_shape))
    for layer in layers:
        x = layer(x)


def balance_by_size(layers: Sequence[keras.layers.Layer], k: int, input_shape=None) -> list[int]:
    """Stage sizes balancing the parameter count (layers are built on `input_shape` if needed).

    Example:
        ```python
        layers = [keras.layers.Flatten(), keras.layers.Dense(256), keras.layers.Dense(256),
                  keras.layers.Dense(10)]
        sizes = tfdist.pipeline.balance_by_size(layers, 2, input_shape=(None, 8, 8, 1))
        stages = tfdist.pipeline.split(layers, sizes)
        ```
    """
    if input_shape is not None:
        _built(layers, input_shape)
    unbuilt = [layer.name for layer in layers if not layer.built]
    if unbuilt:
        raise ValueError(f"Layers {unbuilt} are not built: pass input_shape= so their "
                         "parameters can be counted.")
    return partition([max(layer.count_params(), 1) for layer in layers], k)


def balance_by_time(layers: Sequence[keras.layers.Layer], k: int, sample, repeats: int = 5
                    ) -> list[int]:
    """Stage sizes balancing the measured forward + backward time per layer on `sample`
    (the median of `repeats` timings after one warm-up).

    Example:
        ```python
        layers = [keras.layers.Flatten(), keras.layers.Dense(256), keras.layers.Dense(256),
                  keras.layers.Dense(10)]
        sizes = tfdist.pipeline.balance_by_time(layers, 2, sample=x[:64])  # measured on 64 images
        ```
    """
    sample = tf.convert_to_tensor(sample)
    _built(layers, sample.shape)
    costs = []
    x = sample
    for layer in layers:
        def step(inputs, layer=layer):
            with tf.GradientTape() as tape:
                tape.watch(inputs)
                out = layer(inputs, training=True)
            tape.gradient(out, [inputs, *layer.trainable_variables]
                          if inputs.dtype.is_floating else layer.trainable_variables)
            return out
        step(x)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            out = step(x)
            _ = out.numpy()
            samples.append(time.perf_counter() - start)
        costs.append(float(np.median(samples)))
        x = out
    return partition(costs, k)
