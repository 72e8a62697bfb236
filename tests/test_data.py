import numpy as np
import pytest

from tfdist.data import distribute, global_batches, load_digits, shard_batches


def test_digits_split_is_fixed_and_disjoint():
    xtr, ytr = load_digits("train")
    xte, yte = load_digits("test")
    assert xtr.shape[1:] == (8, 8, 1) and xtr.dtype == np.float32
    assert len(ytr) + len(yte) == 1797 and len(yte) == 359
    assert xtr.min() >= 0.0 and xtr.max() <= 1.0
    assert set(np.unique(ytr)) == set(range(10))
    x2, _ = load_digits("train")
    np.testing.assert_array_equal(xtr, x2)
    with pytest.raises(ValueError, match="split"):
        load_digits("validation")


def test_worker_shards_partition_each_global_batch():
    x = np.arange(40, dtype=np.float32)[:, None]
    y = np.arange(40, dtype=np.int32)
    full = list(global_batches(x, y, 8, seed=1, repeat=False))
    shards = [list(shard_batches(global_batches(x, y, 8, seed=1, repeat=False), i, 4))
              for i in range(4)]
    for step, (bx, _) in enumerate(full):
        joined = np.concatenate([shards[i][step][0] for i in range(4)])
        np.testing.assert_array_equal(joined, bx)
    with pytest.raises(ValueError, match="multiple of 3"):
        shard_batches(global_batches(x, y, 8), 0, 3)


def test_distribute_gives_replica_r_slice_r(mirrored):
    strategy = mirrored(4)
    x = np.arange(32, dtype=np.float32)[:, None]
    y = np.arange(32, dtype=np.int32)
    data = iter(distribute(strategy, x, y, 16, shuffle=False))
    first = next(data)
    per_replica = [t.numpy().ravel() for t in strategy.experimental_local_results(first[1])]
    assert [p.tolist() for p in per_replica] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11],
                                                 [12, 13, 14, 15]]
    with pytest.raises(ValueError, match="multiple of 4"):
        distribute(strategy, x, y, 10)



def test_a_repeating_sequence_says_it_is_endless_and_a_finite_one_ends():
    """An endless dataset spares tf.distribute's per-step check, across workers, that every
    worker still has data (one collective call per multi-worker step otherwise)."""
    import tensorflow as tf

    x = np.arange(40, dtype=np.float32)[:, None]
    y = np.arange(40, dtype=np.int32)
    endless = global_batches(x, y, 8, seed=1)
    assert endless.cardinality() == tf.data.INFINITE_CARDINALITY
    assert len(list(endless.take(12))) == 12  # runs past the 5 batches of an epoch
    finite = global_batches(x, y, 8, seed=1, repeat=False)
    assert finite.cardinality() != tf.data.INFINITE_CARDINALITY and len(list(finite)) == 5
