"""tfdist.CompressedStrategy: the user's own optimizer, compressed through the same core."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.workers import common
from tfdist import compression as C
from tfdist.optimizers import GradientExchange, chain_of

STEPS, BATCH = 6, 32


def _fit(strategy, optimizer_fn, steps=STEPS, hidden=(32,)):
    x, y = common.load_digits()
    with strategy.scope():
        model = common.make_model(hidden=hidden)
        model.compile(optimizer=optimizer_fn(), loss="sparse_categorical_crossentropy")
    model.fit(common.distribute(strategy, x, y, BATCH, shuffle=False), epochs=1,
              steps_per_epoch=steps, verbose=0)
    return model


def _devices(n=2):
    return common.cpu_devices(n)


def test_identity_compressor_equals_plain_mirrored_strategy(mirrored):
    plain = _fit(mirrored(2), lambda: common.make_inner_optimizer("adam"))
    ours = _fit(tfdist.CompressedStrategy(C.Identity(), devices=_devices(), min_compress_size=0,
                                          compress_1d=True),
                lambda: common.make_inner_optimizer("adam"))
    chain = chain_of(ours.optimizer)
    assert len(chain.part(GradientExchange).compression_state) == 4
    assert chain.communication_rounds == STEPS
    common.assert_weights_close(common.weights(ours), common.weights(plain), rtol=0, atol=1e-6)


@pytest.mark.parametrize("compressor", [C.ErrorFeedback(C.TopK(0.01)), C.PowerSGD(rank=2)],
                         ids=lambda c: type(c).__name__)
def test_same_weights_and_bytes_as_the_wrapper_with_the_same_compressor(mirrored, compressor):
    """One core, two entry points: strategy and wrapper give the same training."""
    via_strategy = _fit(tfdist.CompressedStrategy(compressor, devices=_devices()),
                        lambda: common.make_inner_optimizer("sgd"))
    via_wrapper = _fit(mirrored(2), lambda: tfdist.DistributedOptimizer(
        common.make_inner_optimizer("sgd"), compressor=compressor))
    common.assert_weights_close(common.weights(via_strategy), common.weights(via_wrapper),
                                rtol=0, atol=1e-6)
    assert chain_of(via_strategy.optimizer).bytes_sent == via_wrapper.optimizer.bytes_sent


def test_communication_stats_and_save_load_under_the_strategy(tmp_path):
    strategy = tfdist.CompressedStrategy("powersgd", devices=_devices())
    x, y = common.load_digits()
    with strategy.scope():
        model = common.make_model(hidden=(32,))
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy")
    hist = model.fit(common.distribute(strategy, x, y, BATCH), epochs=2, steps_per_epoch=5,
                     verbose=0, callbacks=[tfdist.callbacks.CommunicationStats()])
    dense = 4 * model.count_params()
    assert 0 < hist.history["bytes_per_step"][-1] < 0.5 * dense
    path = str(tmp_path / "m.keras")
    model.save(path)
    with tfdist.CompressedStrategy("powersgd", devices=_devices()).scope():
        loaded = keras.saving.load_model(path)
    def q(model):
        state = chain_of(model.optimizer).part(GradientExchange).compression_state
        return next(v for vs in state.values() for k, v in vs.items() if k == "q")

    q_saved, q_loaded = q(model), q(loaded)
    np.testing.assert_array_equal(q_loaded.numpy(), q_saved.numpy())


def test_optimizers_outside_tfdist_strategies_are_untouched(mirrored):
    tfdist.CompressedStrategy("fp16", devices=_devices())  # hooks installed
    model = _fit(mirrored(2), lambda: keras.optimizers.SGD(0.05))
    assert chain_of(model.optimizer) is None
    assert isinstance(tfdist.CompressedStrategy("fp16", devices=_devices()),
                      tf.distribute.MirroredStrategy)


def test_mixed_float16_under_the_strategy_trains():
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = _fit(tfdist.CompressedStrategy(C.ErrorFeedback(C.TopK(0.05)), devices=_devices()),
                     lambda: keras.optimizers.Adam(1e-2), steps=20, hidden=(64,))
    finally:
        keras.config.set_dtype_policy("float32")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    inner = model.optimizer.inner_optimizer
    assert chain_of(inner).communication_rounds > 0
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_bad_arguments_fail_before_anything_is_built():
    with pytest.raises(ValueError, match="compressor=None"):
        tfdist.CompressedStrategy(None)
    with pytest.raises(ValueError, match="Unknown compressor 'gzip'"):
        tfdist.CompressedStrategy("gzip")
    with pytest.raises(ValueError, match="min_compress_size=-5"):
        tfdist.CompressedStrategy("fp16", min_compress_size=-5)


def test_a_saved_model_keeps_every_replicas_residual_as_the_wrapper_does(tmp_path):
    """The strategy's checkpoints hold each replica's error-feedback residual (one format with
    `DistributedOptimizer`): saved, loaded under a new strategy and trained on, the model ends
    where one never stopped ends."""
    x, y = common.load_digits()

    def fit(model, strategy):
        model.fit(common.distribute(strategy, x, y, BATCH, shuffle=False), epochs=1,
                  steps_per_epoch=STEPS, verbose=0)

    def new(strategy):
        with strategy.scope():
            model = common.make_model(hidden=(32,))
            model.compile(optimizer=common.make_inner_optimizer("sgd"),
                          loss="sparse_categorical_crossentropy")
        return model

    def strategy():
        return tfdist.CompressedStrategy(C.ErrorFeedback(C.TopK(0.01)), devices=_devices())

    one = strategy()
    straight = new(one)
    fit(straight, one)
    fit(straight, one)
    two = strategy()
    first = new(two)
    fit(first, two)
    path = str(tmp_path / "mid.keras")
    first.save(path)
    three = strategy()
    with three.scope():
        resumed = keras.saving.load_model(path)

    def residuals(model):
        state = chain_of(model.optimizer).part(GradientExchange).compression_state
        return [[c.numpy() for c in tfdist.comm.replica_copies(v)]
                for vs in state.values() for k, v in vs.items() if k == "residual"]

    saved, loaded = residuals(first), residuals(resumed)
    assert saved and not np.allclose(saved[0][0], saved[0][1]), "replicas' residuals differ"
    for want, got in zip(saved, loaded, strict=True):
        np.testing.assert_array_equal(np.stack(got), np.stack(want))
    fit(resumed, three)
    common.assert_weights_close(common.weights(resumed), common.weights(straight), rtol=1e-5,
                                atol=1e-6)
