"""Embedding gradients (tf.IndexedSlices) exchanged as the rows each replica holds."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.workers import common
from tfdist.comm import bucketed_all_reduce, ring_bytes, sparse_all_reduce
from tfdist.optimizers import TrackNorms, chain_of
from tfdist.tools.bench.compressors import LoopbackCommunicator

VOCAB, DIM, TOKENS, CLASSES, BATCH, STEPS = 1000, 16, 12, 5, 32, 8


def _data(vocab=VOCAB):
    rng = np.random.default_rng(0)
    return (rng.integers(0, vocab, size=(BATCH * STEPS, TOKENS)),
            rng.integers(0, CLASSES, size=(BATCH * STEPS,)))


def _build(vocab=VOCAB) -> keras.Model:
    keras.utils.set_random_seed(3)
    inputs = keras.Input((TOKENS,), dtype="int32")
    h = keras.layers.Embedding(vocab, DIM)(inputs)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(h))


def _fit(replicas, make_optimizer, drop_remainder=False, vocab=VOCAB):
    strategy = tf.distribute.MirroredStrategy(common.cpu_devices(replicas))
    with strategy.scope():
        model = _build(vocab)
        model.compile(optimizer=make_optimizer(),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = tf.data.Dataset.from_tensor_slices(_data(vocab)).batch(BATCH,
                                                                   drop_remainder=drop_remainder)
    model.fit(data, epochs=1, steps_per_epoch=STEPS, verbose=0)
    return model


def _sgd():
    return keras.optimizers.SGD(0.5, momentum=0.9)


@pytest.fixture(scope="module")
def single():
    return common.weights(_fit(1, _sgd))


@pytest.mark.parametrize("drop_remainder", [True, False])  # static and unknown row counts
def test_rows_are_all_gathered_and_train_like_one_device(single, drop_remainder):
    """2 replicas: the embedding's gradient travels as the rows each replica's batch used (plus
    their indices), the rest as a dense all-reduce; the weights equal one device's training on
    the whole batch (SGD with momentum is linear in the gradient)."""
    model = _fit(2, lambda: tfdist.DistributedOptimizer(_sgd()), drop_remainder)
    common.assert_weights_close(common.weights(model), single, rtol=1e-5, atol=1e-6)
    assert chain_of(model.optimizer).sparse_exchange
    rows = BATCH // 2 * TOKENS  # per replica, repeated tokens included
    dense = 4 * (DIM * CLASSES + CLASSES)
    per_step = (ring_bytes("all_gather", rows * (4 * DIM + 4), 2)
                + ring_bytes("all_reduce", dense, 2))
    assert model.optimizer.bytes_sent == pytest.approx(STEPS * per_step)
    assert model.optimizer.bytes_sent < STEPS * ring_bytes("all_reduce", 4 * VOCAB * DIM, 2) / 4


@pytest.mark.parametrize("drop_remainder", [True, False])  # static and unknown row counts
def test_rows_that_would_send_more_than_the_table_go_as_the_table(drop_remainder):
    """4 replicas each look up 8 x 12 rows of a 20-row table: gathered with their indices they
    would send 3 x 96 x 68 bytes, the table's all-reduce 1.5 x 20 x 64. With the row count
    known when traced the exchange all-reduces the table instead; unknown, it sends the rows.
    Either way the weights equal one device's on the whole batch."""
    vocab = 20
    single = common.weights(_fit(1, _sgd, vocab=vocab))
    model = _fit(4, lambda: tfdist.DistributedOptimizer(_sgd()), drop_remainder, vocab)
    common.assert_weights_close(common.weights(model), single, rtol=1e-5, atol=1e-6)
    head = 4 * (DIM * CLASSES + CLASSES)
    table = ring_bytes("all_reduce", 4 * vocab * DIM + head, 4)
    rows = (ring_bytes("all_gather", BATCH // 4 * TOKENS * (4 * DIM + 4), 4)
            + ring_bytes("all_reduce", head, 4))
    assert rows > table
    assert model.optimizer.bytes_sent == pytest.approx(STEPS * (table if drop_remainder
                                                                else rows))


def test_parts_that_keep_gradients_per_replica_densify_them(single):
    """With accumulation (or compression, or local SGD) the embedding gradient is densified
    first, as before: the same weights, a dense all-reduce's bytes."""
    model = _fit(2, lambda: tfdist.DistributedOptimizer(_sgd(), accumulation_steps=1,
                                                        variable_accumulation=True))
    assert not chain_of(model.optimizer).sparse_exchange
    common.assert_weights_close(common.weights(model), single, rtol=1e-5, atol=1e-6)
    dense = 4 * (VOCAB * DIM + DIM * CLASSES + CLASSES)
    assert model.optimizer.bytes_sent == pytest.approx(STEPS * ring_bytes("all_reduce", dense, 2))
    compressed = tfdist.DistributedOptimizer(_sgd(), compressor="fp16")
    assert not compressed.chain.sparse_exchange


def test_loss_scaling_and_norm_tracking_take_the_rows_as_they_come(single):
    """The parts before the exchange see the embedding's gradient as rows: loss scaling unscales
    them (a power of two: the same weights as one device) and norm tracking records the norm
    of their sum, as it does for the densified table (accumulation densifies it first)."""
    def make(**kw):
        return lambda: tfdist.DistributedOptimizer(_sgd(), loss_scale="dynamic",
                                                   initial_scale=2.0**10, track_norms=True, **kw)

    rows = _fit(2, make())
    dense = _fit(2, make(accumulation_steps=1, variable_accumulation=True))
    assert chain_of(rows.optimizer).sparse_exchange
    assert not chain_of(dense.optimizer).sparse_exchange
    common.assert_weights_close(common.weights(rows), single, rtol=1e-5, atol=1e-6)
    norms = chain_of(rows.optimizer).part(TrackNorms).mean_gradient_norms()
    assert norms[0] > 0
    np.testing.assert_allclose(norms,
                               chain_of(dense.optimizer).part(TrackNorms).mean_gradient_norms(),
                               rtol=1e-5)


def test_a_nonfinite_row_stops_every_replica():
    """A NaN in the embedding table reaches one replica's rows: the summed rows are non-finite
    on every replica, and nan_policy="raise" stops training naming the step."""
    strategy = tf.distribute.MirroredStrategy(common.cpu_devices(2))
    with strategy.scope():
        model = _build()
        model.compile(optimizer=tfdist.DistributedOptimizer(_sgd()),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data()
    table = model.layers[1].embeddings
    table.assign(tf.tensor_scatter_nd_update(table, [[int(x[BATCH - 1, 0])]],
                                             [[np.nan] * DIM]))
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    with pytest.raises(Exception, match="non-finite"):
        model.fit(data, epochs=1, steps_per_epoch=1, verbose=0)


class _Recording(LoopbackCommunicator):
    """2 loopback workers that record each collective call as it is created (program order,
    the order tf.distribute's ordering token runs them in): (kind, the shapes it carries)."""

    def __init__(self):
        super().__init__(2)
        self.calls: list = []

    def _all_reduce(self, tensors, op):
        self.calls.append(("all_reduce", [tuple(t.shape) for t in tensors]))
        return super()._all_reduce(tensors, op)

    def _all_gather(self, tensor):
        self.calls.append(("all_gather", tuple(tensor.shape)))
        return super()._all_gather(tensor)


def _rows(table_rows, width, dtype=tf.float32):
    values = tf.reshape(tf.range(3 * width, dtype=dtype), [3, width])
    return tf.IndexedSlices(values, tf.constant([4, 1, 4]),
                            dense_shape=tf.constant([table_rows, width], tf.int64))


@pytest.mark.parametrize("bucket_bytes", [1, None])
def test_rows_are_reduced_where_the_backward_pass_produces_them(bucket_bytes):
    """Collectives are created last tensors first, and an embedding's rows take their place in
    that order, not the front: under tf.distribute a collective created first whose input comes
    last (the first layer's rows) would hold back every bucket until the backward pass ends."""
    comm = _Recording()
    tensors = [tf.ones([3]), _rows(9, 2), tf.ones([5]), tf.ones([7])]
    out = bucketed_all_reduce(comm, tensors, bucket_bytes)
    rows = ("all_gather", (3, 3))  # this worker's 3 rows: 2 values + the index, one word each
    if bucket_bytes is None:  # one call for the dense tensors, then the rows
        assert comm.calls == [("all_reduce", [(3,), (5,), (7,)]), rows]
    else:
        assert comm.calls == [("all_reduce", [(7,)]), ("all_reduce", [(5,)]), rows,
                              ("all_reduce", [(3,)])]
    expected = np.zeros([9, 2], np.float32)
    np.add.at(expected, [4, 1, 4], np.arange(6, dtype=np.float32).reshape(3, 2))
    np.testing.assert_array_equal(out[1].numpy(), 2 * expected)  # 2 workers' identical rows
    for t, r in zip(tensors[::2] + tensors[3:], out[::2] + out[3:]):
        np.testing.assert_array_equal(r.numpy(), 2 * t.numpy())


def test_rows_go_with_their_indices_in_one_all_gather():
    """float32 rows and their int32 indices travel as one buffer of 32-bit words (bit for bit,
    NaN included); rows of other element sizes go in two calls. Same sums either way."""
    comm = _Recording()
    grad = _rows(6, 4)
    nan_row = tf.tensor_scatter_nd_update(grad.values, [[1]], [[np.nan] * 4])
    packed = sparse_all_reduce(comm, tf.IndexedSlices(nan_row, grad.indices), 6)
    assert comm.calls == [("all_gather", (3, 5))]
    assert np.isnan(packed.numpy()[1]).all() and np.isfinite(packed.numpy()[[0, 2, 3, 4, 5]]).all()
    comm = _Recording()
    half = sparse_all_reduce(comm, _rows(6, 4, tf.float16), 6)
    assert comm.calls == [("all_gather", (3, 4)), ("all_gather", (3,))]
    whole = sparse_all_reduce(_Recording(), grad, 6)
    np.testing.assert_array_equal(half.numpy().astype(np.float32), whole.numpy())


@pytest.mark.multiprocess
@pytest.mark.horovod
def test_two_horovod_ranks_send_rows_and_train_like_one_device(single, tmp_path):
    """The same exchange on the Horovod engine (`hvd.allgather` of rows and indices): the ranks
    end identical, equal to one device, with the same bytes as 2 replicas."""
    import json
    import sys

    from tests.conftest import ROOT, horovod_available, worker_env
    from tfdist.tools.launch import run_horovod

    if not horovod_available():
        pytest.skip("Horovod is not installed")
    result = run_horovod([sys.executable, f"{ROOT}/tests/workers/sparse_worker.py", str(tmp_path)],
                         2, 240, env=worker_env())
    assert result.returncode == 0, result.output[-4000:]
    w0, w1 = (common.load_weights(str(tmp_path / f"rank{r}.npz")) for r in (0, 1))
    common.assert_weights_close(w0, w1, rtol=0, atol=0)
    common.assert_weights_close(w0, single, rtol=1e-5, atol=1e-6)
    stats = json.loads((tmp_path / "rank0.json").read_text())
    rows = BATCH // 2 * TOKENS
    assert stats["sparse"]
    assert stats["bytes_per_step"] == pytest.approx(
        ring_bytes("all_gather", rows * (4 * DIM + 4), 2)
        + ring_bytes("all_reduce", 4 * (DIM * CLASSES + CLASSES), 2))
