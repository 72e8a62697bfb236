"""Embedding gradients (tf.IndexedSlices) exchanged as the rows each replica holds."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.workers import common
from tfdist.comm import ring_bytes
from tfdist.optimizers import chain_of
from tfdist.strategies import new_mirrored_strategy

VOCAB, DIM, TOKENS, CLASSES, BATCH, STEPS = 1000, 16, 12, 5, 32, 8


def _data():
    rng = np.random.default_rng(0)
    return (rng.integers(0, VOCAB, size=(BATCH * STEPS, TOKENS)),
            rng.integers(0, CLASSES, size=(BATCH * STEPS,)))


def _build() -> keras.Model:
    keras.utils.set_random_seed(3)
    inputs = keras.Input((TOKENS,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, DIM)(inputs)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(h))


def _fit(replicas, make_optimizer, drop_remainder=False):
    strategy = new_mirrored_strategy(common.cpu_devices(replicas))
    with strategy.scope():
        model = _build()
        model.compile(optimizer=make_optimizer(),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = tf.data.Dataset.from_tensor_slices(_data()).batch(BATCH, drop_remainder=drop_remainder)
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


def test_a_nonfinite_row_stops_every_replica():
    """A NaN in the embedding table reaches one replica's rows: the summed rows are non-finite
    on every replica, and nan_policy="raise" stops training naming the step."""
    strategy = new_mirrored_strategy(common.cpu_devices(2))
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
