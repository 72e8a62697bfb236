"""Faults inside a step: a non-finite gradient on one worker never reaches any state on any
worker (weights, error-feedback residuals, PowerSGD's Q, ZeRO shards); it is skipped (loss
scaling, or nan_policy="skip") or stops training with an error naming the step and the rank."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.workers import common

BATCH = 64
BAD_STEP = 3  # the global batch whose replica-1 slice holds a NaN


def _poisoned_digits():
    """The digits set with one NaN pixel in replica 1's half of global batch BAD_STEP."""
    x, y = common.load_digits()
    x = x.copy()
    x[BAD_STEP * BATCH + BATCH // 2 + 5, 3, 3, 0] = np.nan
    return x, y


class AllFinite(keras.callbacks.Callback):
    """Checks every optimizer variable (every replica's copy) and weight after every step."""

    def __init__(self):
        super().__init__()
        self.bad_steps: list[int] = []

    def on_train_batch_end(self, batch, logs=None):
        variables = [*self.model.optimizer.variables, *self.model.variables]
        values = [c.numpy() for v in variables for c in tfdist.comm.replica_copies(v)]
        if not all(np.all(np.isfinite(a)) for a in values if a.dtype.kind == "f"):
            self.bad_steps.append(batch)


def _fit(strategy, optimizer, x, y, steps, epochs=1, callbacks=()):
    with strategy.scope():
        model = common.make_model(hidden=(64,))
        model.compile(optimizer=optimizer(), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    history = model.fit(common.distribute(strategy, x, y, BATCH, shuffle=False), epochs=epochs,
                        steps_per_epoch=steps, verbose=0, callbacks=list(callbacks))
    return model, history


def test_powersgd_under_mixed_float16_survives_a_nan_on_one_worker(mirrored):
    """The P all-reduce spreads one worker's NaN to every worker: before, every Q and residual
    became NaN and every later step was skipped (accuracy 0.29). Now the step is skipped on
    every worker, the state is kept, and training goes on to the accuracy of a clean run."""
    x, y = _poisoned_digits()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        finite = AllFinite()
        model, history = _fit(mirrored(2), lambda: tfdist.DistributedOptimizer(
            keras.optimizers.Adam(2e-3), compressor=tfdist.compression.PowerSGD(rank=2)),
            x, y, steps=22, epochs=4, callbacks=[finite])
        clean, _ = _fit(mirrored(2), lambda: tfdist.DistributedOptimizer(
            keras.optimizers.Adam(2e-3), compressor=tfdist.compression.PowerSGD(rank=2)),
            *common.load_digits(), steps=22, epochs=4)
    finally:
        keras.config.set_dtype_policy("float32")
    assert finite.bad_steps == []
    # Halved once per epoch more than a clean run's (22 steps cover the set, so each epoch
    # meets the NaN once), not driven towards zero.
    scale = float(model.optimizer.dynamic_scale.numpy())
    assert scale >= float(clean.optimizer.dynamic_scale.numpy()) / 2**4
    xt, yt = common.load_digits("test")
    accuracy = np.mean(np.argmax(model.predict(xt, verbose=0), 1) == yt)
    reference = np.mean(np.argmax(clean.predict(xt, verbose=0), 1) == yt)
    assert accuracy >= reference - 0.02 and accuracy > 0.8  # the NaN run reached 0.29


def test_float32_nan_stops_training_naming_the_step_and_rank(mirrored):
    x, y = _poisoned_digits()
    with pytest.raises(tf.errors.InvalidArgumentError) as error:
        _fit(mirrored(2), lambda: tfdist.DistributedOptimizer(keras.optimizers.SGD(0.05)),
             x, y, steps=6)
    message = str(error.value)
    assert "non-finite gradients at optimizer step" in message
    assert f"] [{BAD_STEP}]" in message  # the step
    assert "[0 1]" in message  # rank 1's own gradients were non-finite, rank 0's not


# Every compressor, selecting ones included: top-k and DGC select by comparisons that are false
# for NaN and would drop the one non-finite row of the first kernel's gradient (ReLU(NaN) is 0
# here, so the loss stays finite and only the pixel's row of weights sees the NaN).
COMPRESSORS = [None, "fp16", "bf16", {"name": "topk", "ratio": 0.1, "error_feedback": True},
               {"name": "randomk", "ratio": 0.1}, {"name": "dgc", "ratio": 0.01},
               {"name": "threshold", "threshold": 0.01}, "qsgd", "nuqsgd", "terngrad",
               "signsgd", {"name": "onebit"}, {"name": "powersgd", "rank": 2}]


@pytest.mark.parametrize("compressor", COMPRESSORS,
                         ids=lambda c: str(c if not isinstance(c, dict) else c["name"]))
def test_float32_nan_policy_skip_skips_the_step_on_every_replica(mirrored, compressor):
    x, y = _poisoned_digits()
    finite = AllFinite()
    model, _ = _fit(mirrored(2), lambda: tfdist.DistributedOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9), compressor=compressor, nan_policy="skip",
        min_compress_size=64), x, y, steps=6, callbacks=[finite])
    assert finite.bad_steps == []
    assert tfdist.optimizers.chain_of(model.optimizer).part(
        tfdist.optimizers.NanPolicy).skipped_steps == 1
    # Skipped on both replicas (rank 0's finite slice did not move its copy alone).
    replicas = [[c.numpy() for c in tfdist.comm.replica_copies(v)] for v in model.variables]
    assert all(np.array_equal(copies[0], copies[1]) for copies in replicas)


def _bn_model() -> keras.Model:
    keras.utils.set_random_seed(3)
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(4, 3, padding="same")(inputs)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Flatten()(keras.layers.ReLU()(h))
    return keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(h))


def _fit_bn(strategy, x, y, steps, keep: bool):
    with strategy.scope():
        model = _bn_model()
        optimizer = tfdist.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                                nan_policy="skip")
        if keep:
            optimizer.skip_also(model.non_trainable_variables)
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    model.fit(common.distribute(strategy, x, y, BATCH, shuffle=False), epochs=1,
              steps_per_epoch=steps, verbose=0)
    return [[c.numpy() for c in tfdist.comm.replica_copies(v)] for v in model.variables]


def test_a_skipped_step_leaves_the_batchnorm_statistics_of_every_replica_as_they_were(mirrored):
    """An inf pixel in replica 1's half of one batch: with `skip_also(non-trainable variables)`
    every weight and every replica's BatchNorm statistics end as in a run that never had that
    batch; without it, the forward pass has already poisoned replica 1's statistics."""
    x, y = _poisoned_digits()
    x[np.isnan(x)] = np.inf
    bad = slice(BAD_STEP * BATCH, (BAD_STEP + 1) * BATCH)
    x_clean, y_clean = np.delete(x, bad, axis=0), np.delete(y, bad, axis=0)
    kept = _fit_bn(mirrored(2), x, y, steps=6, keep=True)
    never = _fit_bn(mirrored(2), x_clean, y_clean, steps=5, keep=True)
    for copies, reference in zip(kept, never):
        for a, b in zip(copies, reference):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    poisoned = _fit_bn(mirrored(2), x, y, steps=6, keep=False)
    assert not all(np.allclose(a, b) for copies, reference in zip(poisoned, never)
                   for a, b in zip(copies, reference))


def test_skip_also_needs_a_step_that_can_be_skipped():
    with pytest.raises(ValueError, match="skip_also needs a step that can be skipped"):
        tfdist.DistributedOptimizer(keras.optimizers.SGD()).skip_also([])


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_skips_or_stops_together(mirrored, stage):
    x, y = _poisoned_digits()
    finite = AllFinite()
    model, _ = _fit(mirrored(2), lambda: tfdist.ZeroOptimizer(
        keras.optimizers.Adam(1e-2), stage=stage, nan_policy="skip"), x, y, steps=6,
        callbacks=[finite])
    assert finite.bad_steps == [] and model.optimizer.skipped_steps == 1
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"non-finite gradients"):
        _fit(mirrored(2), lambda: tfdist.ZeroOptimizer(keras.optimizers.Adam(1e-2), stage=stage),
             x, y, steps=6)


def test_a_local_sgd_local_step_with_a_nan_raises(mirrored):
    x, y = _poisoned_digits()
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"non-finite local gradients"):
        _fit(mirrored(2), lambda: tfdist.DistributedOptimizer(
            keras.optimizers.SGD(0.05), local_sgd=tfdist.averaging.PeriodicSchedule(4)),
            x, y, steps=6)


def test_nan_policy_is_validated():
    with pytest.raises(ValueError, match="nan_policy='ignore'"):
        tfdist.DistributedOptimizer(keras.optimizers.SGD(), nan_policy="ignore")
    with pytest.raises(ValueError, match="nan_policy='sometimes'"):
        tfdist.ZeroOptimizer(keras.optimizers.SGD(), nan_policy="sometimes")


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "float16"])
def test_all_finite_is_exact_when_sums_overflow(dtype):
    """The check sums each tensor (a finite sum proves every term finite) and looks at the
    elements only when a sum is not finite: finite values whose sum overflows are finite, a
    single NaN, inf or -inf is not, rows included; as a tf.function and eagerly."""
    from tfdist.optimizers.nan_policy import all_finite

    big = float(np.finfo(np.float16 if dtype == "float16" else np.float32).max) / 2
    cases = {
        "small": ([[1.0, -2.0], [3.0, 4.0]], True),
        "overflowing sum": ([[big, big], [big, big]], True),
        "nan": ([[1.0, np.nan], [3.0, 4.0]], False),
        "inf": ([[1.0, np.inf], [3.0, 4.0]], False),
        "-inf": ([[-np.inf, 2.0], [3.0, 4.0]], False),
        "inf - inf": ([[np.inf, -np.inf], [3.0, 4.0]], False),
    }
    check = tf.function(all_finite)
    for name, (values, expected) in cases.items():
        t = tf.constant(values, dtype)
        rows = tf.IndexedSlices(t, tf.constant([0, 5]), tf.constant([9, 2], tf.int64))
        ok = tf.ones([3], tf.float32)
        for fn in (all_finite, check):
            assert bool(fn([ok, None, t])) is expected, (name, dtype)
            assert bool(fn([rows, ok])) is expected, (name, dtype, "rows")
    assert bool(all_finite([])) and bool(all_finite([None]))
