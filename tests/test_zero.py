"""ZeRO stages 1 and 2 (tfdist.ZeroOptimizer) on MirroredStrategy over logical CPU devices."""

import contextlib
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.workers import common
from tfdist.comm import ring_bytes
from tfdist.zero import Offload, ShardPlan, ZeroOptimizer, memory_report
from tfdist.zero.offload import _DiskStore

BATCH = 32
INNER = {
    "adam": lambda: keras.optimizers.Adam(1e-2),
    "adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.05),
    "sgd": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
}


def test_shard_plan_balances_and_round_trips():
    plan = ShardPlan([(2, 3), (4,)], world_size=4)  # P = 10: shards of 3, 2 elements padding
    assert (plan.total, plan.shard_size, plan.padding) == (10, 3, 2)
    a, b = tf.reshape(tf.range(6.0), (2, 3)), tf.range(6.0, 10.0)
    flat = plan.flatten([a, b])
    assert flat.shape == (12,)
    np.testing.assert_array_equal(plan.shard(flat, 3), [9.0, 0.0, 0.0])
    u, v = plan.unflatten(flat)
    np.testing.assert_array_equal(u, a)
    np.testing.assert_array_equal(v, b)
    np.testing.assert_array_equal(plan.flatten([None, b])[:6], np.zeros(6))
    shards = plan.split(np.arange(10.0))
    assert [len(s) for s in shards] == [3, 3, 3, 3]
    np.testing.assert_array_equal(plan.consolidate(shards), np.arange(10.0))
    with pytest.raises(ValueError, match="world_size"):
        ShardPlan([(2,)], 0)
    with pytest.raises(ValueError, match="all 4 shards"):
        plan.consolidate(shards[:2])


def _fit(strategy, make_optimizer, steps=20, x=None, y=None, model=None, accumulation=1,
         hidden=(32,)):
    if x is None:
        x, y = common.load_digits()
    with strategy.scope():
        if model is None:
            model = common.make_model(hidden=hidden)
            model.compile(optimizer=make_optimizer(), loss="sparse_categorical_crossentropy")
    history = model.fit(common.distribute(strategy, x, y, BATCH // accumulation, shuffle=False),
                        epochs=steps, steps_per_epoch=1, verbose=0)
    return model, history.history["loss"]


_reference_cache: dict = {}


def _reference(mirrored, name):
    """The inner optimizer itself under MirroredStrategy (Keras' own all-reduce)."""
    if name not in _reference_cache:
        model, losses = _fit(mirrored(4), INNER[name])
        _reference_cache[name] = common.weights(model), losses
    return _reference_cache[name]


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("name", ["adam", "adamw", "sgd"])
def test_zero_matches_the_inner_optimizer_step_by_step(mirrored, name, stage):
    weights, losses = _reference(mirrored, name)
    model, zero_losses = _fit(mirrored(4), lambda: ZeroOptimizer(INNER[name](), stage=stage,
                                                                 fused_update=False))
    np.testing.assert_allclose(zero_losses, losses, rtol=1e-5, atol=1e-6)
    common.assert_weights_close(common.weights(model), weights, rtol=1e-5, atol=1e-6)


def test_optimizer_state_per_replica_is_one_shard(mirrored):
    n = 4
    zero, _ = _fit(mirrored(n), lambda: ZeroOptimizer(keras.optimizers.Adam(1e-2)), steps=1)
    plain, _ = _fit(mirrored(n), INNER["adam"], steps=1)
    p = zero.count_params()
    shard = -(-p // n)
    zero_report, plain_report = memory_report(zero.optimizer), memory_report(plain.optimizer)
    assert len(zero_report) == n  # one entry per device the copies were placed on
    for device, kinds in zero_report.items():
        assert kinds["optimizer_state"] == shard * 2 * 4, device  # Adam: m and v of one shard
        assert kinds["param_shard"] == shard * 4
        assert plain_report[device]["optimizer_state"] == p * 2 * 4  # every replica: all of it


def test_bytes_on_the_wire_equal_data_parallel_all_reduce(mirrored):
    n, steps = 4, 3
    zero, _ = _fit(mirrored(n), lambda: ZeroOptimizer(keras.optimizers.Adam(1e-2)), steps=steps)
    dense, _ = _fit(mirrored(n), lambda: tfdist.DistributedOptimizer(keras.optimizers.Adam(1e-2)),
                    steps=steps)
    plan = zero.optimizer.plan
    # reduce-scatter (N-1)/N x 4 N (S + 1) (each shard carries the non-finite count) +
    # all-gather (N-1) x 4 S, measured by the counters
    s = plan.shard_size
    assert zero.optimizer.bytes_sent == pytest.approx(steps * (n - 1) * 4 * (2 * s + 1))
    extra = steps * (ring_bytes("all_reduce", 4 * plan.padding, n)
                     + ring_bytes("reduce_scatter", 4 * n, n))  # padding, and the N counts
    assert zero.optimizer.bytes_sent - dense.optimizer.bytes_sent == pytest.approx(extra)
    assert zero.optimizer.communication_rounds == steps


@pytest.mark.parametrize("stage", [1, 2])
def test_accumulation_matches_and_stage_2_keeps_one_gradient_shard(mirrored, stage):
    n = 4
    ref, ref_losses = _fit(mirrored(n), lambda: tfdist.DistributedOptimizer(
        keras.optimizers.Adam(1e-2), accumulation_steps=2), steps=8, accumulation=2)
    zero, losses = _fit(mirrored(n), lambda: ZeroOptimizer(
        keras.optimizers.Adam(1e-2), stage=stage, accumulation_steps=2), steps=8, accumulation=2)
    common.assert_weights_close(common.weights(zero), common.weights(ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    shard = zero.optimizer.plan.shard_size
    expected = shard * 4 if stage == 2 else zero.count_params() * 4
    for kinds in memory_report(zero.optimizer).values():
        assert kinds["gradient_buffers"] == expected


def _checkpoint_at_10(mirrored, path, make_saved, make_straight=None):
    """10 steps on 4 replicas, saved to `path` (the model of `make_saved`); the uninterrupted
    run (of `make_straight`, else the saved model) goes on for 10 steps on the later batches.
    Returns that run's model and the later batches."""
    x, y = common.load_digits()
    later = (x[10 * BATCH:], y[10 * BATCH:])  # global batches 10, 11, ...
    straight, _ = _fit(mirrored(4), make_straight or make_saved, steps=10)
    saved = straight if make_straight is None else _fit(mirrored(4), make_saved, steps=10)[0]
    saved.save(path)
    _fit(mirrored(4), None, steps=10, x=later[0], y=later[1], model=straight)
    return straight, later


def test_save_with_4_replicas_load_with_2_and_continue(mirrored, tmp_path):
    path = str(tmp_path / "zero.keras")
    straight, later = _checkpoint_at_10(
        mirrored, path, lambda: ZeroOptimizer(keras.optimizers.Adam(1e-2), stage=2))

    two = mirrored(2)
    with two.scope():
        resumed = keras.saving.load_model(path)
    assert isinstance(resumed.optimizer, ZeroOptimizer) and resumed.optimizer.stage == 2
    _fit(two, None, steps=10, x=later[0], y=later[1], model=resumed)
    assert resumed.optimizer.plan.world_size == 2
    common.assert_weights_close(common.weights(resumed), common.weights(straight),
                                rtol=1e-5, atol=1e-6)


def test_a_pending_accumulation_comes_back_per_replica(mirrored, tmp_path):
    """Stage 1 saved between two micro-steps: each replica gets its own gradient buffer back
    (the per-replica format every tfdist optimizer saves), and training goes on as never
    stopped."""
    x, y = common.load_digits()
    half = BATCH // 2
    saving = mirrored(4)
    straight, _ = _fit(saving, lambda: ZeroOptimizer(
        keras.optimizers.Adam(1e-2), stage=1, accumulation_steps=2), steps=9, accumulation=2)
    path = str(tmp_path / "pending.keras")
    straight.save(path)
    pending = [[c.numpy() for c in straight.optimizer.engine.replica_copies(v)]
               for v in straight.optimizer.accumulators]
    assert len(pending[0]) == 4 and not np.allclose(pending[0][0], pending[0][1])  # they differ

    loading = mirrored(4)
    with loading.scope():
        resumed = keras.saving.load_model(path)
    for saved, v in zip(pending, resumed.optimizer.accumulators):
        for mine, copy in zip(saved, resumed.optimizer.engine.replica_copies(v), strict=True):
            np.testing.assert_array_equal(copy.numpy(), mine)
    later = (x[9 * half:], y[9 * half:])
    for model, strategy in ((straight, saving), (resumed, loading)):
        _fit(strategy, None, steps=7, x=later[0], y=later[1], model=model, accumulation=2)
    common.assert_weights_close(common.weights(resumed), common.weights(straight),
                                rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("kind", "name", "stage"), [
    ("cpu", "adam", 1), ("disk", "adam", 2), ("disk", "adamw", 1), ("disk", "sgd", 2)])
def test_offloaded_state_matches_the_inner_optimizer(mirrored, tmp_path, kind, name, stage):
    """The state off the devices (host memory; files streamed in 4 KiB chunks): same steps."""
    weights, losses = _reference(mirrored, name)
    offload = Offload(kind) if kind == "cpu" else Offload(kind, str(tmp_path), budget_bytes=4096)
    model, zero_losses = _fit(mirrored(4), lambda: ZeroOptimizer(INNER[name](), stage=stage,
                                                                  offload=offload,
                                                                  fused_update=False))
    np.testing.assert_allclose(zero_losses, losses, rtol=1e-5, atol=1e-6)
    common.assert_weights_close(common.weights(model), weights, rtol=1e-5, atol=1e-6)
    report = memory_report(model.optimizer)
    slots = 2 if name.startswith("adam") else 1
    shard = model.optimizer.plan.shard_size
    assert all(kinds["optimizer_state"] == 0 for device, kinds in report.items()
               if "device:" in device)  # nothing per element on the devices
    where = "host" if kind == "cpu" else f"disk:{tmp_path}"
    assert report[where]["optimizer_state"] == 4 * slots * shard * 4
    if kind == "disk":
        assert len(list(tmp_path.iterdir())) == 4 * slots  # one file per replica and slot


def test_disk_offload_keeps_resident_state_within_the_budget(mirrored, tmp_path, monkeypatch):
    """The resident pages of the state files, read from /proc/self/smaps as each chunk's window
    is done with, stay within half the budget, and with the working copy within all of it."""
    resident: list[int] = []
    window = _DiskStore.window

    @contextlib.contextmanager
    def measured(store, start, stop):
        with window(store, start, stop) as maps:
            yield maps
            resident.append(store.resident_bytes())

    monkeypatch.setattr(_DiskStore, "window", measured)
    budget = 32 * 1024
    offload = Offload("disk", str(tmp_path), budget_bytes=budget)
    model, _ = _fit(mirrored(2), lambda: ZeroOptimizer(keras.optimizers.Adam(1e-3),
                                                       offload=offload),
                    steps=3, hidden=(512,))
    state = model.optimizer.offloaded
    per_replica = state.stored_bytes() // 2
    assert per_replica == 2 * 4 * model.optimizer.plan.shard_size > 4 * budget  # on disk
    peak = max(resident)
    print(f"\ndisk offload: {model.count_params():,} parameters, {per_replica:,} bytes of state "
          f"per replica on disk, budget {budget:,}: peak resident {peak:,}, working copy "
          f"{state.working_bytes() // 2:,}")
    assert 0 < peak <= budget // 2
    assert peak + state.working_bytes() // 2 <= budget


def test_offloaded_checkpoint_is_consolidated_and_loads_elsewhere(mirrored, tmp_path):
    """Saved from host-offloaded state on 4 replicas; loaded on 2 replicas with the state in
    host memory (load_model), in files and on the devices (load_weights): each continues like
    the uninterrupted 4-replica run."""
    adam = lambda: keras.optimizers.Adam(1e-2)  # noqa: E731
    path = str(tmp_path / "offloaded.keras")
    straight, later = _checkpoint_at_10(
        mirrored, path, lambda: ZeroOptimizer(adam(), stage=2, offload="cpu"),
        make_straight=lambda: ZeroOptimizer(adam(), stage=2))

    two = mirrored(2)
    with two.scope():
        loaded = keras.saving.load_model(path)
    assert loaded.optimizer.offload.kind == "cpu"
    resumed = [loaded]
    for offload in (Offload("disk", str(tmp_path), budget_bytes=4096), None):
        two = mirrored(2)
        with two.scope():
            model = common.make_model(hidden=(32,))
            model.compile(optimizer=ZeroOptimizer(adam(), stage=2, offload=offload),
                          loss="sparse_categorical_crossentropy")
            model.optimizer.build(model.trainable_variables)
        model.load_weights(path)  # the model's weights and the optimizer's state
        resumed.append(model)
    for model in resumed:
        _fit(mirrored(2), None, steps=10, x=later[0], y=later[1], model=model)
        common.assert_weights_close(common.weights(model), common.weights(straight),
                                    rtol=1e-5, atol=1e-6)


def test_tf_train_checkpoint_is_consolidated_and_reshards(mirrored, tmp_path):
    """tf.train.Checkpoint of a 4-replica ZeroOptimizer holds each state slot whole (not
    replica 0's shard); restored on 2 replicas (before and after the optimizer is built, state
    on the devices or on disk) training continues like the uninterrupted run."""
    x, y = common.load_digits()
    later = (x[10 * BATCH:], y[10 * BATCH:])
    adam = lambda: keras.optimizers.Adam(1e-2)  # noqa: E731
    straight, _ = _fit(mirrored(4), lambda: ZeroOptimizer(adam(), stage=2), steps=10)
    path = tf.train.Checkpoint(model=straight, optimizer=straight.optimizer).save(
        str(tmp_path / "ckpt"))
    _fit(mirrored(4), None, steps=10, x=later[0], y=later[1], model=straight)
    saved = dict(tf.train.list_variables(path))
    p = straight.count_params()
    assert [saved[f"optimizer/zero_state/.ATTRIBUTES/{i}"] for i in (2, 3)] == [[p], [p]]
    assert not any(shape == [straight.optimizer.plan.shard_size] for shape in saved.values())

    for offload, build_first in ((None, True), (None, False), ("disk", True)):
        two = mirrored(2)
        with two.scope():
            model = common.make_model(hidden=(32,))
            model.compile(optimizer=ZeroOptimizer(adam(), stage=2, offload=offload),
                          loss="sparse_categorical_crossentropy")
            if build_first:
                model.optimizer.build(model.trainable_variables)
            status = tf.train.Checkpoint(model=model, optimizer=model.optimizer).restore(path)
        _fit(two, None, steps=10, x=later[0], y=later[1], model=model)  # deferred: at build
        status.assert_consumed()
        common.assert_weights_close(common.weights(model), common.weights(straight),
                                    rtol=1e-5, atol=1e-6)


def test_bad_arguments_say_what_and_how_to_fix():
    with pytest.raises(ValueError, match="stage=4"):
        ZeroOptimizer(keras.optimizers.Adam(), stage=4)
    with pytest.raises(ValueError, match="Lamb"):
        ZeroOptimizer(keras.optimizers.Lamb())
    with pytest.raises(ValueError, match="clipnorm=1.0"):
        ZeroOptimizer(keras.optimizers.Adam(clipnorm=1.0))
    with pytest.raises(ValueError, match="'gpu'"):
        ZeroOptimizer(keras.optimizers.Adam(), offload="gpu")
    with pytest.raises(ValueError, match="does not exist"):
        ZeroOptimizer(keras.optimizers.Adam(), offload=Offload("disk", "/no/such/dir"))
    with pytest.raises(ValueError, match="budget_bytes=10"):
        Offload("disk", budget_bytes=10)
    with pytest.raises(ValueError, match="element-wise"):
        ZeroOptimizer("adam")
    excluding = keras.optimizers.AdamW()
    excluding.exclude_from_weight_decay(var_names=["bias"])
    with pytest.raises(ValueError, match="exclude_from_weight_decay is not supported"):
        ZeroOptimizer(excluding)


def test_disk_offload_onto_a_too_small_filesystem_fails_first(mirrored, small_filesystem):
    """4 replicas' Adam state of a 19,210-parameter MLP: 2 slots x ceil(P/4) x 4 bytes = 38,424
    bytes each, which fits a 64 KiB filesystem, but 153,696 together, which does not: refused
    before training with the bytes needed (not a SIGBUS on the first write of a sparse file); no
    file is left."""
    strategy = mirrored(4)
    with strategy.scope():
        model = common.make_model(hidden=(256,))
        opt = ZeroOptimizer(keras.optimizers.Adam(),
                            offload=Offload("disk", str(small_filesystem), budget_bytes=8192))
        assert model.count_params() == 19_210
        with pytest.raises(ValueError, match=r"4 replica\(s\) needs 153,696 bytes"):
            opt.build(model.trainable_variables)
    assert list(small_filesystem.iterdir()) == []


def test_disk_store_reserves_its_files(small_filesystem):
    """Each state file is reserved whole when it is made; one that does not fit fails at once,
    naming the bytes, and removes what it made."""
    kept = _DiskStore(2, 4096, str(small_filesystem), "fits")  # 2 x 16 KiB
    assert [os.stat(p).st_blocks * 512 >= 4096 * 4 for p in kept.paths] == [True, True]
    with pytest.raises(OSError, match=r"could not reserve 65,536 bytes"):
        _DiskStore(1, 16384, str(small_filesystem), "too-big")
    assert sorted(p.name for p in small_filesystem.iterdir()) == sorted(
        os.path.basename(p) for p in kept.paths)
