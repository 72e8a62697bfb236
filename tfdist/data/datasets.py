"""Data sets that need no network, and how each worker reads its own shard.

The embedded default is the UCI optical-digits set (1,797 8x8 grey images of hand-written digits,
10 classes; Alpaydin & Kaynak 1998, CC BY 4.0), stored in `digits.npz` beside this module.

Sharding is per global batch: all workers draw the same shuffled sequence of global batches, and
worker i of n takes slice i of each. One step of n workers therefore sees exactly the examples of
one global batch, whatever the engine, which is what makes "N workers == one worker on the
global batch" testable.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tensorflow as tf

_DIGITS = Path(__file__).with_name("digits.npz")


def load_digits(split: str = "train", test_fraction: float = 0.2, seed: int = 0):
    """The embedded digits set as (images float32 [n, 8, 8, 1] in [0, 1], labels int32 [n]).

    Args:
        split: "train", "test" or "all".
        test_fraction: Share of examples held out for "test", stratified by a fixed shuffle.
        seed: Seed of the train/test split.
    """
    if split not in ("train", "test", "all"):
        raise ValueError(f"`split` must be 'train', 'test' or 'all'. Received: split={split!r}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"`test_fraction` must be in (0, 1). Received: test_fraction={test_fraction}")
    with np.load(_DIGITS) as f:
        images, labels = f["images"], f["labels"]
    x = (images.astype(np.float32) / 16.0)[..., None]
    y = labels.astype(np.int32)
    if split == "all":
        return x, y
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = int(round(len(y) * test_fraction))
    idx = order[:n_test] if split == "test" else order[n_test:]
    return x[idx], y[idx]


def synthetic_classification(
    num_examples: int, input_shape=(32,), num_classes: int = 10, seed: int = 0
):
    """A learnable synthetic set: labels from a fixed random linear map of Gaussian inputs."""
    if num_examples < 1 or num_classes < 2:
        raise ValueError(
            "Need num_examples >= 1 and num_classes >= 2. "
            f"Received: num_examples={num_examples}, num_classes={num_classes}"
        )
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_examples, *input_shape)).astype(np.float32)
    w = rng.standard_normal((int(np.prod(input_shape)), num_classes)).astype(np.float32)
    y = np.argmax(x.reshape(num_examples, -1) @ w, axis=1).astype(np.int32)
    return x, y


def global_batches(x, y, global_batch_size: int, seed: int = 0, shuffle: bool = True,
                   repeat: bool = True) -> tf.data.Dataset:
    """Batches of `global_batch_size`, the same sequence on every worker (same seed)."""
    if global_batch_size < 1 or global_batch_size > len(y):
        raise ValueError(
            f"`global_batch_size` must be in [1, {len(y)}] (the number of examples). "
            f"Received: global_batch_size={global_batch_size}"
        )
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    if shuffle:
        ds = ds.shuffle(len(y), seed=seed, reshuffle_each_iteration=True)
    ds = ds.batch(global_batch_size, drop_remainder=True)
    return ds.repeat() if repeat else ds


def shard_batches(batches: tf.data.Dataset, index: int, count: int) -> tf.data.Dataset:
    """Slice `index` of `count` equal slices of each batch (worker `index`'s share)."""
    if not 0 <= index < count:
        raise ValueError(f"Need 0 <= index < count. Received: index={index}, count={count}")
    batch = batches.element_spec[0].shape[0]
    if batch is None or batch % count:
        raise ValueError(
            f"The global batch size ({batch}) must divide by the number of shards ({count}): "
            f"use a multiple of {count}."
        )
    size = batch // count
    return batches.map(lambda *t: tuple(u[index * size:(index + 1) * size] for u in t))


def distribute(strategy: tf.distribute.Strategy, x, y, global_batch_size: int, seed: int = 0,
               shuffle: bool = True, repeat: bool = True):
    """A distributed dataset in which replica r of R gets slice r of each global batch.

    Works for MirroredStrategy (one input pipeline feeding several replicas) and multi-worker
    strategies (one pipeline per worker). Pass the result to `fit` with `steps_per_epoch`.
    """
    return distribute_batches(strategy, lambda: global_batches(
        x, y, global_batch_size, seed=seed, shuffle=shuffle, repeat=repeat))


def distribute_batches(strategy: tf.distribute.Strategy, make_batches):
    """`distribute` for any dataset of global batches: `make_batches()` returns it (called once
    per input pipeline, so every worker builds the same sequence), and replica r of R gets slice
    r of each batch.

    Raises:
        ValueError: if the global batch size does not divide by the number of replicas.
    """
    replicas = strategy.num_replicas_in_sync
    batch = make_batches().element_spec[0].shape[0]
    if batch is None or batch % replicas:
        raise ValueError(
            f"The global batch size ({batch}) must divide by the number of replicas "
            f"({replicas}): use a multiple of {replicas} (and drop_remainder=True).")
    per_replica = batch // replicas

    def dataset_fn(ctx: tf.distribute.InputContext):
        local = replicas // ctx.num_input_pipelines
        first = ctx.input_pipeline_id * local
        # Each element: this pipeline's `local` replica batches, emitted in replica order.
        ds = make_batches().map(lambda *t: tuple(
            tf.reshape(u, [replicas, per_replica, *u.shape[1:]])[first:first + local] for u in t
        ))
        return ds.unbatch()

    return strategy.distribute_datasets_from_function(dataset_fn)
