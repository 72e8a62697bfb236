"""Accordion: critical-regime detection switches compression level / batch size, the same on
every replica. A synthetic regime change: with a zero learning rate the weights stay fixed, and
the inputs of batches 8-15 are 10x larger, so the gradient norm jumps once and then stays."""

import keras
import numpy as np
import pytest

import tfdist
from tests.workers import common
from tfdist import compression as C
from tfdist.callbacks import Accordion, critical_regimes
from tfdist.optimizers import GradientExchange, TrackNorms

BATCH, INTERVAL = 32, 4


def _regime_change_data():
    x, y = common.load_digits()
    x, y = x[:16 * BATCH].copy(), y[:16 * BATCH]
    x[8 * BATCH:] *= 10.0
    return x, y


def _fit(strategy, optimizer, callbacks):
    x, y = _regime_change_data()
    with strategy.scope():
        model = common.make_model(hidden=(32,))
        model.compile(optimizer=optimizer(), loss="sparse_categorical_crossentropy")
    sent = []
    snapshot = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: sent.append(
        tfdist.optimizers.chain_of(model.optimizer).bytes_sent))
    model.fit(common.distribute(strategy, x, y, BATCH, shuffle=False), epochs=1,
              steps_per_epoch=16, verbose=0, callbacks=[*callbacks, snapshot])
    return model, np.diff([0.0, *sent])


def test_critical_regimes_rule():
    assert critical_regimes(None, np.array([1.0, 2.0]), 0.5).all()
    np.testing.assert_array_equal(
        critical_regimes(np.array([1.0, 1.0, 1.0]), np.array([1.2, 0.4, 1.6]), 0.5),
        [False, True, True])


@pytest.mark.parametrize("entry", ["wrapper", "strategy"])
def test_switches_to_low_compression_at_the_jump_and_back(mirrored, entry):
    adaptive = C.Adaptive(low=C.TopK(0.5), high=C.TopK(0.05))
    accordion = Accordion(eta=0.5, interval=INTERVAL)
    if entry == "wrapper":
        model, per_step = _fit(mirrored(2), lambda: tfdist.DistributedOptimizer(
            keras.optimizers.SGD(0.0), compressor=adaptive), [accordion])
        chain = model.optimizer.chain
    else:
        model, per_step = _fit(tfdist.CompressedStrategy(adaptive, devices=common.cpu_devices(2)),
                               lambda: keras.optimizers.SGD(0.0), [accordion])
        chain = tfdist.optimizers.chain_of(model.optimizer)
    exchange = chain.part(GradientExchange)
    kernel = next(i for i, s in exchange.compression_state.items() if "critical" in s)
    pos = sorted(chain.part(TrackNorms).grad_sq).index(kernel)
    # Decisions after intervals 1-4: start critical, calm, the jump, calm again.
    assert [bool(d[pos]) for d in accordion.decisions] == [True, False, True, False]
    # Every replica holds the same flag.
    flags = [c.numpy() for c in exchange.compression_state[kernel]["critical"].value.values]
    assert flags == [0, 0]
    # Bytes per step: low (1024 of 2048 values) while critical, high (103 values) otherwise.
    low, high = 1024 * 8, 103 * 8
    intervals = per_step.reshape(4, INTERVAL)
    assert np.ptp(intervals, axis=1).max() == 0  # constant within an interval
    diffs = intervals[:, 0] - intervals[2, 0]
    np.testing.assert_allclose(diffs, [low - high, low - high, 0, low - high])


def test_batch_size_mode_grows_the_batch_outside_critical_regimes(mirrored):
    accordion = Accordion(eta=0.5, interval=INTERVAL, mode="batch_size", small_steps=1,
                          large_steps=4)
    model, _ = _fit(mirrored(2), lambda: tfdist.DistributedOptimizer(
        keras.optimizers.SGD(0.0), track_norms=True, variable_accumulation=True), [accordion])
    assert [bool(d.any()) for d in accordion.decisions] == [True, False, True, False]
    # Exchanges: 4 (k=1), 4 (k=1), 1 (k=4), 4 (k=1); the last decision set k=4 again.
    assert model.optimizer.communication_rounds == 13
    assert model.optimizer.current_accumulation_steps == 4


def test_accordion_needs_what_it_switches(mirrored):
    with pytest.raises(ValueError, match="mode"):
        Accordion(mode="rank")
    with pytest.raises(ValueError, match="eta"):
        Accordion(eta=0)
    with pytest.raises(ValueError, match="`interval` must be an integer >= 1"):
        Accordion(interval=0)
    with pytest.raises(ValueError, match="tracks gradient norms"):
        _fit(mirrored(2), lambda: tfdist.DistributedOptimizer(keras.optimizers.SGD(0.0)),
             [Accordion()])
    with pytest.raises(ValueError, match="Adaptive"):
        _fit(mirrored(2), lambda: tfdist.DistributedOptimizer(
            keras.optimizers.SGD(0.0), track_norms=True), [Accordion(mode="compression")])
