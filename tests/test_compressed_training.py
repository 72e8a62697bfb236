"""Compression inside DistributedOptimizer under `fit` (tf.distribute engine, in-process)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.workers import common
from tfdist import compression as C

STEPS, BATCH = 6, 32


def _train(strategy, compressor, steps=STEPS, model=None, fits=1, **kwargs):
    x, y = common.load_digits()
    with strategy.scope():
        if model is None:
            model = common.make_model(hidden=(32,))
            opt = tfdist.DistributedOptimizer(common.make_inner_optimizer("sgd"),
                                              compressor=compressor, **kwargs)
            model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    data = common.distribute(strategy, x, y, BATCH, shuffle=False)
    for _ in range(fits):
        model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
    return model


def test_identity_compressor_equals_plain_synchronous_training(mirrored):
    plain, _ = common.train("strategy", STEPS, BATCH, strategy=mirrored(2), wrap=False,
                            hidden=(32,))
    ours = _train(mirrored(2), C.Identity(), min_compress_size=0, compress_1d=True)
    assert len(ours.optimizer.exchange.compression_state) == 4  # every tensor went through the compressor
    common.assert_weights_close(common.weights(ours), common.weights(plain), rtol=0, atol=1e-6)


@pytest.mark.parametrize("compressor, payload_bytes", [
    # dense_0 kernel 64x32 = 2048 elements is the only tensor >= 1024 elements and 2-D.
    # Selecting compressors also put a float32 "my inputs were not finite" flag in the dense
    # all-reduce (4 bytes); casts and PowerSGD spread a NaN by themselves.
    (C.ErrorFeedback(C.TopK(0.01)), 21 * 8 + 4),         # 21 values + 21 int32 indices
    (C.PowerSGD(rank=2), (64 + 32) * 2 * 4),              # P [64,2] and Q [32,2]
    (C.ErrorFeedback(C.SignSGD()), 2048 // 8 + 4 + 4),    # packed bits + one scale
    (C.FP16(), 2048 * 2),
])
def test_bytes_sent_are_exactly_the_payloads(mirrored, compressor, payload_bytes):
    model = _train(mirrored(2), compressor)
    opt = model.optimizer
    dense_bytes = 4 * sum(int(np.prod(v.shape)) for v in model.trainable_variables
                          if v.shape != (64, 32))
    # 2 workers: all-reduce sends 2(N-1)/N = 1 x payload, all-gather (N-1) = 1 x payload.
    assert opt.bytes_sent == pytest.approx(STEPS * (dense_bytes + payload_bytes))


def test_compression_start_step_keeps_early_exchanges_dense(mirrored):
    dense = _train(mirrored(2), None, steps=3)
    late = _train(mirrored(2), C.ErrorFeedback(C.TopK(0.01)), steps=3, compression_start_step=3)
    common.assert_weights_close(common.weights(late), common.weights(dense), rtol=0, atol=1e-6)
    assert late.optimizer.bytes_sent == pytest.approx(dense.optimizer.bytes_sent)
    _train(mirrored(2), None, model=late, steps=1)  # exchange 4 is compressed: fewer bytes
    assert late.optimizer.bytes_sent < dense.optimizer.bytes_sent * 4 / 3


def test_dgc_sparsity_warm_up_phases_send_fewer_bytes_over_time(mirrored):
    dgc = C.DGC(0.01, momentum=0.9, warmup_steps=4, warmup_ratios=(0.5, 0.1))
    model = _train(mirrored(2), dgc, steps=1)
    sent = [model.optimizer.bytes_sent]
    for _ in range(5):
        _train(mirrored(2), None, model=model, steps=1)
        sent.append(model.optimizer.bytes_sent)
    per_step = np.diff([0.0, *sent])
    k = [1024, 205, 21]  # 50%, 10%, 1% of the 2048-element kernel
    other = per_step[0] - k[0] * 8
    np.testing.assert_allclose(per_step - other, [8 * k[0]] * 2 + [8 * k[1]] * 2 + [8 * k[2]] * 2)


@pytest.mark.parametrize("compressor", [C.ErrorFeedback(C.TopK(0.01)), C.PowerSGD(rank=2),
                                        C.DGC(0.05)], ids=lambda c: type(c).__name__)
def test_save_load_continue_equals_uninterrupted(mirrored, tmp_path, compressor):
    straight = _train(mirrored(2), compressor, fits=2)
    first = _train(mirrored(2), compressor)
    path = str(tmp_path / "mid.keras")
    first.save(path)
    strategy = mirrored(2)
    with strategy.scope():
        resumed = keras.saving.load_model(path)
    state = resumed.optimizer.exchange.compression_state
    assert state, "compression state was not restored"
    residual = next(v for vars_ in state.values() for k, v in vars_.items()
                    if k in ("residual", "velocity"))
    copies = [c.numpy() for c in residual.value.values]
    assert not np.allclose(copies[0], copies[1]), "replicas' residuals should differ"
    _train(strategy, None, model=resumed)
    common.assert_weights_close(common.weights(resumed), common.weights(straight), rtol=1e-5,
                                atol=1e-6)


def test_optimizer_config_round_trips_the_compressor():
    opt = tfdist.DistributedOptimizer(keras.optimizers.SGD(), compressor="powersgd",
                                      min_compress_size=10, compression_start_step=5)
    again = tfdist.DistributedOptimizer.from_config(opt.get_config())
    assert isinstance(again.compressor, C.PowerSGD) and again.exchange.start_step == 5
    with pytest.raises(ValueError, match="compression_start_step=-1"):
        tfdist.DistributedOptimizer(keras.optimizers.SGD(), compression_start_step=-1)
    with pytest.raises(ValueError, match="Unknown compressor 'zip'"):
        tfdist.DistributedOptimizer(keras.optimizers.SGD(), compressor="zip")


def _run_config(name, tmp_path, **overrides):
    from tfdist.tools.config import load_config
    from tfdist.tools.runner import train

    sets = [f"train.output_dir={tmp_path / name}", "train.verbose=0",
            *[f"{k}={v}" for k, v in overrides.items()]]
    return train(load_config(f"configs/{name}.yaml", sets))


def test_ef_topk_and_powersgd_match_dense_accuracy_on_digits(tmp_path):
    """...in a few collective calls per step: PowerSGD's P's, its Q's and the dense rest (3),
    EF-TopK's one all-gather and the dense rest (2); a dense exchange is one."""
    dense = _run_config("default", tmp_path)
    assert dense["collectives_per_step"] == 1.0
    for name, max_ratio, calls in (("ef_topk", 0.05, 2.0), ("powersgd", 0.06, 3.0)):
        s = _run_config(name, tmp_path)
        print(f"{name}: accuracy {s['test_accuracy']:.4f} vs dense {dense['test_accuracy']:.4f}, "
              f"bytes/step {s['bytes_sent_per_step']:,.0f} ({s['bytes_ratio_vs_dense']:.4f} of dense)"
              f", {s['collectives_per_step']:.2f} collectives/step")
        assert s["test_accuracy"] >= dense["test_accuracy"] - 0.01
        assert s["bytes_ratio_vs_dense"] < max_ratio
        assert s["collectives_per_step"] == calls


def test_tf_train_checkpoint_restores_compression_state(mirrored, tmp_path):
    """tf.train.Checkpoint writes one value per variable: exact for one replica per process
    (each Horovod rank / TF_CONFIG worker checkpoints its own state)."""
    compressor = C.ErrorFeedback(C.TopK(0.01))
    straight = _train(mirrored(1), compressor, fits=2)
    first = _train(mirrored(1), compressor)
    path = tf.train.Checkpoint(model=first, optimizer=first.optimizer).save(str(tmp_path / "ck"))
    strategy = mirrored(1)
    with strategy.scope():
        resumed = common.make_model(hidden=(32,))
        opt = tfdist.DistributedOptimizer(common.make_inner_optimizer("sgd"), compressor=compressor)
        resumed.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
        opt.build(resumed.trainable_variables)
    tf.train.Checkpoint(model=resumed, optimizer=opt).restore(path).assert_consumed()
    residual = next(v for s in opt.exchange.compression_state.values() for v in s.values())
    assert np.abs(residual.numpy()).sum() > 0
    _train(strategy, None, model=resumed)
    common.assert_weights_close(common.weights(resumed), common.weights(straight), rtol=1e-5,
                                atol=1e-6)
