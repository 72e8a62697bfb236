"""tfdist.optimizers.AutoExchange: the exchange picked from the measured link.

The decision arithmetic is checked on given measurements; training checks that the pick is taken,
the same on every replica, that a single candidate trains exactly like its fixed exchange, and
that the state survives a save. Two-process agreement is in test_multiprocess.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.workers import common
from tfdist.comm import replica_copies, ring_bytes
from tfdist.compression import PowerSGD
from tfdist.optimizers import AutoExchange, Candidate, GradientExchange
from tfdist.optimizers.auto import DECIDED, next_move

# PowerSGD, FP16, dense on a 5.5M-parameter model: calls and wire bytes per step, 2 workers.
CALLS = [3.0, 2.0, 1.0]
WIRE = [3.5e5, 1.1e7, 2.2e7]
FACTORS = [2.0, 1.0, 1.0]


def _move(step, exchange, latency, bytes_per_s, current):
    f64 = lambda v: tf.constant(v, tf.float64)  # noqa: E731
    nxt, best, estimate = next_move(f64(step), f64(exchange), f64([latency, 1.0 / bytes_per_s]),
                                    f64(CALLS), f64(WIRE), f64(FACTORS),
                                    tf.constant(current, tf.int64), f64(1.5))
    return int(nxt), int(best), estimate.numpy()


def test_slow_link_never_tries_the_dense_exchanges():
    """100 Mbit/s: after PowerSGD (0.1 s/step, 0.05 s of it exchanging), FP16 is predicted at
    0.05 + 2 ms + 11 MB / 12.5 MB/s = 0.93 s > 1.5 x 2 x 0.1 s: decide PowerSGD at once."""
    inf = np.inf
    nxt, best, estimate = _move([0.1, inf, inf], [0.05, inf, inf], 1e-3, 12.5e6, 0)
    assert (nxt, best) == (-1, 0)
    assert estimate[1] == pytest.approx(0.05 + 2e-3 + 1.1e7 / 12.5e6)
    assert estimate[2] == pytest.approx(0.05 + 1e-3 + 2.2e7 / 12.5e6)


def test_fast_link_measures_the_next_candidates_and_picks_the_least_time():
    inf = np.inf
    nxt, _, estimate = _move([0.1, inf, inf], [0.05, inf, inf], 1e-4, 1.25e9, 0)
    assert nxt == 1 and estimate[1] == pytest.approx(0.05 + 2e-4 + 1.1e7 / 1.25e9)
    nxt, _, _ = _move([0.1, 0.07, inf], [0.05, 0.02, inf], 1e-4, 1.25e9, 1)
    assert nxt == 2
    # All measured: PowerSGD's 0.1 s counts twice (its steps factor), so FP16's 0.07 s wins ...
    assert _move([0.1, 0.07, 0.08], [0.05, 0.02, 0.03], 1e-4, 1.25e9, 2)[:2] == (-1, 1)
    # ... unless dense is faster still, and PowerSGD wins only at less than half their time.
    assert _move([0.1, 0.07, 0.06], [0.05, 0.02, 0.01], 1e-4, 1.25e9, 2)[:2] == (-1, 2)
    assert _move([0.03, 0.07, 0.08], [0.01, 0.02, 0.03], 1e-4, 1.25e9, 2)[:2] == (-1, 0)


def _train_parts(strategy, steps, parts):
    x, y = common.load_digits()
    with strategy.scope():
        model = common.make_model((64,))
        opt = tfdist.DistributedOptimizer(common.make_inner_optimizer("adam"), *parts)
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    data = common.distribute(strategy, x, y, 32, shuffle=False)
    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
    return model, opt


@pytest.fixture(scope="module")
def picked():
    """12 steps over 2 replicas with the default candidates: link probe, 3 x 3 probe steps."""
    from tests.workers.common import cpu_devices

    strategy = tf.distribute.MirroredStrategy(cpu_devices(2))
    model, opt = _train_parts(strategy, 12, [AutoExchange(explore=100.0)])  # tries all
    return model, opt, opt.chain.part(AutoExchange), strategy


def test_training_decides_once_and_every_replica_holds_the_same_pick(picked):
    model, opt, auto, _ = picked
    assert int(auto._state.numpy()) == DECIDED and int(auto._decisions.numpy()) == 1
    report = auto.report()
    assert report["choice"] in ("powersgd", "fp16", "dense")
    assert report["latency_s"] > 0 and report["bandwidth_bytes_per_s"] > 0
    copies = opt.engine.replica_copies(auto._current)
    assert len(copies) == 2 and len({int(c.numpy()) for c in copies}) == 1
    # explore=100: every candidate was tried.
    assert all(c["measured"] for c in report["candidates"])
    params = model.count_params()
    dense = report["candidates"][2]
    assert dense["wire_bytes_per_step"] == ring_bytes("all_reduce", 4 * params, 2)
    assert dense["collectives_per_step"] == 1
    assert report["candidates"][0]["collectives_per_step"] == 3  # PowerSGD, batched
    assert report["candidates"][0]["wire_bytes_per_step"] < 0.25 * dense["wire_bytes_per_step"]
    assert opt.communication_rounds == 12


def test_the_pick_and_its_measurements_survive_save_and_load(picked, tmp_path):
    model, _, auto, strategy = picked
    path = str(tmp_path / "model.keras")
    model.save(path)
    with strategy.scope():
        loaded = keras.saving.load_model(path)
    again = loaded.optimizer.chain.part(AutoExchange)
    assert again.choice == auto.choice
    np.testing.assert_array_equal(again._estimate_s.numpy(), auto._estimate_s.numpy())
    assert again.get_config() == auto.get_config()


@pytest.mark.parametrize("compressor", [None, "powersgd"])
def test_a_single_candidate_trains_exactly_like_its_fixed_exchange(mirrored, compressor, capfd):
    c = None if compressor is None else PowerSGD(rank=2)
    fixed, _ = _train_parts(mirrored(2), 6, [GradientExchange(c)])
    auto, opt = _train_parts(mirrored(2), 6, [AutoExchange([Candidate("only", c)], probe_steps=2)])
    common.assert_weights_close(common.weights(auto), common.weights(fixed), rtol=1e-6,
                                atol=1e-7)
    assert opt.chain.part(AutoExchange).choice == "only"
    printed = [line for line in capfd.readouterr().err.splitlines() if "tfdist auto" in line]
    assert len(printed) == 1 and printed[0].startswith("tfdist auto: picked only | only ")
    assert "(measured)" in printed[0] and "Mbit/s" in printed[0]


def test_bucket_sizes_are_candidates_picked_by_the_measured_step(mirrored):
    """Two dense candidates that differ in bucket size only: both are measured (explore=100),
    one bucket is one collective call and 1 KiB buckets are two, the training is the dense
    exchange's either way, and the config round-trips."""
    candidates = [Candidate("dense, one call", None, bucket_bytes=None),
                  {"name": "dense, 1 KiB buckets", "bucket_bytes": 1024}]
    fixed, _ = _train_parts(mirrored(2), 12, [GradientExchange()])
    model, opt = _train_parts(mirrored(2), 12, [AutoExchange(candidates, explore=100.0)])
    auto = opt.chain.part(AutoExchange)
    report = auto.report()
    assert all(c["measured"] for c in report["candidates"])
    assert [c["collectives_per_step"] for c in report["candidates"]] == [1, 2]
    assert report["choice"] in ("dense, one call", "dense, 1 KiB buckets")
    common.assert_weights_close(common.weights(model), common.weights(fixed), rtol=1e-6,
                                atol=1e-7)
    assert AutoExchange(**auto.get_config()).candidates[1].bucket_bytes == 1024
    with pytest.raises(ValueError, match="bucket_bytes"):
        AutoExchange([Candidate("x", None, bucket_bytes=0)])


def test_one_worker_sends_nothing(mirrored):
    model, opt = _train_parts(mirrored(1), 4, [AutoExchange()])
    assert opt.bytes_sent == 0.0 and opt.chain.part(AutoExchange).choice == "dense"


def test_the_shortcut_and_the_config_build_it():
    opt = tfdist.DistributedOptimizer(keras.optimizers.Adam(), algorithm="auto")
    assert isinstance(opt.chain.part(AutoExchange), AutoExchange)
    config = keras.saving.serialize_keras_object(opt)
    again = keras.saving.deserialize_keras_object(config)
    assert again.chain.part(AutoExchange).get_config() == opt.chain.part(AutoExchange).get_config()
    from tfdist.tools.config import load_config, make_parts

    parts = make_parts(load_config("configs/auto.yaml"))
    assert [type(p).__name__ for p in parts] == ["AutoExchange"]


@pytest.mark.parametrize("make, match", [
    (lambda: AutoExchange([]), "non-empty list with distinct names"),
    (lambda: AutoExchange([Candidate("a"), Candidate("a")]), "distinct names"),
    (lambda: AutoExchange("dense"), "must be a list of candidates"),
    (lambda: AutoExchange([{"nme": "a"}]), "mapping with `name`"),
    (lambda: AutoExchange([Candidate("a", None, 0.0)]), "steps_factor of candidate 'a'"),
    (lambda: AutoExchange([Candidate("a", "zip")]), "zip"),
    (lambda: AutoExchange(probe_steps=1), "probe_steps"),
    (lambda: AutoExchange(explore=0.5), "explore"),
    (lambda: tfdist.DistributedOptimizer(keras.optimizers.Adam(), algorithm="fast"),
     "algorithm"),
    (lambda: tfdist.DistributedOptimizer(keras.optimizers.Adam(), algorithm="auto",
                                         compressor="fp16"), "give no `compressor`"),
])
def test_bad_arguments_name_the_value(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("overrides, match", [
    (["compression.name=auto", "compression.error_feedback=true"], "error_feedback"),
    (["compression.name=auto", "compression.options={probe_step: 2}"], "probe_step"),
])
def test_bad_configs_are_refused_before_training(overrides, match):
    from tfdist.tools.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


# -- local SGD as a candidate ------------------------------------------------------------------
def test_a_slow_link_picks_local_sgd_whose_averaging_rounds_are_rare():
    """Dense (2.2e7 wire bytes every step) against local SGD with period 8 (one averaging round
    of the same bytes every 8 steps), both measured at 0.05 s of compute, 100 Mbit/s: local SGD's
    estimate is 0.05 + (1e-3 + 2.2e7 / 12.5e6) / 8 s, and it is picked."""
    f64 = lambda v: tf.constant(v, tf.float64)  # noqa: E731
    step, exchange = [0.05 + 1e-3 + 2.2e7 / 12.5e6, 0.05], [1e-3 + 2.2e7 / 12.5e6, 0.0]
    nxt, best, estimate = next_move(f64(step), f64(exchange), f64([1e-3, 1 / 12.5e6]),
                                    f64([1.0, 1.0]), f64([2.2e7, 2.2e7]), f64([1.0, 1.0]),
                                    tf.constant(1, tf.int64), f64(1.5), periods=f64([1.0, 8.0]))
    assert (int(nxt), int(best)) == (-1, 1)
    assert estimate.numpy()[1] == pytest.approx(0.05 + (1e-3 + 2.2e7 / 12.5e6) / 8)
    # on a fast link the rounds cost little either way, and a steps factor decides
    nxt, best, _ = next_move(f64([0.052, 0.05]), f64([0.002, 0.0]), f64([1e-4, 1 / 1.25e9]),
                             f64([1.0, 1.0]), f64([2.2e7, 2.2e7]), f64([1.0, 1.2]),
                             tf.constant(1, tf.int64), f64(1.5), periods=f64([1.0, 8.0]))
    assert int(best) == 0


def test_a_local_sgd_candidate_trains_exactly_like_local_sgd(mirrored):
    from tfdist.averaging import PeriodicSchedule
    from tfdist.optimizers import LocalSGD

    fixed, _ = _train_parts(mirrored(2), 10, [LocalSGD(PeriodicSchedule(4, warmup_steps=0))])
    auto, opt = _train_parts(mirrored(2), 10, [AutoExchange(
        [Candidate("local4", local_period=4)], probe_steps=2)])
    common.assert_weights_close(common.weights(auto), common.weights(fixed), rtol=1e-6,
                                atol=1e-7)
    report = opt.chain.part(AutoExchange).report()
    assert report["choice"] == "local4"
    assert report["candidates"][0]["collectives_per_step"] == pytest.approx(1 / 4)


def test_leaving_a_local_candidate_averages_the_models_first(mirrored):
    """local SGD is measured first (the replicas' models drift apart), then dense; local SGD's
    steps factor makes dense the pick: from the switch on every replica holds the same model,
    and the config round-trips."""
    strategy = mirrored(2)
    candidates = [{"name": "local8", "local_period": 8, "steps_factor": 100.0},
                  Candidate("dense", None)]
    model, opt = _train_parts(strategy, 12, [AutoExchange(candidates, explore=1e6,
                                                          probe_steps=3)])
    auto = opt.chain.part(AutoExchange)
    assert auto.choice == "dense" and all(c["measured"] for c in auto.report()["candidates"])
    for v in model.trainable_variables:
        first, second = (np.asarray(c.numpy()) for c in replica_copies(v))
        np.testing.assert_array_equal(first, second)
    assert AutoExchange(**auto.get_config()).candidates[0].local_period == 8
    with pytest.raises(ValueError, match="local SGD .* give no compressor"):
        AutoExchange([Candidate("x", "fp16", local_period=4)])
    with pytest.raises(ValueError, match="local_period"):
        AutoExchange([Candidate("x", None, local_period=0)])
