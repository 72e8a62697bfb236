"""Data sets that need no network, and how each worker reads its own shard.

The embedded default is the UCI optical-digits set (1,797 8x8 grey images of hand-written digits,
10 classes; Alpaydin & Kaynak 1998, CC BY 4.0), stored in `digits.npz` beside this module.

Sharding is per global batch: all workers draw the same sequence of global batches (a pure
function of the seed and the epoch), and worker i of n takes slice i of each. One step of n
workers therefore sees exactly the examples of one global batch, whatever the engine, which is
what makes "N workers == one worker on the global batch" testable.
"""

from __future__ import annotations

from collections.abc import Callable
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

    Example:
        ```python
        x, y = tfdist.data.load_digits()  # 1,438 training images; split="test" gives the 359 others
        assert x.shape == (1438, 8, 8, 1) and set(y.tolist()) == set(range(10))
        ```
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
    """A learnable synthetic set: labels from a fixed random linear map of Gaussian inputs.

    Example:
        ```python
        x, y = tfdist.data.synthetic_classification(4096, input_shape=(32,), num_classes=10)
        assert x.shape == (4096, 32) and y.max() < 10
        ```
    """
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


# Orders of more examples than this are computed batch by batch (`_keyed_order`), never whole:
# a stored shuffle takes about 17 bytes an example in every reading process at each epoch's
# start, a keyed bijection of the batch's positions nothing more than the batch.
STORED_ORDER_MAX = 2**24


def epoch_order(num_examples: int, seed: int, epoch, shuffle: bool = True) -> tf.Tensor:
    """The example order of data epoch `epoch`: a stateless shuffle seeded by (seed, epoch), so
    a pure function of its arguments (the same in any process, graph or engine). Of more than
    `STORED_ORDER_MAX` examples, a keyed bijection of the positions instead, which the global
    batches compute batch by batch, holding no order of the whole epoch.

    Example:
        ```python
        order = tfdist.data.epoch_order(5, seed=0, epoch=3)  # the same on every worker and rerun
        assert sorted(order.numpy().tolist()) == [0, 1, 2, 3, 4]
        ```
    """
    order = tf.range(num_examples, dtype=tf.int64)
    if not shuffle:
        return order
    if num_examples > STORED_ORDER_MAX:
        return _keyed_order(order, num_examples, seed, epoch)
    seeds = tf.stack([tf.cast(seed, tf.int64), tf.cast(epoch, tf.int64)])
    return tf.random.experimental.stateless_shuffle(order, seed=seeds)


KEYED_BATCHES = 16  # batches' indices computed at once: a map's cost is mostly per call


def _keyed_order(positions: tf.Tensor, num_examples: int, seed: int, epoch) -> tf.Tensor:
    """The examples at `positions` (int64, in [0, num_examples)) of a pseudo-random order of
    [0, num_examples) keyed by (seed, epoch): a 4-round Feistel network on the bits that cover
    num_examples (two halves, one a bit wider when they are odd), applied again to any value
    past the end (cycle walking, fewer than 2 times on average), so a bijection of
    [0, num_examples) computed from the positions alone. (TensorFlow's
    `tf.random.experimental.index_shuffle` is one too, but its consecutive outputs correlate:
    0.03 to 0.08 over 8 seeds at 20 million, 0.18 at 5 billion, against |0.03| here, chance.)"""
    bits = max(2, int(num_examples - 1).bit_length())
    low = bits // 2
    mask = {w: tf.constant(2**w - 1, tf.uint64) for w in (low, bits - low)}
    key = _mix(tf.cast(seed, tf.uint64) * tf.constant(0xD1B54A32D192ED03, tf.uint64)
               + tf.cast(epoch, tf.uint64))
    keys = [_mix(key + tf.constant(r, tf.uint64)) for r in range(4)]
    end, shift = tf.constant(num_examples, tf.uint64), tf.constant(low, tf.uint64)

    def permute(x):
        left, right = tf.bitwise.right_shift(x, shift), tf.bitwise.bitwise_and(x, mask[low])
        width = bits - low  # the left half's; the halves swap widths each round
        for k in keys:
            left, right = right, tf.bitwise.bitwise_xor(
                left, tf.bitwise.bitwise_and(_mix(tf.bitwise.bitwise_xor(right, k)), mask[width]))
            width = bits - width
        return tf.bitwise.bitwise_or(tf.bitwise.left_shift(left, shift), right)

    (walked,) = tf.while_loop(lambda x: tf.reduce_any(x >= end),
                              lambda x: (tf.where(x >= end, permute(x), x),),
                              (permute(tf.cast(positions, tf.uint64)),))
    return tf.cast(walked, tf.int64)


def _mix(x: tf.Tensor) -> tf.Tensor:
    """SplitMix64's finaliser: every bit of a uint64 tensor stirred into every other."""
    x = x + tf.constant(0x9E3779B97F4A7C15, tf.uint64)
    for shift, times in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(shift, tf.uint64)))
        x = x * tf.constant(times, tf.uint64)
    return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(31, tf.uint64)))


def batch_indices(num_examples: int, global_batch_size: int, seed: int, shuffle: bool,
                  repeat: bool, first: tf.Tensor, shard: tuple[int, int] = (0, 1)):
    """The example indices of slice shard[0] of shard[1] of each global batch, from global
    batch `first` (an int64 scalar tensor) on: data epoch e is the examples in the order
    `epoch_order(num_examples, seed, e)`, cut into num_examples // global_batch_size batches.
    Nothing before `first` is computed; of more than `STORED_ORDER_MAX` examples, each batch's
    indices are computed as it is drawn."""
    index, count = shard
    per_epoch, local = num_examples // global_batch_size, global_batch_size // count
    first_epoch = first // per_epoch
    epochs = tf.data.Dataset.range(first_epoch, tf.int64.max if repeat else first_epoch + 1)

    def stored(e):
        order = epoch_order(num_examples, seed, e, shuffle)[:per_epoch * global_batch_size]
        return tf.data.Dataset.from_tensor_slices(
            tf.reshape(order, [per_epoch, count, local])[:, index])

    def keyed(e):
        def positions(b):
            at = (b[:, None] * global_batch_size + index * local
                  + tf.range(local, dtype=tf.int64)[None])
            return _keyed_order(at, num_examples, seed, e) if shuffle else at

        begin = tf.where(e == first_epoch, first - first_epoch * per_epoch, 0)
        return tf.data.Dataset.range(begin, per_epoch).batch(KEYED_BATCHES).map(
            positions).unbatch()

    if num_examples > STORED_ORDER_MAX:
        return epochs.flat_map(keyed)
    return epochs.flat_map(stored).skip(first - first_epoch * per_epoch)


def global_batches(x, y, global_batch_size: int, seed: int = 0, shuffle: bool = True,
                   repeat: bool = True, start: int | Callable[[], int] = 0) -> tf.data.Dataset:
    """Batches of `global_batch_size`, the same sequence on every worker and engine.

    The sequence is a pure function of (seed, epoch): data epoch e is the examples in the order
    `epoch_order(n, seed, e)`, cut into n // global_batch_size batches (the remainder dropped).
    One device, N devices, N TF_CONFIG workers and N Horovod ranks therefore train on the same
    global batches, and a resumed job continues the same sequence.

    Args:
        x, y: Examples and labels (arrays of the same length).
        global_batch_size: Examples per global batch, in [1, len(y)].
        seed: Seed of the shuffle (an int >= 0).
        shuffle: Shuffle each epoch (else the stored order). Defaults to True.
        repeat: Run epoch after epoch forever (else up to the end of the epoch `start` is in).
        start: Global batches of the sequence to skip: an int, or a callable returning one,
            called whenever an iterator is created (`tfdist.callbacks.BackupAndRestore
            .data_start` resumes where a backup left off).

    Example:
        ```python
        batches = tfdist.data.global_batches(x, y, global_batch_size=64, seed=0, repeat=False)
        images, labels = next(iter(batches))
        assert images.shape == (64, 8, 8, 1)  # the same batches on every worker and engine
        ```
    """
    n = len(y)
    if len(x) != n:
        raise ValueError(f"`x` and `y` must have the same length. Received: {len(x)} and {n}")
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) \
            or not 1 <= global_batch_size <= n:
        raise ValueError(
            f"`global_batch_size` must be in [1, {n}] (the number of examples). "
            f"Received: global_batch_size={global_batch_size!r}"
        )
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"`seed` must be an int >= 0. Received: seed={seed!r}")
    xs, ys = tf.constant(x), tf.constant(y)
    batches = _origin(start).flat_map(lambda first: batch_indices(
        n, global_batch_size, seed, shuffle, repeat, first)).map(
            lambda i: (tf.gather(xs, i), tf.gather(ys, i)))
    # Said to be endless, a repeating sequence spares every multi-worker step tf.distribute's
    # check that all workers still have data (a collective call per step, for a last partial
    # batch that never comes).
    return batches.apply(tf.data.experimental.assert_cardinality(
        tf.data.INFINITE_CARDINALITY)) if repeat else batches


def resume(dataset: tf.data.Dataset, start: int | Callable[[], int]) -> tf.data.Dataset:
    """`dataset` from element `start` on, for datasets that are not tfdist's own: `start` is an
    int or a callable called whenever an iterator is created.

    With `start=backup.data_start` of a `tfdist.callbacks.BackupAndRestore` (and `dataset`
    endless, as `fit` with `steps_per_epoch` reads it), the dataset's position is kept in the
    backups: each holds the pipeline's state, and a resume restores it, reading nothing it read
    before (`tfdist.data.position`). Otherwise, and where a pipeline's state cannot be saved
    (it holds Python state), the skipped elements are read and dropped, so the dataset must
    give the same sequence every time (a fixed shuffle seed).

    Example:
        ```python
        dataset = tf.data.Dataset.range(100).batch(10)
        later = tfdist.data.resume(dataset, start=3)  # from the 4th batch on
        assert next(iter(later))[0] == 30
        ```
    """
    if not callable(start):
        return dataset.skip(_check_start(start))
    backup = getattr(start, "__self__", None)
    if hasattr(backup, "keep_input"):  # BackupAndRestore.data_start: kept in its backups
        from tfdist.data.position import KeptPosition

        return KeptPosition(dataset, backup).dataset()
    return _origin(start).flat_map(dataset.skip)


def _origin(start: int | Callable[[], int]) -> tf.data.Dataset:
    """One element, the first global batch to produce: `start`, or `start()` read whenever an
    iterator is created."""
    if not callable(start):
        return tf.data.Dataset.from_tensors(tf.constant(_check_start(start), tf.int64))

    def first():
        return np.int64(_check_start(start()))

    # A py_function, not Dataset.from_generator: freeing the iterator of an interrupted `fit`
    # waited for one of tf.data's threads, 52 s at the end of tests/test_resume.py (py-spy:
    # IteratorResource::~IteratorResource), gone with this (that module 228 s -> 177 s).
    return tf.data.Dataset.from_tensors(np.int64(0)).map(
        lambda _: tf.ensure_shape(tf.py_function(first, [], tf.int64), []))


def _check_start(start) -> int:
    if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0:
        raise ValueError(f"`start` must be an int >= 0 (global batches to skip). "
                         f"Received: start={start!r}")
    return int(start)


def shard_batches(batches: tf.data.Dataset, index: int, count: int) -> tf.data.Dataset:
    """Slice `index` of `count` equal slices of each batch (worker `index`'s share).

    Example:
        ```python
        batches = tfdist.data.global_batches(x, y, 64, repeat=False)
        mine = tfdist.data.shard_batches(batches, index=1, count=2)  # worker 1 of 2
        images, labels = next(iter(mine))
        assert images.shape == (32, 8, 8, 1)
        ```
    """
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
               shuffle: bool = True, repeat: bool = True, start: int | Callable[[], int] = 0):
    """A distributed dataset in which replica r of R gets slice r of each global batch of
    `global_batches(x, y, global_batch_size, seed, shuffle, repeat, start)`.

    Works for MirroredStrategy (one input pipeline feeding several replicas) and multi-worker
    strategies (one pipeline per worker). Pass the result to `fit` with `steps_per_epoch`.

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))
        data = tfdist.data.distribute(strategy, x, y, global_batch_size=64, seed=0)
        with strategy.scope():
            model = build_model()
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        model.fit(data, epochs=2, steps_per_epoch=22)  # each replica gets 32 of each batch of 64
        ```
    """
    return distribute_batches(strategy, lambda: global_batches(
        x, y, global_batch_size, seed=seed, shuffle=shuffle, repeat=repeat, start=start))


def distribute_batches(strategy: tf.distribute.Strategy, make_batches):
    """`distribute` for any dataset of global batches: `make_batches()` returns it (called once
    per input pipeline, so every worker builds the same sequence), and replica r of R gets slice
    r of each batch.

    Raises:
        ValueError: if the global batch size does not divide by the number of replicas.

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))
        data = tfdist.data.distribute_batches(
            strategy, lambda: tf.data.Dataset.from_tensor_slices((x, y)).batch(64, drop_remainder=True))
        ```
    """
    replicas = strategy.num_replicas_in_sync
    batch = make_batches().element_spec[0].shape[0]
    if batch is None or batch % replicas:
        raise ValueError(
            f"The global batch size ({batch}) must divide by the number of replicas "
            f"({replicas}): use a multiple of {replicas} (and drop_remainder=True).")
    return distribute_shards(strategy, lambda index, count: shard_batches(
        make_batches(), index, count))


def distribute_shards(strategy: tf.distribute.Strategy,
                      make_shard: Callable[[int, int], tf.data.Dataset]):
    """A distributed dataset whose input pipeline p of P reads only `make_shard(p, P)`: slice p
    of P of each global batch (`tfdist.data.record_batches(..., shard=(p, P))` reads just
    those records), and replica r of R gets slice r of each global batch, as with
    `distribute_batches`.

    Example:
        ```python
        import tempfile

        path = tempfile.mkdtemp() + "/digits"
        tfdist.data.convert_arrays(path, x, y)
        source = tfdist.data.RecordSource(path)
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))
        data = tfdist.data.distribute_shards(strategy, lambda p, n: tfdist.data.record_batches(
            source, 64, seed=0, shard=(p, n)))
        ```
    """
    replicas = strategy.num_replicas_in_sync

    def dataset_fn(ctx: tf.distribute.InputContext):
        local = replicas // ctx.num_input_pipelines
        ds = make_shard(ctx.input_pipeline_id, ctx.num_input_pipelines)
        batch = ds.element_spec[0].shape[0]
        if batch is None or batch % local:
            raise ValueError(f"An input pipeline's slice of the global batch ({batch}) must "
                             f"divide by its {local} replicas: use a multiple of {replicas} "
                             "for the global batch size.")
        # Each element: this pipeline's `local` replica batches, emitted in replica order.
        return ds.map(lambda *t: tuple(tf.reshape(u, [local, batch // local, *u.shape[1:]])
                                       for u in t)).unbatch()

    return strategy.distribute_datasets_from_function(dataset_fn)
