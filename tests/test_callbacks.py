import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.workers import common
from tfdist.callbacks import CommunicationStats, LearningRateWarmup, warmup_learning_rate


def test_warmup_schedule_is_linear_then_flat():
    assert warmup_learning_rate(0.1, 4, 2, 0.0) == pytest.approx(0.1)
    assert warmup_learning_rate(0.1, 4, 2, 1.0) == pytest.approx(0.25)
    assert warmup_learning_rate(0.1, 4, 2, 2.0) == pytest.approx(0.4)
    assert warmup_learning_rate(0.1, 4, 2, 7.5) == pytest.approx(0.4)


def test_warmup_scales_by_replicas_under_mirrored_strategy(mirrored):
    strategy = mirrored(4)
    lrs = []
    cb = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda b, logs: lrs.append(
            float(model.optimizer.learning_rate.numpy())))
    x, y = common.load_digits()
    with strategy.scope():
        model = common.make_model()
        model.compile(optimizer=tfdist.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                      loss="sparse_categorical_crossentropy")
    data = common.distribute(strategy, x, y, 32)
    model.fit(data, epochs=2, steps_per_epoch=2, verbose=0,
              callbacks=[LearningRateWarmup(warmup_epochs=1), cb])
    np.testing.assert_allclose(lrs, [0.01, 0.025, 0.04, 0.04], rtol=1e-6)


@pytest.mark.parametrize("kwargs", [dict(warmup_epochs=0), dict(warmup_epochs=1, scale=-1),
                                    dict(warmup_epochs=1, steps_per_epoch=0)])
def test_warmup_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        LearningRateWarmup(**kwargs)


def test_warmup_refuses_a_schedule(mirrored):
    model = common.make_model()
    sched = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
    model.compile(optimizer=keras.optimizers.SGD(sched), loss="sparse_categorical_crossentropy")
    x, y = common.load_digits()
    with pytest.raises(ValueError, match="LearningRateSchedule"):
        model.fit(x[:64], y[:64], epochs=1, verbose=0,
                  callbacks=[LearningRateWarmup(warmup_epochs=1, scale=2)])


def test_communication_stats_logs_bytes_per_step_and_tensorboard(mirrored, tmp_path):
    strategy = mirrored(2)
    x, y = common.load_digits()
    with strategy.scope():
        model = common.make_model()
        opt = tfdist.DistributedOptimizer(keras.optimizers.SGD(0.01), accumulation_steps=2)
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    data = common.distribute(strategy, x, y, 32)
    hist = model.fit(data, epochs=2, steps_per_epoch=4, verbose=0,
                     callbacks=[CommunicationStats(log_dir=str(tmp_path), update_freq=2)])
    per_round = 4 * model.count_params()  # all-reduce of 4P bytes over 2 replicas
    assert hist.history["bytes_per_step"] == [per_round / 2, per_round / 2]  # 1 round per 2 steps
    assert hist.history["communication_rounds"] == [2.0, 4.0]
    assert hist.history["bytes_vs_dense"] == [1.0, 1.0]  # dense exchange
    assert all(t > 0 for t in hist.history["step_seconds"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "comm"))
    events.Reload()  # standard scalars, which TensorBoard and EventAccumulator.Scalars read
    assert [e.value for e in events.Scalars("bytes_per_step")] == [per_round / 2] * 2
    assert [e.value for e in events.Scalars("communication_rounds")] == [1.0, 2.0, 3.0, 4.0]


def test_bytes_vs_dense_is_per_step_for_local_sgd_too(mirrored):
    """Local SGD with period 2: one model-averaging round (a dense all-reduce's bytes) every 2
    steps, so half the bytes of dense training: bytes_vs_dense 0.5, in the logs and the summary's
    meaning."""
    strategy = mirrored(2)
    x, y = common.load_digits()
    with strategy.scope():
        model = common.make_model()
        model.compile(optimizer=tfdist.DistributedOptimizer(
            keras.optimizers.SGD(0.01), local_sgd=tfdist.averaging.PeriodicSchedule(2)),
            loss="sparse_categorical_crossentropy")
    hist = model.fit(common.distribute(strategy, x, y, 32), epochs=1, steps_per_epoch=4,
                     verbose=0, callbacks=[CommunicationStats()])
    assert hist.history["bytes_vs_dense"] == [0.5]
    assert hist.history["collectives_per_step"] == [0.5]


def test_scalar_log_writes_the_epoch_logs_and_learning_rate(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = common.make_model()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    x, y = common.load_digits()
    hist = model.fit(x[:128], y[:128], batch_size=32, epochs=3, verbose=0,
                     callbacks=[tfdist.callbacks.ScalarLog(str(tmp_path))])
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert {"loss", "accuracy", "learning_rate"} <= set(events.Tags()["scalars"])
    np.testing.assert_allclose([e.value for e in events.Scalars("loss")], hist.history["loss"],
                               rtol=1e-6)
    assert [e.step for e in events.Scalars("learning_rate")] == [1, 2, 3]


def test_communication_stats_reports_the_compression_ratio(mirrored):
    strategy = mirrored(2)
    x, y = common.load_digits()
    with strategy.scope():
        model = common.make_model(hidden=(32,))
        model.compile(optimizer=tfdist.DistributedOptimizer(
            keras.optimizers.SGD(0.01), compressor=tfdist.compression.FP16(), min_compress_size=0,
            compress_1d=True), loss="sparse_categorical_crossentropy")
    hist = model.fit(common.distribute(strategy, x, y, 32), epochs=1, steps_per_epoch=3,
                     verbose=0, callbacks=[CommunicationStats()])
    assert hist.history["bytes_vs_dense"] == [0.5]


def test_communication_stats_needs_a_tfdist_optimizer():
    model = common.make_model()
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    x, y = common.load_digits()
    with pytest.raises(ValueError, match="needs a tfdist optimizer"):
        model.fit(x[:32], y[:32], verbose=0, callbacks=[CommunicationStats()])


@pytest.mark.parametrize("kwargs, message", [
    (dict(directory=123), r"Watchdog\(directory=123\): give a directory path"),
    (dict(timeout=0), r"timeout"),
])
def test_watchdog_rejects_bad_arguments(kwargs, message):
    from tfdist.callbacks import Watchdog

    with pytest.raises((TypeError, ValueError), match=message):
        Watchdog(**kwargs)


def _lazy_or_built(lazy: bool) -> keras.Model:
    keras.utils.set_random_seed(7)
    layers = [keras.layers.Flatten(), keras.layers.Dense(64, activation="relu"),
              keras.layers.Dense(10, activation="softmax")]
    return keras.Sequential(layers if lazy else [keras.Input((8, 8, 1)), *layers])


@pytest.mark.parametrize("kind", ["compressed", "local_sgd", "zero"])
def test_a_model_built_at_its_first_batch_trains_with_every_callback_as_a_built_one(
        mirrored, tmp_path, kind):
    """A Sequential without Input (built by fit's first batch, as Horovod's examples write it),
    on 2 replicas, with tfdist's optimizers and callbacks: the weights of the same model built
    up front."""
    x, y = common.load_digits()
    weights = []
    for lazy in (True, False):
        strategy = mirrored(2)
        with strategy.scope():
            model = _lazy_or_built(lazy)
            optimizer = {
                "compressed": lambda: tfdist.DistributedOptimizer(
                    keras.optimizers.SGD(0.05, momentum=0.9), min_compress_size=64,
                    compressor=tfdist.compression.Adaptive(low=tfdist.compression.TopK(0.5),
                                                           high=tfdist.compression.TopK(0.05))),
                "local_sgd": lambda: tfdist.DistributedOptimizer(
                    keras.optimizers.SGD(0.05),
                    local_sgd=tfdist.averaging.PeriodicSchedule(2, warmup_steps=0)),
                "zero": lambda: tfdist.ZeroOptimizer(keras.optimizers.Adam(1e-3), stage=2),
            }[kind]()
            model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy",
                          metrics=["accuracy"])
        callbacks = [
            tfdist.callbacks.BackupAndRestore(str(tmp_path / f"{kind}-{lazy}"), save_freq=4),
            tfdist.callbacks.CommunicationStats(), tfdist.callbacks.StepTimer(),
            tfdist.callbacks.LearningRateWarmup(warmup_epochs=1, scale=1.5),
            tfdist.callbacks.Watchdog(timeout=120),
            tfdist.callbacks.ScalarLog(str(tmp_path / f"logs-{kind}-{lazy}"))]
        if kind == "local_sgd":
            callbacks.append(tfdist.callbacks.AveragingPeriodSchedule({1: 4}))
        if kind == "compressed":
            callbacks.append(tfdist.callbacks.Accordion(interval=2))
        model.fit(common.distribute(strategy, x, y, 64, shuffle=False),
                  epochs=2, steps_per_epoch=6, verbose=0, callbacks=callbacks)
        weights.append(model.get_weights())
    for a, b in zip(weights[1], weights[0], strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


def test_a_step_timeline_sorts_ops_and_measures_exposed_communication():
    """Hand-worked: a backward pass from 0 to 10 ms, an update from 10 to 12; all-reduces from
    4 to 8 (overlapped) and from 9 to 15 (1 ms overlapped by the backward pass, 2 by the
    update, 3 exposed). Ops outside the step's window (an input pipeline's, before it) are not
    counted; the wrapper's own ops count as `other`."""
    from tfdist.callbacks.timeline import classify, timeline_of

    ms = 1_000_000
    events = [
        ("IteratorGetNext", "IteratorGetNext", -5 * ms, -4 * ms),  # before the window
        ("StatefulPartitionedCall/mlp_1/dense_0/MatMul", "_MklMatMul", 0, 2 * ms),
        ("StatefulPartitionedCall/gradient_tape/mlp_1/dense_0/MatMul", "_MklMatMul",
         2 * ms, 10 * ms),
        ("StatefulPartitionedCall/CollectiveReduceV2", "CollectiveReduceV2", 4 * ms, 8 * ms),
        ("StatefulPartitionedCall/CollectiveReduceV2_1", "CollectiveReduceV2", 9 * ms, 15 * ms),
        ("StatefulPartitionedCall/cond/adam/ResourceApplyAdam", "ResourceApplyAdam",
         10 * ms, 12 * ms),
        ("StatefulPartitionedCall/IsFinite", "IsFinite", 12 * ms, 13 * ms),
    ]
    t = timeline_of(events, "mlp", ("distributed_optimizer", "adam"))
    assert t["span_ms"] == pytest.approx(15)
    assert t["busy_ms"] == pytest.approx({"forward": 2, "backward": 8, "update": 2,
                                          "communication": 10, "other": 1})
    assert t["exposed_communication_ms"] == pytest.approx(3)
    assert t["overlapped_communication_ms"] == pytest.approx(7)
    # op time by kind and op type: the kernels' spans summed; the input pipeline's is outside
    assert t["op_ms"] == {"forward": {"_MklMatMul": pytest.approx(2)},
                          "backward": {"_MklMatMul": pytest.approx(8)},
                          "update": {"ResourceApplyAdam": pytest.approx(2)},
                          "communication": {"CollectiveReduceV2": pytest.approx(10)},
                          "other": {"IsFinite": pytest.approx(1)}}
    assert t["backward_end_ms"] == pytest.approx(10)
    assert [c["start_ms"] for c in t["collectives"]] == pytest.approx([4, 9])
    # Horovod's ops are collectives; Keras' own update (no fused kernel) is the optimizer's
    assert classify("a/HorovodAllreduce_grads_0", "HorovodAllreduce", "m", ()) == "communication"
    assert classify("cond/SGD/Mul_3", "Mul", "m", ("SGD",)) == "update"
    assert classify("replica_1/m_12/dense/BiasAdd", "BiasAdd", "m", ()) == "forward"
    assert classify("replica_1/Add_3", "AddV2", "m", ()) == "other"
    with pytest.raises(ValueError, match="no op of the step"):
        timeline_of(events[:1], "mlp", ())


def test_a_step_timeline_shows_each_bucket_of_the_exchange(mirrored):
    """Under MirroredStrategy on 2 devices, a profiled step holds one all-reduce op per bucket
    and replica, and its figures add up; the steps before and after are not profiled."""
    from tfdist.callbacks import StepTimeline, StepTimer

    strategy = mirrored(2)
    x, y = common.load_digits()
    with strategy.scope():
        model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                                  keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(10, activation="softmax")])
        optimizer = tfdist.DistributedOptimizer(keras.optimizers.Adam(), bucket_bytes=2**19)
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    timeline, timer = StepTimeline(step=3), StepTimer()
    model.fit(common.distribute(strategy, x, y, 64), epochs=2, steps_per_epoch=2, verbose=0,
              callbacks=[timeline, timer])
    calls_per_step = optimizer.collective_calls / 4
    t = timeline.result
    assert t["step"] == 3 and calls_per_step > 1  # the 1 MB layer in a bucket of its own
    assert len(t["collectives"]) == 2 * calls_per_step
    assert all(t["busy_ms"][k] > 0 for k in ("forward", "backward", "update", "communication"))
    assert t["exposed_communication_ms"] + t["overlapped_communication_ms"] == \
        pytest.approx(t["communication_ms"])
    assert t["communication_ms"] <= t["span_ms"] and len(timer.times) == 4
    with pytest.raises(ValueError, match="step"):
        StepTimeline(step=0)


def test_a_step_timeline_keeps_an_event_that_closes_after_the_step(tmp_path):
    """An asynchronous kernel's trace event may close after its step returned (TensorFlow's
    collectives record theirs when the signalling thread returns): an event opened during the
    profiled step and closed 10 ms after it (on another thread, as the collective's is) is in the
    timeline, as communication."""
    import threading

    from tfdist.callbacks import StepTimeline

    class LateEvent(keras.callbacks.Callback):
        def __init__(self, step):
            super().__init__()
            self.step, self.seen, self.done = step, 0, threading.Event()
            self.thread = threading.Thread(target=self._event)

        def _event(self):
            with tf.profiler.experimental.Trace("late_reduce:CollectiveReduceV2"):
                self.done.wait(30)
                time.sleep(0.01)

        def on_train_batch_begin(self, batch, logs=None):
            self.seen += 1
            if self.seen == self.step:
                self.thread.start()

        def on_train_batch_end(self, batch, logs=None):
            if self.seen == self.step:
                self.done.set()

    x, y = common.load_digits()
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    timeline, late = StepTimeline(step=2, path=str(tmp_path)), LateEvent(step=2)
    model.fit(x[:256], y[:256], batch_size=64, epochs=1, verbose=0, callbacks=[timeline, late])
    late.thread.join(30)
    assert [c["node"] for c in timeline.result["collectives"]] == ["late_reduce"]
    assert timeline.result["busy_ms"]["communication"] > 0
