"""Engines as objects: resolution, the process role, fused collectives, a new engine in one
module, and compressors reducing a whole exchange in few collective calls."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.workers import common
from tfdist import compression as C
from tfdist.comm import (
    ByteCounter,
    DistributeEngine,
    LocalCommunicator,
    LocalEngine,
    activate,
    fused_all_gather,
    fused_all_reduce,
    register,
    resolve,
)

BATCH = 32


def test_resolve_follows_the_strategy_in_scope_then_the_activated_engine(mirrored):
    assert isinstance(resolve(), LocalEngine)
    strategy = mirrored(2)
    with strategy.scope():
        engine = resolve()
    assert isinstance(engine, DistributeEngine) and engine.world_size == 2
    assert engine.loss_divided_by_replicas and engine.local_ranks() == [0, 1]
    assert engine.is_chief and not engine.multi_process
    assert isinstance(resolve(strategy), DistributeEngine)
    sentinel = LocalEngine()
    activate(sentinel)
    try:
        assert resolve() is sentinel
        with strategy.scope():  # a strategy in scope wins over the activated engine
            assert isinstance(resolve(), DistributeEngine)
    finally:
        activate(None)
    assert isinstance(resolve(), LocalEngine)


def test_one_process_trains_on_several_mirrored_strategies():
    """What every notebook does: a plain Keras model on one MirroredStrategy, then tfdist's
    optimizers on new ones, in one process."""
    x, y = common.load_digits()
    for make in (lambda: keras.optimizers.SGD(0.1),
                 lambda: tfdist.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                 lambda: tfdist.ZeroOptimizer(keras.optimizers.Adam(1e-3), stage=2)):
        strategy = tf.distribute.MirroredStrategy(common.cpu_devices(2))
        with strategy.scope():
            model = common.make_model()
            model.compile(optimizer=make(), loss="sparse_categorical_crossentropy")
        history = model.fit(common.distribute(strategy, x, y, BATCH), epochs=1,
                            steps_per_epoch=3, verbose=0)
        assert np.isfinite(history.history["loss"][0])


def test_engine_run_gives_eager_collectives(mirrored):
    engine = DistributeEngine(mirrored(2))
    out = engine.run(lambda comm: comm.all_reduce([tf.ones([3]) * tf.cast(comm.rank + 1,
                                                                          tf.float32)])[0])
    np.testing.assert_allclose(out, [3.0, 3.0, 3.0])
    assert LocalEngine().run(lambda comm: comm.world_size) == 1


@pytest.mark.parametrize("n", [1, 2])
def test_fused_collectives_equal_one_call_per_tensor(mirrored, n):
    strategy = mirrored(n)
    with strategy.scope():
        fused_calls = tf.Variable(0, dtype=tf.int64, aggregation=tf.VariableAggregation.NONE)
        plain_calls = tf.Variable(0, dtype=tf.int64, aggregation=tf.VariableAggregation.NONE)
        sink = tf.Variable(0.0, dtype=tf.float64, aggregation=tf.VariableAggregation.NONE)
    engine = DistributeEngine(strategy)

    @tf.function
    def step():
        def fn():
            fused = engine.communicator(ByteCounter(sink, fused_calls))
            plain = engine.communicator(ByteCounter(sink, plain_calls))
            r = tf.cast(fused.rank, tf.float32)
            tensors = [tf.fill([2, 3], r + 1.0), tf.fill([5], r - 1.0), tf.fill([4], r * 2.0)]
            words = [tf.cast(tf.fill([3], fused.rank + 7), tf.int32), tf.fill([2], r + 0.5)]
            reduced = fused_all_reduce(fused, tensors, "sum")
            gathered = fused_all_gather(fused, words)
            one_by_one = [plain.all_reduce([t])[0] for t in tensors]
            one_gather = [plain.all_gather(w[None]) for w in words]
            return reduced, one_by_one, gathered, one_gather
        return strategy.run(fn)

    reduced, one_by_one, gathered, one_gather = step()
    for a, b in zip(reduced, one_by_one):
        np.testing.assert_array_equal(strategy.experimental_local_results(a)[0],
                                      strategy.experimental_local_results(b)[0])
    for a, b in zip(gathered, one_gather):
        a, b = strategy.experimental_local_results(a)[0], strategy.experimental_local_results(b)[0]
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    # One call for the three float32 tensors, one for the two 4-byte payloads (int32 and
    # float32 gathered as one buffer of words); per tensor: five calls. A world of one: none.
    calls = [int(strategy.experimental_local_results(v)[0].numpy())
             for v in (fused_calls, plain_calls)]
    assert calls == ([2, 5] if n > 1 else [0, 0])


class _CountingEngine(LocalEngine):
    """A new engine, in one class plus its registration: a world of one whose communicator
    records every collective the algorithms make through it."""

    name = "counting"
    calls: list = []

    def communicator(self, counter=None):
        engine = self

        class Recording(LocalCommunicator):
            def all_reduce(self, tensors, op="sum"):
                engine.calls.append(("all_reduce", len(list(tensors))))
                return super().all_reduce(tensors, op)

        return Recording(counter)


def test_a_new_engine_is_one_class_and_its_registration():
    register(_CountingEngine)
    assert tfdist.comm.ENGINES["counting"] is _CountingEngine
    engine = tfdist.comm.get_engine("counting")
    activate(engine)
    try:
        model = common.make_model()
        opt = tfdist.DistributedOptimizer(keras.optimizers.SGD(0.1))
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
        x, y = common.load_digits()
        model.fit(x[:64], y[:64], batch_size=32, epochs=1, verbose=0)
    finally:
        activate(None)
        tfdist.comm.ENGINES.pop("counting")
    assert opt.engine is engine
    # Recorded as traced: one fused exchange per step function, and nan_policy's all-reduce of
    # the ranks at fault, traced in its branch (it runs only when a gradient is non-finite).
    assert _CountingEngine.calls == [("all_reduce", 4), ("all_reduce", 1)] * 2


def _train(strategy, compressor, steps=6, **options):
    x, y = common.load_digits()
    with strategy.scope():
        keras.utils.set_random_seed(common.SEED)
        inputs = keras.Input((8, 8, 1))
        h = keras.layers.Conv2D(8, 3, activation="relu")(inputs)
        h = keras.layers.Flatten()(h)
        h = keras.layers.Dense(64, activation="relu")(h)
        h = keras.layers.Dense(32, activation="relu")(h)
        model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(h))
        opt = tfdist.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                          compressor=compressor, min_compress_size=256,
                                          **options)
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    model.fit(common.distribute(strategy, x, y, BATCH, shuffle=False), epochs=1,
              steps_per_epoch=steps, verbose=0)
    return model, opt


@pytest.mark.parametrize("compressor, batched_calls", [
    (lambda: C.PowerSGD(rank=2), 3),                    # every P, every Q, the dense rest
    (lambda: C.ErrorFeedback(C.TopK(0.05)), 2),         # one all-gather, the dense rest
    (lambda: C.QSGD(levels=4, bucket_size=64), 2),
    (lambda: C.FP16(), 2),                              # one fp16 all-reduce, the dense rest
])
def test_batched_exchange_equals_per_tensor_in_fewer_calls(mirrored, compressor, batched_calls,
                                                          monkeypatch):
    """Same maths, packed: the same weights and bytes as the exchange reducing one tensor at a
    time (the transport called per tensor, as this test makes it), with one collective call
    per kind of payload instead of one (or two) per tensor."""
    from tfdist.comm import reduce_encoded
    from tfdist.optimizers import exchange

    batched, opt_b = _train(mirrored(2), compressor())

    def one_at_a_time(codec, xs, states, step, comm, op="sum"):
        pairs = [reduce_encoded(codec, [x], [s], step, comm, op) for x, s in zip(xs, states)]
        return [t for (t,), _ in pairs], [s for _, (s,) in pairs]

    monkeypatch.setattr(exchange, "reduce_encoded", one_at_a_time)
    per_tensor, opt_p = _train(mirrored(2), compressor())
    common.assert_weights_close(common.weights(batched), common.weights(per_tensor),
                                rtol=0, atol=1e-6)
    assert opt_b.bytes_sent == pytest.approx(opt_p.bytes_sent)
    assert opt_b.collective_calls == 6 * batched_calls
    assert opt_p.collective_calls > opt_b.collective_calls
