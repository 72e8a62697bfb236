"""Post-local SGD through DistributedOptimizer(local_sgd=...) (tf.distribute engine, in-process)."""

import keras
import numpy as np
import pytest

import tfdist
from tests.workers import common
from tfdist.averaging import PeriodicSchedule
from tfdist.comm import ring_bytes
from tfdist.optimizers import LocalSGD
from tfdist.optimizers.chain import Chain

BATCH = 32


def _model_and_fit(strategy, local_sgd, *, hidden=(32,), bn=False, batch=BATCH, **options):
    x, y = common.load_digits()
    with strategy.scope():
        keras.utils.set_random_seed(common.SEED)
        inputs = keras.Input((8, 8, 1))
        h = keras.layers.Flatten()(inputs)
        h = keras.layers.Dense(hidden[0], activation="relu")(h)
        if bn:
            h = keras.layers.BatchNormalization()(h)
        model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(h))
        opt = tfdist.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                          local_sgd=local_sgd, **options)
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
        if bn and local_sgd is not None:
            opt.average_also(model.non_trainable_variables)
    data = common.distribute(strategy, x, y, batch, shuffle=False)

    def fit(steps):
        model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)

    return model, opt, fit


def _replica_weights(model):
    """Per replica: the list of that replica's copies of every model variable."""
    copies = [v.value.values for v in model.variables]
    return [[c[r].numpy() for c in copies] for r in range(len(copies[0]))]


def test_period_one_equals_synchronous_training(mirrored):
    sync, _, fit_sync = _model_and_fit(mirrored(2), None)
    local, _, fit_local = _model_and_fit(mirrored(2), PeriodicSchedule(period=1))
    fit_sync(8)
    fit_local(8)
    common.assert_weights_close(common.weights(local), common.weights(sync), rtol=0, atol=1e-6)


def test_replicas_agree_right_after_averaging_and_differ_between(mirrored):
    model, opt, fit = _model_and_fit(mirrored(2), PeriodicSchedule(period=4, warmup_steps=2))
    fit(2)  # warm-up: synchronous steps keep the replicas equal
    a, b = _replica_weights(model)
    common.assert_weights_close(a, b, rtol=0, atol=0)
    fit(2)  # two local steps: the replicas drift apart
    a, b = _replica_weights(model)
    assert any(not np.allclose(u, v) for u, v in zip(a, b))
    fit(2)  # local step 4 ends with an averaging round
    a, b = _replica_weights(model)
    common.assert_weights_close(a, b, rtol=0, atol=1e-7)
    assert opt.communication_rounds == 2 + 1
    params = 4 * model.count_params()
    assert opt.bytes_sent == pytest.approx(3 * ring_bytes("all_reduce", params, 2))


def test_batchnorm_statistics_are_averaged_too(mirrored):
    model, _, fit = _model_and_fit(mirrored(2), PeriodicSchedule(period=3), bn=True)
    fit(2)
    a, b = _replica_weights(model)
    stats = [i for i, v in enumerate(model.variables) if "moving" in v.path]
    assert stats and any(not np.allclose(a[i], b[i]) for i in stats)
    fit(1)
    a, b = _replica_weights(model)
    for i in stats:
        np.testing.assert_allclose(a[i], b[i], rtol=0, atol=1e-7)


def test_period_8_makes_7x_fewer_rounds_at_sync_accuracy(mirrored, capsys):
    sync, sync_opt, fit_sync = _model_and_fit(mirrored(2), None, hidden=(64,))
    local, local_opt, fit_local = _model_and_fit(
        mirrored(2), PeriodicSchedule(period=8, warmup_steps=10), hidden=(64,))
    x_test, y_test = common.load_digits("test")
    for fit in (fit_sync, fit_local):
        fit(660)
    acc = {name: float(np.mean(np.argmax(m(x_test), axis=1) == y_test))
           for name, m in (("sync", sync), ("local", local))}
    rounds = sync_opt.communication_rounds / local_opt.communication_rounds
    with capsys.disabled():
        print(f"\nlocal SGD H=8 after 10 warm-up steps: accuracy {acc['local']:.4f} vs sync "
              f"{acc['sync']:.4f}; rounds {local_opt.communication_rounds} vs "
              f"{sync_opt.communication_rounds} ({rounds:.1f}x fewer)")
    assert acc["local"] >= acc["sync"] - 0.01
    assert rounds >= 7


def test_local_sgd_arguments_and_config():
    with pytest.raises(ValueError, match="PeriodicSchedule"):
        tfdist.DistributedOptimizer(keras.optimizers.SGD(), local_sgd=8)
    with pytest.raises(ValueError, match="not both"):
        tfdist.DistributedOptimizer(keras.optimizers.SGD(), tfdist.optimizers.Accumulation(2),
                                    accumulation_steps=4)
    with pytest.raises(ValueError, match="average_also needs `local_sgd`"):
        tfdist.DistributedOptimizer(keras.optimizers.SGD()).average_also([])
    opt = tfdist.DistributedOptimizer(keras.optimizers.SGD(), local_sgd=PeriodicSchedule(4, 10))
    again = tfdist.DistributedOptimizer.from_config(opt.get_config())
    assert again.local_sgd == PeriodicSchedule(4, 10)


def test_resumed_run_does_not_repeat_the_warm_up(mirrored, tmp_path):
    model, opt, fit = _model_and_fit(mirrored(2), PeriodicSchedule(period=2, warmup_steps=3))
    fit(4)
    path = str(tmp_path / "m.keras")
    model.save(path)
    strategy = mirrored(2)
    with strategy.scope():
        loaded = keras.saving.load_model(path)
    assert loaded.optimizer.local_sgd == PeriodicSchedule(2, 3)
    assert loaded.optimizer.averaging.steps == 4   # past the 3 warm-up steps
    assert loaded.optimizer.communication_rounds == opt.communication_rounds == 3 + 0


def test_local_sgd_composes_with_accumulation(mirrored):
    """Period 1 with 2 micro-steps per step == synchronous training with 2 micro-steps."""
    sync, _, fit_sync = _model_and_fit(mirrored(2), None, batch=BATCH // 2, accumulation_steps=2)
    local, opt, fit_local = _model_and_fit(mirrored(2), PeriodicSchedule(period=1), batch=BATCH // 2,
                                           accumulation_steps=2)
    fit_sync(8)
    fit_local(8)
    common.assert_weights_close(common.weights(local), common.weights(sync), rtol=0, atol=1e-6)
    assert opt.averaging.steps == 4  # one local step per 2 micro-steps


def test_local_sgd_composes_with_a_compressed_warm_up(mirrored):
    """The synchronous warm-up goes through the gradient exchange, compressed or not: with the
    identity compressor the run equals plain post-local SGD; with FP16 each warm-up exchange
    sends half the bytes, and the averaging rounds are unchanged."""
    schedule = PeriodicSchedule(period=2, warmup_steps=3)
    plain, plain_opt, fit_plain = _model_and_fit(mirrored(2), schedule)
    same, _, fit_same = _model_and_fit(mirrored(2), schedule, compressor=tfdist.compression.Identity(),
                                       min_compress_size=0, compress_1d=True)
    half, half_opt, fit_half = _model_and_fit(mirrored(2), schedule, compressor="fp16",
                                              min_compress_size=0, compress_1d=True)
    for fit in (fit_plain, fit_same, fit_half):
        fit(7)  # 3 warm-up exchanges, then 2 averaging rounds
    common.assert_weights_close(common.weights(same), common.weights(plain), rtol=0, atol=1e-6)
    params = 4 * plain.count_params()
    assert plain_opt.bytes_sent == pytest.approx(5 * ring_bytes("all_reduce", params, 2))
    assert half_opt.bytes_sent == pytest.approx((3 * 0.5 + 2) * ring_bytes("all_reduce", params, 2))


def _fit_slowmo(strategy, slowmo, steps):
    x, y = common.load_digits()
    with strategy.scope():
        model = common.make_model(hidden=(32,))
        opt = tfdist.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                          local_sgd=PeriodicSchedule(period=3, warmup_steps=2),
                                          slowmo=slowmo)
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    model.fit(common.distribute(strategy, x, y, BATCH, shuffle=False), epochs=1,
              steps_per_epoch=steps, verbose=0)
    return model


def test_slowmo_with_zero_momentum_and_unit_lr_is_plain_local_sgd(mirrored):
    from tfdist.averaging import SlowMo

    plain = _fit_slowmo(mirrored(2), None, 11)
    slow0 = _fit_slowmo(mirrored(2), SlowMo(momentum=0.0, learning_rate=1.0), 11)
    common.assert_weights_close(common.weights(slow0), common.weights(plain), rtol=0, atol=1e-6)
    slow = _fit_slowmo(mirrored(2), SlowMo(momentum=0.5, learning_rate=1.0), 11)
    assert any(not np.allclose(a, b) for a, b in zip(common.weights(slow), common.weights(plain)))
    a, b = _replica_weights(slow)  # step 11 ends an averaging round: replicas agree
    common.assert_weights_close(a, b, rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="needs `local_sgd`"):
        tfdist.DistributedOptimizer(keras.optimizers.SGD(), slowmo=SlowMo())  # no local_sgd
    with pytest.raises(ValueError, match="momentum=1.0"):
        SlowMo(momentum=1.0)


def _fit_epochs(strategy, period, callback, epochs=4, steps=4, lr=0.05):
    x, y = common.load_digits()
    with strategy.scope():
        model = common.make_model(hidden=(32,))
        opt = tfdist.DistributedOptimizer(keras.optimizers.SGD(lr),
                                          local_sgd=PeriodicSchedule(period=period))
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    rounds = []
    record = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda e, logs: rounds.append(opt.communication_rounds))
    hist = model.fit(common.distribute(strategy, x, y, BATCH), epochs=epochs,
                     steps_per_epoch=steps, verbose=0, callbacks=[callback, record])
    return opt, np.diff([0, *rounds]).tolist(), hist


def test_fixed_period_schedule_changes_h_between_epochs(mirrored):
    from tfdist.callbacks import AveragingPeriodSchedule

    cb = AveragingPeriodSchedule(schedule={0: 2, 2: 4})
    opt, rounds, hist = _fit_epochs(mirrored(2), 2, cb)
    assert cb.periods == [2, 2, 4, 4] and hist.history["averaging_period"] == [2, 2, 4, 4]
    assert rounds == [2, 2, 1, 1]  # 4 local steps per epoch: every 2nd, then every 4th


def test_adaptive_rules(mirrored):
    from tfdist.callbacks import AveragingPeriodSchedule, adacomm_period

    assert adacomm_period(8, 2.0, 0.5) == 4 and adacomm_period(8, 2.0, 2.0) == 8
    cb = AveragingPeriodSchedule(rule="adacomm")
    _, _, hist = _fit_epochs(mirrored(2), 8, cb, epochs=4, steps=16, lr=0.3)
    losses = hist.history["loss"]
    expected = [adacomm_period(8, losses[0], loss) for loss in losses]
    assert cb.periods == expected and expected[-1] < 8  # shorter as the loss falls
    grow = AveragingPeriodSchedule(rule="progress", max_period=8)
    _, _, hist = _fit_epochs(mirrored(2), 1, grow, epochs=4, steps=8, lr=0.2)
    assert all(b < a for a, b in zip(hist.history["loss"], hist.history["loss"][1:]))
    assert grow.periods == [1, 2, 4, 8]  # the loss kept falling: H doubled, up to max_period


def test_adacomm_keeps_hierarchical_periods_a_multiple_of_the_intra_period(mirrored):
    """AdaComm's ceil(sqrt(loss/loss0) H0) may be odd; with hierarchical averaging every 2
    steps within a host the global period must stay a multiple of 2 (set_period refuses
    others), so the callback rounds to the nearest multiple."""
    from tfdist.averaging import HierarchicalSchedule
    from tfdist.callbacks import AveragingPeriodSchedule, adacomm_period

    x, y = common.load_digits()
    strategy = mirrored(4)
    with strategy.scope():
        model = common.make_model(hidden=(32,))
        opt = tfdist.DistributedOptimizer(keras.optimizers.SGD(0.3), local_sgd=HierarchicalSchedule(
            2, 10, host_size=2))
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    cb = AveragingPeriodSchedule(rule="adacomm")
    hist = model.fit(common.distribute(strategy, x, y, BATCH), epochs=4, steps_per_epoch=12,
                     verbose=0, callbacks=[cb])
    losses = hist.history["loss"]
    raw = [adacomm_period(10, losses[0], loss) for loss in losses]
    assert cb.periods == [max(2, round(h / 2) * 2) for h in raw]
    assert all(h % 2 == 0 for h in cb.periods) and cb.periods[-1] < 10


def test_averaging_period_schedule_bad_arguments():
    from tfdist.callbacks import AveragingPeriodSchedule

    with pytest.raises(ValueError, match="exactly one"):
        AveragingPeriodSchedule()
    with pytest.raises(ValueError, match="rule"):
        AveragingPeriodSchedule(rule="linear")
    with pytest.raises(ValueError, match="periods >= 1"):
        AveragingPeriodSchedule(schedule={0: 0})


def test_local_sgd_strategy_equals_the_wrapper_and_averages_batchnorm(mirrored, monkeypatch):
    """One core, two entry points: LocalSGDStrategy with the user's own optimizer trains exactly
    like DistributedOptimizer(local_sgd=...) + average_also(non-trainable variables). The
    wrapper scales the loss by N on local steps (its `scale_loss`), the strategy multiplies the
    gradients: the same answer both ways."""
    prescaled: dict[int, int] = {}  # chain -> steps traced with a factor on the loss
    loss_factor = Chain.loss_factor

    def counted(chain):
        factor = loss_factor(chain)
        prescaled[id(chain)] = prescaled.get(id(chain), 0) + (factor is not None)
        return factor

    monkeypatch.setattr(Chain, "loss_factor", counted)
    schedule = PeriodicSchedule(period=3, warmup_steps=2)
    wrapper, wrapper_opt, fit_w = _model_and_fit(mirrored(2), schedule, bn=True)
    fit_w(8)
    strategy = tfdist.LocalSGDStrategy(period=3, warmup_steps=2, devices=common.cpu_devices(2))
    x, y = common.load_digits()
    with strategy.scope():
        keras.utils.set_random_seed(common.SEED)
        inputs = keras.Input((8, 8, 1))
        h = keras.layers.Dense(32, activation="relu")(keras.layers.Flatten()(inputs))
        h = keras.layers.BatchNormalization()(h)
        model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(h))
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss="sparse_categorical_crossentropy")
    model.fit(common.distribute(strategy, x, y, BATCH, shuffle=False), epochs=1,
              steps_per_epoch=8, verbose=0)
    averaging = tfdist.optimizers.chain_of(model.optimizer).part(LocalSGD)
    assert {id(v) for v in averaging.also_averaged} == {
        id(v.value) for v in model.non_trainable_variables}  # found without being named
    common.assert_weights_close(common.weights(model), common.weights(wrapper), rtol=0, atol=1e-6)
    assert tfdist.optimizers.chain_of(model.optimizer).bytes_sent == wrapper_opt.bytes_sent
    assert prescaled.get(id(wrapper_opt.chain), 0) > 0
    assert prescaled.get(id(tfdist.optimizers.chain_of(model.optimizer)), 0) == 0
    a, b = _replica_weights(model)  # step 8 ended an averaging round (local steps 3 and 6)
    common.assert_weights_close(a, b, rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="period=0"):
        tfdist.LocalSGDStrategy(period=0)


def test_ring_gossip_without_gradients_converges_to_the_mean(mirrored):
    """Decentralized averaging (each replica with its two ring neighbours, every step): with a
    zero learning rate the replicas' models converge to their mean, which gossip preserves."""
    strategy = mirrored(4)
    x, y = common.load_digits()
    with strategy.scope():
        model = common.make_model(hidden=(8,))
        opt = tfdist.DistributedOptimizer(keras.optimizers.SGD(0.0),
                                          local_sgd=PeriodicSchedule(period=1),
                                          averaging_topology="ring")
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    for v in model.trainable_variables:  # start the 4 replicas from different models
        for copy in v.value.values:
            copy.assign(rng.standard_normal(v.shape).astype(np.float32))
    start = [np.mean([c.numpy() for c in v.value.values], axis=0) for v in model.trainable_variables]
    model.fit(common.distribute(strategy, x, y, BATCH), epochs=1, steps_per_epoch=25, verbose=0)
    for v, mean in zip(model.trainable_variables, start):
        for copy in v.value.values:
            np.testing.assert_allclose(copy.numpy(), mean, atol=1e-5)
    params = 4 * model.count_params()
    assert opt.communication_rounds == 25
    assert opt.bytes_sent == pytest.approx(25 * 3 * params)  # all-gather: (N - 1) x size
    with pytest.raises(ValueError, match="topology"):
        tfdist.DistributedOptimizer(keras.optimizers.SGD(), local_sgd=PeriodicSchedule(1),
                                    averaging_topology="star")


def _differ(a, b) -> bool:
    return any(not np.allclose(u, v) for u, v in zip(a, b))


def test_hierarchical_averaging_within_hosts_then_across(mirrored):
    """4 replicas as 2 hosts of 2: host rounds every 2 local steps make each host's replicas
    equal (the hosts still differ); the global round every 4 makes all equal. Bytes per level."""
    from tfdist.averaging import HierarchicalSchedule

    schedule = HierarchicalSchedule(intra_period=2, inter_period=4, warmup_steps=1, host_size=2)
    model, opt, fit = _model_and_fit(mirrored(4), schedule)
    fit(2)  # warm-up step, then local step 1
    r = _replica_weights(model)
    assert _differ(r[0], r[1]) and _differ(r[2], r[3])
    fit(1)  # local step 2: intra-host round
    r = _replica_weights(model)
    common.assert_weights_close(r[0], r[1], rtol=0, atol=1e-7)
    common.assert_weights_close(r[2], r[3], rtol=0, atol=1e-7)
    assert _differ(r[0], r[2])
    fit(2)  # local step 4: global round
    r = _replica_weights(model)
    for other in r[1:]:
        common.assert_weights_close(other, r[0], rtol=0, atol=1e-7)
    assert opt.averaging.rounds == (1, 1) and schedule.rounds(5) == (2, 1)
    params = 4 * model.count_params()
    assert opt.bytes_sent == pytest.approx(2 * ring_bytes("all_reduce", params, 4)
                                           + ring_bytes("all_reduce", params, 2))
    with pytest.raises(ValueError, match="multiple of intra_period"):
        opt.set_averaging_period(3)
    opt.set_averaging_period(8)
    assert opt.averaging_period == 8
    with pytest.raises(ValueError, match="host_size=0"):
        HierarchicalSchedule(2, 4, host_size=0)


def test_hierarchical_host_size_must_divide_the_replicas(mirrored):
    from tfdist.averaging import HierarchicalSchedule

    _, _, fit = _model_and_fit(mirrored(4), HierarchicalSchedule(1, 2, host_size=3))
    with pytest.raises(ValueError, match="host_size=3"):
        fit(1)


def test_sma_matches_the_crossbow_recurrence(mirrored):
    """SMA with no gradient (lr 0), replicas started from different models: every replica
    follows c_j = a (w_j - z), w_j -= c_j, z += sum_j c_j + mu (z - z_prev), z_0 = mean."""
    from tfdist.averaging import SMA

    n, alpha, mu, rounds = 4, 0.2, 0.5, 6
    strategy = mirrored(n)
    x, y = common.load_digits()
    with strategy.scope():
        model = common.make_model(hidden=(8,))
        opt = tfdist.DistributedOptimizer(keras.optimizers.SGD(0.0),
                                          local_sgd=PeriodicSchedule(period=1),
                                          sma=SMA(alpha=alpha, momentum=mu))
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(1)
    starts = []
    for v in model.trainable_variables:
        copies = rng.standard_normal((n, *v.shape)).astype(np.float32)
        for copy, value in zip(v.value.values, copies):
            copy.assign(value)
        starts.append(copies.astype(np.float64))
    model.fit(common.distribute(strategy, x, y, BATCH), epochs=1, steps_per_epoch=rounds,
              verbose=0)
    for v, w in zip(model.trainable_variables, starts):
        z, velocity = w.mean(axis=0), 0.0
        for _ in range(rounds):
            mean = w.mean(axis=0)
            z_new = z + alpha * n * (mean - z) + mu * velocity
            w = w - alpha * (w - z)
            velocity, z = z_new - z, z_new
        for copy, expected in zip(v.value.values, w):
            np.testing.assert_allclose(copy.numpy(), expected, rtol=1e-5, atol=1e-5)
    assert opt.bytes_sent == pytest.approx(rounds * ring_bytes("all_reduce",
                                                               4 * model.count_params(), n))
    with pytest.raises(ValueError, match="alpha=0"):
        SMA(alpha=0)
    with pytest.raises(ValueError, match="either `slowmo` or `sma`"):
        tfdist.DistributedOptimizer(keras.optimizers.SGD(), local_sgd=PeriodicSchedule(2),
                                    sma=SMA(), slowmo=tfdist.averaging.SlowMo())


def _momentum_copies(optimizer):
    from tfdist.comm import replica_copies as _replica_copies

    slots = [v for v in optimizer.variables if "momentum" in v.path and "slowmo" not in v.path]
    assert slots
    return [[c.numpy() for c in _replica_copies(v)] for v in slots]


@pytest.mark.parametrize("average_state", [False, True])
def test_optimizer_state_is_local_or_averaged_by_option(mirrored, average_state):
    schedule = PeriodicSchedule(period=2)
    strategy = mirrored(2)
    x, y = common.load_digits()
    with strategy.scope():
        model = common.make_model(hidden=(16,))
        opt = tfdist.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                          local_sgd=schedule, average_optimizer_state=average_state)
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    model.fit(common.distribute(strategy, x, y, BATCH, shuffle=False), epochs=1,
              steps_per_epoch=2, verbose=0)  # ends with an averaging round
    slots = _momentum_copies(opt.inner_optimizer)
    assert all(np.allclose(a, b) for a, b in slots) == average_state
    params = 4 * model.count_params()
    assert opt.bytes_sent == pytest.approx(ring_bytes("all_reduce", params, 2)
                                           * (2 if average_state else 1))


def test_local_sgd_strategy_hierarchical_with_optimizer_state_equals_the_wrapper(mirrored):
    from tfdist.averaging import HierarchicalSchedule

    schedule = HierarchicalSchedule(2, 4, warmup_steps=1, host_size=2)
    x, y = common.load_digits()
    results = []
    for strategy in (mirrored(4), tfdist.LocalSGDStrategy(
            period=4, warmup_steps=1, intra_period=2, host_size=2, average_optimizer_state=True,
            devices=common.cpu_devices(4))):
        with strategy.scope():
            model = common.make_model(hidden=(16,))
            opt = keras.optimizers.SGD(0.05, momentum=0.9)
            if not isinstance(strategy, tfdist.LocalSGDStrategy):
                opt = tfdist.DistributedOptimizer(opt, local_sgd=schedule,
                                                  average_optimizer_state=True)
            model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
        model.fit(common.distribute(strategy, x, y, BATCH, shuffle=False), epochs=1,
                  steps_per_epoch=7, verbose=0)  # ends with a host round (local step 6)
        results.append(model)
    wrapper, strategy_model = results
    common.assert_weights_close(common.weights(strategy_model), common.weights(wrapper),
                                rtol=0, atol=1e-6)
    exchange = tfdist.optimizers.chain_of(strategy_model.optimizer)
    assert exchange.bytes_sent == pytest.approx(wrapper.optimizer.bytes_sent)
    slots = _momentum_copies(strategy_model.optimizer)
    for copies in slots:  # host round: each host's replicas agree on the optimizer state too
        np.testing.assert_allclose(copies[0], copies[1], atol=1e-7)
        assert not np.allclose(copies[0], copies[2])
    with pytest.raises(ValueError, match="set `intra_period` too"):
        tfdist.LocalSGDStrategy(period=4, host_size=2)
