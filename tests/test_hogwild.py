"""Hogwild on one host: replicas on logical CPU devices update one shared copy of the weights
without locks (`tfdist.ps.HogwildStrategy` + `HogwildSGD`)."""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.workers.common import cpu_devices


def _linear(strategy, lr=0.1):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(
            1, use_bias=False, kernel_initializer="ones")])
        model.compile(optimizer=tfdist.ps.HogwildSGD(lr), jit_compile=False,
                      loss=lambda y_true, y_pred: tf.reduce_mean(y_pred))  # gradient: mean(x)
    return model


def test_every_replicas_update_lands_on_the_shared_weights_and_is_counted():
    model = _linear(tfdist.ps.HogwildStrategy(cpu_devices(2)))
    # Per step, replica 0 gets rows of 1 and replica 1 rows of 2: gradients 1 and 2 per weight.
    x = np.concatenate([np.ones((4, 4)), 2 * np.ones((4, 4))] * 3).astype(np.float32)
    model.fit(x, np.zeros((24, 1), np.float32), batch_size=8, epochs=1, shuffle=False, verbose=0)
    # Each replica applies its own gradient, none averaged away: 1 - 0.1 * 3 steps * (1 + 2).
    np.testing.assert_allclose(model.get_weights()[0], 1.0 - 0.9, rtol=1e-6)
    optimizer = model.optimizer
    assert int(optimizer.iterations.numpy()) == 3
    report = optimizer.report()
    assert report["version"] == 6 and report["staleness_histogram"] == {0: 3, 1: 3}
    assert report["staleness_max"] == 1 and report["staleness_mean"] == 0.5
    assert optimizer.bytes_sent == 6 * 4 * 4 and optimizer.collective_calls == 0


def test_one_replica_is_plain_sgd():
    x = np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32)
    y = np.random.default_rng(1).integers(0, 3, 64)
    weights = []
    for optimizer, strategy in ((tfdist.ps.HogwildSGD(0.05), tfdist.ps.HogwildStrategy(
            cpu_devices(1))), (keras.optimizers.SGD(0.05), tf.distribute.get_strategy())):
        keras.utils.set_random_seed(3)
        with strategy.scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, "relu"),
                                      keras.layers.Dense(3)])
            model.compile(optimizer=optimizer, jit_compile=False,
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        weights.append(model.get_weights())
    for a, b in zip(*weights, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_hogwild_trains_the_digits_on_two_replicas():
    x, y = tfdist.data.load_digits()
    keras.utils.set_random_seed(0)
    strategy = tfdist.ps.HogwildStrategy(cpu_devices(2))
    with strategy.scope():
        model = keras.Sequential([keras.Input(x.shape[1:]), keras.layers.Flatten(),
                                  keras.layers.Dense(64, "relu"), keras.layers.Dense(10)])
        model.compile(optimizer=tfdist.ps.HogwildSGD(0.2), jit_compile=False,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    history = model.fit(x[:1400], y[:1400], batch_size=32, epochs=6, verbose=0)
    _, accuracy = model.evaluate(x[1400:], y[1400:], verbose=0)
    assert accuracy >= 0.9, (accuracy, history.history["loss"])
    report = model.optimizer.report()
    assert report["version"] == 2 * 6 * (1400 // 32 + 1)  # one update per replica and step


def test_hogwild_needs_shared_weights():
    strategy = tf.distribute.MirroredStrategy(cpu_devices(2))
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=tfdist.ps.HogwildSGD(0.1), loss="mse", jit_compile=False)
    with pytest.raises(ValueError, match=r"MirroredStrategy gives each replica its own.*"
                                         r"tfdist.ps.HogwildStrategy\(devices\)"):
        model.fit(np.ones((8, 4)), np.ones((8, 1)), batch_size=8, verbose=0)
    with pytest.raises(ValueError, match="at least one device"):
        tfdist.ps.HogwildStrategy([])


# -- tfdist train ----------------------------------------------------------------------------------
def test_tfdist_train_runs_hogwild_from_its_config_and_reports_the_staleness(tmp_path):
    from tfdist.tools.config import load_config
    from tfdist.tools.runner import train

    config = load_config("configs/hogwild.yaml", [
        "train.epochs=2", f"train.output_dir={tmp_path}", "train.verbose=0"])
    summary = train(config, progress=False)
    hogwild = summary["hogwild"]
    assert summary["engine"] == "hogwild" and summary["world_size"] == 2
    assert hogwild["version"] == 2 * summary["steps"]  # one update per replica and step
    assert hogwild["staleness_histogram"] == {0: summary["steps"], 1: summary["steps"]}
    assert summary["test_accuracy"] >= 0.85, summary["test_accuracy"]
    assert summary["bytes_sent_per_step"] == 2 * summary["gradient_bytes_per_round"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = tmp_path.glob("*/tensorboard/hogwild")  # as the parameter servers write it
    board = EventAccumulator(str(events)).Reload()
    assert board.Scalars("staleness_max")[0].value == hogwild["staleness_max"] == 1


@pytest.mark.parametrize("override, message", [
    ("optimizer.name=adam", "optimizer.name other than sgd"),
    ("optimizer.momentum=0.9", "optimizer.momentum"),
    ("compression.name=fp16", "compression.name"),
    ("train.checkpoint_steps=5", "train.checkpoint_steps"),
    ("data.global_batch_size=63", "must divide by engine.devices (2)"),
])
def test_configs_hogwild_cannot_run_are_refused_with_the_fix(override, message):
    from tfdist.tools.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("configs/hogwild.yaml", [override])
