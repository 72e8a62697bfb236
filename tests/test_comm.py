import numpy as np
import pytest
import tensorflow as tf

from tfdist.comm import (
    ByteCounter,
    LocalCommunicator,
    ReplicaCommunicator,
    model_fingerprint,
    ring_bytes,
    static_nbytes,
)


def test_ring_bytes_formulas():
    assert ring_bytes("all_reduce", 1000, 1) == 0
    assert ring_bytes("all_reduce", 1000, 2) == 1000
    assert ring_bytes("all_reduce", 1000, 4) == 1500
    assert ring_bytes("reduce_scatter", 1000, 4) == 750
    assert ring_bytes("all_gather", 250, 4) == 750  # each worker's 250 bytes reach 3 others
    with pytest.raises(ValueError, match="Unknown collective"):
        ring_bytes("gossip", 1, 2)


def test_static_nbytes_counts_dtype_sizes():
    assert static_nbytes([tf.zeros([3, 4]), tf.zeros([5], tf.float16), tf.zeros([2], tf.int64)]) \
        == 48 + 10 + 16


def test_local_communicator_is_identity_and_free():
    counter = ByteCounter(tf.Variable(0.0, dtype=tf.float64))
    comm = LocalCommunicator(counter)
    (out,) = comm.all_reduce([tf.constant([1.0, 2.0])])
    np.testing.assert_array_equal(out, [1.0, 2.0])
    assert counter.total == 0.0
    with pytest.raises(ValueError, match="op"):
        comm.all_reduce([tf.constant(1.0)], op="max")


@pytest.mark.parametrize("n", [2, 4])
def test_replica_communicator_collectives_and_bytes(mirrored, n):
    strategy = mirrored(n)
    with strategy.scope():
        total = tf.Variable(0.0, dtype=tf.float64, aggregation=tf.VariableAggregation.NONE)
    comm = ReplicaCommunicator(strategy, ByteCounter(total))

    @tf.function
    def step():
        def fn():
            r = tf.cast(comm.rank, tf.float32)
            x = tf.fill([n * 2], r + 1.0)  # 8 or 16 bytes... per worker payload
            (s,) = comm.all_reduce([x], op="sum")
            (m,) = comm.all_reduce([x], op="mean")
            g = comm.all_gather(tf.reshape(r, [1]))
            rs = comm.reduce_scatter(x, op="sum")
            (b,) = comm.broadcast([x], root=n - 1)
            return s, m, g, rs, b
        return strategy.run(fn)

    s, m, g, rs, b = (strategy.experimental_local_results(v) for v in step())
    expect_sum = sum(range(1, n + 1))
    for i in range(n):
        np.testing.assert_allclose(s[i], np.full(2 * n, expect_sum))
        np.testing.assert_allclose(m[i], np.full(2 * n, expect_sum / n))
        np.testing.assert_allclose(g[i], np.arange(n))
        np.testing.assert_allclose(rs[i], np.full(2, expect_sum))
        np.testing.assert_allclose(b[i], np.full(2 * n, n))
    payload = 2 * n * 4
    # all_reduce x2, gather (4 bytes per worker), a true reduce-scatter (merge_call: all replicas
    # in this process) and broadcast, which runs as an all-reduce.
    expected = (3 * ring_bytes("all_reduce", payload, n) + ring_bytes("all_gather", 4, n)
                + ring_bytes("reduce_scatter", payload, n))
    assert strategy.experimental_local_results(total)[0].numpy() == pytest.approx(expected)


def test_reduce_scatter_needs_divisible_axis(mirrored):
    strategy = mirrored(2)
    comm = ReplicaCommunicator(strategy)
    with pytest.raises(ValueError, match="divisible by the world size 2"):
        strategy.run(lambda: comm.reduce_scatter(tf.zeros([3])))


def test_replica_communicator_outside_replica_context_says_how_to_fix(mirrored):
    strategy = mirrored(2)
    comm = ReplicaCommunicator(strategy)
    with strategy.scope(), pytest.raises(RuntimeError, match="strategy.run"):
        comm.all_reduce([tf.zeros([2])])


def test_model_fingerprint_sees_shape_and_dtype_changes():
    a = [tf.Variable(tf.zeros([3, 4])), tf.Variable(tf.zeros([4]))]
    b = [tf.Variable(tf.zeros([4, 3])), tf.Variable(tf.zeros([4]))]
    c = [tf.Variable(tf.zeros([3, 4], tf.float16)), tf.Variable(tf.zeros([4]))]
    fa, fb, fc = (model_fingerprint(v) for v in (a, b, c))
    assert fa[0] == 2 and fa[1] == 16
    assert not np.array_equal(fa, fb) and not np.array_equal(fa, fc)


class _NoGroupsCommunicator(ReplicaCommunicator):
    """Forces the engine-independent fallback: one global all-reduce of the stacked groups."""

    def _supports_groups(self, group_size):
        return False


@pytest.mark.parametrize("cls", [ReplicaCommunicator, _NoGroupsCommunicator])
def test_group_all_reduce_reduces_within_consecutive_groups(mirrored, cls):
    strategy = mirrored(4)
    with strategy.scope():
        total = tf.Variable(0.0, dtype=tf.float64, aggregation=tf.VariableAggregation.NONE)
    comm = cls(strategy, ByteCounter(total))

    @tf.function
    def step():
        def fn():
            x = tf.fill([3], tf.cast(comm.rank, tf.float32) ** 2)  # 0, 1, 4, 9
            (mean,) = comm.group_all_reduce([x], 2, op="mean")
            (total_,) = comm.group_all_reduce([x], 2, op="sum")
            (alone,) = comm.group_all_reduce([x], 1)
            return mean, total_, alone
        return strategy.run(fn)

    mean, sums, alone = (strategy.experimental_local_results(v) for v in step())
    for r, expected in enumerate([0.5, 0.5, 6.5, 6.5]):
        np.testing.assert_allclose(mean[r], [expected] * 3)
        np.testing.assert_allclose(sums[r], [2 * expected] * 3)
        np.testing.assert_allclose(alone[r], [r ** 2] * 3)
    per_call = (ring_bytes("all_reduce", 12, 2) if cls is ReplicaCommunicator
                else ring_bytes("all_reduce", 2 * 12, 4))  # 2 groups' slots, all 4 replicas
    assert strategy.experimental_local_results(total)[0].numpy() == pytest.approx(2 * per_call)
    with pytest.raises(ValueError, match="group_size=3"):
        strategy.run(tf.function(lambda: comm.group_all_reduce([tf.zeros(2)], 3)))
