"""tfdist.CompressedStrategy: the user's own optimizer, compressed through the same core."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.workers import common
from tfdist import compression as C
from tfdist.optimizers import chain_of

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
    assert len(chain.exchange.compression_state) == 4 and chain.communication_rounds == STEPS
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
    q_saved = next(v for vs in chain_of(model.optimizer).exchange.compression_state.values()
                   for k, v in vs.items() if k == "q")
    q_loaded = next(v for vs in chain_of(loaded.optimizer).exchange.compression_state.values()
                    for k, v in vs.items() if k == "q")
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
