"""ZeRO stage 3 (tfdist.zero.ShardedModel, trained by ZeroOptimizer(stage=3)) on logical CPU
devices."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.workers import common
from tfdist._hooks.variables import holds_storage
from tfdist.comm import ring_bytes
from tfdist.optimizers import DistributedOptimizer
from tfdist.zero import LayerShardPlan, ShardedModel, ZeroOptimizer, memory_report

BATCH = 32
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
INNER = {
    "adam": lambda: keras.optimizers.Adam(1e-2),
    "sgd": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
}


def build(batch_norm: bool = True) -> keras.Model:
    """A small convolutional model, with BatchNorm (statistics updated in the forward pass) or
    without (then its gradients do not depend on how the batch is split over replicas)."""
    keras.utils.set_random_seed(7)
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(8, 3, padding="same", use_bias=not batch_norm)(inputs)
    if batch_norm:
        h = keras.layers.BatchNormalization()(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(24, activation="relu")(h)
    return keras.Model(inputs, keras.layers.Dense(10, name="logits")(h))


def _fit(strategy, make_optimizer=None, steps=12, sharded=True, model=None, start=0,
         accumulation=1, batch_norm=True):
    """`steps` micro-steps of `accumulation`-th batches, from global batch `start` on."""
    x, y = common.load_digits()
    x, y = x[start * BATCH:], y[start * BATCH:]
    if model is None:
        with strategy.scope():
            model = build(batch_norm)
            if sharded:
                model = ShardedModel(model)
            model.compile(optimizer=make_optimizer(), loss=LOSS)
    history = model.fit(common.distribute(strategy, x, y, BATCH // accumulation, shuffle=False),
                        epochs=steps, steps_per_epoch=1, verbose=0)
    return model, history.history["loss"]


_reference_cache: dict = {}


def _reference(mirrored, name, steps=12):
    """The inner optimizer itself on the unsharded model under MirroredStrategy."""
    if (name, steps) not in _reference_cache:
        model, losses = _fit(mirrored(4), INNER[name], steps=steps, sharded=False)
        _reference_cache[name, steps] = common.weights(model), losses
    return _reference_cache[name, steps]


def test_layer_shard_plan_shards_each_layer_and_round_trips():
    plan = LayerShardPlan([[(2, 3), (4,)], [(5,)]], world_size=4)  # 10 -> 4 x 3, 5 -> 4 x 2
    assert (plan.total, plan.shard_size, plan.offsets, plan.largest_layer) == (15, 5, [0, 3], 12)
    shards = plan.split(np.arange(15.0))
    np.testing.assert_array_equal(shards[1], [3, 4, 5, 12, 13])
    np.testing.assert_array_equal(shards[3], [9, 0, 0, 0, 0])  # both layers' padding
    np.testing.assert_array_equal(plan.consolidate(shards), np.arange(15.0))
    np.testing.assert_array_equal(plan.layer_shard(tf.constant(shards[1]), 1), [12, 13])
    with pytest.raises(ValueError, match="all 4 shards"):
        plan.consolidate(shards[:3])


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_zero3_matches_the_inner_optimizer_step_by_step(mirrored, name):
    """12 steps on 4 replicas: the losses and every weight (BatchNorm statistics included) equal
    the inner optimizer's on the unsharded model; calls and prediction agree too."""
    weights, losses = _reference(mirrored, name)
    model, zero_losses = _fit(mirrored(4), lambda: ZeroOptimizer(INNER[name](), stage=3,
                                                                 fused_update=False))
    np.testing.assert_allclose(zero_losses, losses, rtol=1e-5, atol=1e-6)
    common.assert_weights_close(model.get_weights(), weights, rtol=1e-5, atol=1e-6)
    plain = build()
    plain.set_weights(weights)
    x, _ = common.load_digits()
    np.testing.assert_allclose(model(x[:64]), plain(x[:64]), rtol=1e-5, atol=1e-5)
    # predict runs on the replicas (replica 0 has the BatchNorm statistics get_weights gives)
    np.testing.assert_allclose(model.predict(x[:BATCH], verbose=0)[:BATCH // 4],
                               plain(x[:BATCH // 4]), rtol=1e-5, atol=1e-5)


def test_a_keras_optimizer_compiled_into_a_sharded_model_trains_as_the_stage_3_optimizer(
        mirrored):
    """`ShardedModel(model).compile(optimizer=Adam)`: one object for stage 3. The optimizer is
    wrapped in `ZeroOptimizer(stage=3)` (its default, fused update), and 12 steps on 4 replicas
    equal Adam on the unsharded model."""
    weights, losses = _reference(mirrored, "adam")
    model, zero_losses = _fit(mirrored(4), INNER["adam"])
    assert isinstance(model.optimizer, ZeroOptimizer) and model.optimizer.stage == 3
    np.testing.assert_allclose(zero_losses, losses, rtol=1e-5, atol=1e-6)
    common.assert_weights_close(model.get_weights(), weights, rtol=1e-5, atol=1e-6)


@keras.saving.register_keras_serializable(package="tfdist_tests")
class NoisyDense(keras.layers.Dense):
    """A Dense layer with dropout of its own (a seed generator among its variables)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seed_generator = keras.random.SeedGenerator(11)

    def call(self, x, training=None):
        y = super().call(x)
        return keras.random.dropout(y, 0.5, seed=self.seed_generator) if training else y


def test_the_backward_recomputes_with_the_forward_randomness(mirrored):
    """A layer with parameters and dropout: the backward's recomputation sees the seed the
    forward used (not the one the forward advanced), so the gradients are the forward's."""
    def build_noisy():
        keras.utils.set_random_seed(5)
        inputs = keras.Input((8, 8, 1))
        h = NoisyDense(32, activation="relu")(keras.layers.Flatten()(inputs))
        return keras.Model(inputs, keras.layers.Dense(10)(h))

    results = []
    for sharded in (False, True):
        strategy = mirrored(2)
        with strategy.scope():
            model = build_noisy()
            if sharded:
                model = ShardedModel(model)
            model.compile(optimizer=ZeroOptimizer(INNER["sgd"](), stage=3) if sharded
                          else INNER["sgd"](), loss=LOSS)
        _fit(strategy, steps=4, model=model)
        results.append(model.get_weights())
    common.assert_weights_close(results[1], results[0], rtol=1e-5, atol=1e-6)


def test_a_recurrent_layer_is_gathered_once_outside_its_loop(mirrored):
    """An LSTM runs its cell in a loop, where no collective may run: the LSTM (cell included)
    is one unit, gathered per call. Embedding + LSTM with dropout + Dense trains as unsharded
    (SGD, 3 steps)."""
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 100, size=(96, 10)), rng.integers(0, 3, size=(96,))

    def build_recurrent():
        keras.utils.set_random_seed(2)
        inputs = keras.Input((10,), dtype="int32")
        h = keras.layers.LSTM(8, dropout=0.3)(keras.layers.Embedding(100, 8)(inputs))
        return keras.Model(inputs, keras.layers.Dense(3)(h))

    results = []
    for sharded in (False, True):
        with mirrored(2).scope():
            model = build_recurrent()
            if sharded:
                model = ShardedModel(model)
                assert [type(layer).__name__ for layer, _ in model._hidden.layers] == [
                    "Embedding", "LSTM", "Dense"]
            model.compile(optimizer=ZeroOptimizer(INNER["sgd"](), stage=3) if sharded
                          else INNER["sgd"](), loss=LOSS)
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(32), epochs=1, verbose=0)
        results.append(model.get_weights())
    common.assert_weights_close(results[1], results[0], rtol=1e-5, atol=1e-6)


def test_zero3_under_mixed_bfloat16_matches_adam(mirrored):
    """bfloat16 compute, float32 parameters: the shards are gathered in float32 and each layer
    casts them as it would its own variables (the backward's recomputation too)."""
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        reference, losses = _fit(mirrored(2), INNER["adam"], steps=5, sharded=False)
        model, zero_losses = _fit(mirrored(2), lambda: ZeroOptimizer(INNER["adam"](), stage=3,
                                                                     fused_update=False),
                                  steps=5)
    finally:
        keras.config.set_dtype_policy("float32")
    np.testing.assert_allclose(zero_losses, losses, rtol=1e-5, atol=1e-6)
    common.assert_weights_close(model.get_weights(), common.weights(reference), rtol=1e-5,
                                atol=1e-6)
    assert model.shard.dtype == "float32"


def test_zero3_with_accumulation_and_with_cpu_offload_matches_adam(mirrored):
    """Accumulating 2 micro-batches equals stage 1's accumulation of the same micro-batches
    (BatchNorm sees micro-batches: not one big batch); offloaded state equals Adam."""
    accumulating = {"accumulation_steps": 2}
    stage1, _ = _fit(mirrored(4), lambda: ZeroOptimizer(INNER["adam"](), **accumulating),
                     steps=12, accumulation=2, sharded=False)
    model, _ = _fit(mirrored(4), lambda: ZeroOptimizer(INNER["adam"](), stage=3, **accumulating),
                    steps=12, accumulation=2)
    # (summed in another order: stage 3 adds reduced shards, stage 1 local full gradients)
    common.assert_weights_close(model.get_weights(), common.weights(stage1), rtol=1e-5,
                                atol=1e-5)
    weights, losses = _reference(mirrored, "adam", steps=6)
    offloaded, offloaded_losses = _fit(mirrored(4), lambda: ZeroOptimizer(
        INNER["adam"](), stage=3, offload="cpu", fused_update=False), steps=6)
    np.testing.assert_allclose(offloaded_losses, losses, rtol=1e-5, atol=1e-6)
    common.assert_weights_close(offloaded.get_weights(), weights, rtol=1e-5, atol=1e-6)
    assert all(kinds["param_shard"] == 4 * offloaded.plan.shard_size
               for device, kinds in memory_report(offloaded.optimizer).items()
               if device != "host")


def test_each_replica_holds_one_shard_of_parameters_and_state(mirrored):
    """Per device: 4 S bytes of parameters and 8 S of Adam moments, S = sum over layers of
    ceil(P_l / 4) (12 P / N + padding); the wrapped model's parameters hold no storage and say
    so when read; the step's traffic is 2 all-gathers + 1 reduce-scatter per layer."""
    n, steps = 4, 3
    model, _ = _fit(mirrored(n), lambda: ZeroOptimizer(INNER["adam"](), stage=3), steps=steps)
    plain = build()
    p = plain.count_params() - sum(int(np.prod(v.shape)) for v in plain.non_trainable_weights)
    layer_sizes = [sum(int(np.prod(v.shape)) for v in layer.trainable_weights)
                   for layer in plain.layers if layer.trainable_weights]
    s = sum(-(-size // n) for size in layer_sizes)
    assert model.plan.shard_size == s and s < p / n + len(layer_sizes)
    report = memory_report(model.optimizer)
    assert len(report) == n
    for kinds in report.values():
        assert kinds["param_shard"] == 4 * s
        assert kinds["optimizer_state"] == 8 * s
    for layer in model.wrapped().layers:
        for v in layer.trainable_weights:
            assert not holds_storage(v)
    with pytest.raises(RuntimeError, match="sharded.*get_weights"):
        model.wrapped().get_layer("logits").kernel.numpy()
    expected = steps * (ring_bytes("all_reduce", 4, n) + sum(
        2 * ring_bytes("all_gather", 4 * -(-size // n), n)
        + ring_bytes("reduce_scatter", 4 * n * -(-size // n), n) for size in layer_sizes))
    assert model.optimizer.bytes_sent == pytest.approx(expected)


def test_checkpoints_hold_unsharded_weights_and_reshard(mirrored, tmp_path):
    """A tf.train.Checkpoint of 4 replicas restores on 2 and training continues like the run
    never stopped; save_weights loads into a 2-replica ShardedModel and into the plain model."""
    adam = lambda: ZeroOptimizer(INNER["adam"](), stage=3)  # noqa: E731
    straight, _ = _fit(mirrored(4), adam, steps=6, batch_norm=False)
    path = tf.train.Checkpoint(model=straight, optimizer=straight.optimizer).save(
        str(tmp_path / "ckpt"))
    straight.save_weights(str(tmp_path / "w.weights.h5"))
    saved = dict(tf.train.list_variables(path))
    assert [s for k, s in saved.items() if "zero3_weights" in k] == [
        list(w.shape) for w in straight.wrapped().weights]
    assert straight.plan.shard_size not in [s[0] for s in saved.values() if s]
    expected_weights = straight.get_weights()
    _fit(mirrored(4), steps=6, model=straight, start=6)

    two = mirrored(2)
    with two.scope():
        model = ShardedModel(build(batch_norm=False))
        model.compile(optimizer=adam(), loss=LOSS)
        status = tf.train.Checkpoint(model=model, optimizer=model.optimizer).restore(path)
    common.assert_weights_close(model.get_weights(), expected_weights, rtol=0, atol=0)
    _fit(two, steps=6, model=model, start=6)  # the optimizer state arrives when it is built
    status.assert_consumed()
    common.assert_weights_close(model.get_weights(), straight.get_weights(),
                                rtol=1e-5, atol=1e-6)

    with two.scope():
        other = ShardedModel(build(batch_norm=False))
    other.load_weights(str(tmp_path / "w.weights.h5"))
    common.assert_weights_close(other.get_weights(), expected_weights, rtol=0, atol=0)
    plain = other.load_into(build(batch_norm=False))
    common.assert_weights_close(plain.get_weights(), expected_weights, rtol=0, atol=0)


def test_a_nonfinite_gradient_on_one_replica_is_skipped_on_all(mirrored):
    """Replica 1's batch holds a NaN: with nan_policy="skip" no replica's shard or state moves;
    with "raise" training stops naming the step."""
    x, y = common.load_digits()
    x = np.array(x[:BATCH])
    x[BATCH // 4 + 1, 0, 0, 0] = np.nan  # a row of replica 1's quarter of the batch
    for policy in ("skip", "raise"):
        strategy = mirrored(4)
        with strategy.scope():
            model = ShardedModel(build())
            model.compile(optimizer=ZeroOptimizer(INNER["adam"](), stage=3, nan_policy=policy),
                          loss=LOSS)
        before = model.get_weights()
        data = common.distribute(strategy, x, y[:BATCH], BATCH, shuffle=False)
        if policy == "raise":
            with pytest.raises(Exception, match="non-finite"):
                model.fit(data, epochs=1, steps_per_epoch=1, verbose=0)
            continue
        model.fit(data, epochs=1, steps_per_epoch=1, verbose=0)
        assert model.optimizer.skipped_steps == 1
        after = model.get_weights()
        trainable = [i for i, v in enumerate(model.wrapped().weights) if v.trainable]
        common.assert_weights_close([after[i] for i in trainable],
                                    [before[i] for i in trainable], rtol=0, atol=0)
        for v in model.optimizer.inner_optimizer.variables[2:]:
            assert not np.any(v.numpy())


def test_bad_input_is_refused_with_the_fix(mirrored):
    strategy = mirrored(2)
    with strategy.scope():
        with pytest.raises(ValueError, match="Build model"):
            ShardedModel(keras.Sequential([keras.layers.Dense(3)]))
        with pytest.raises(TypeError, match="keras.Model"):
            ShardedModel(keras.layers.Dense(3))
        shared = keras.layers.Dense(4)
        inputs = keras.Input((4,))
        with pytest.raises(ValueError, match="regularizer"):
            ShardedModel(keras.Sequential([keras.Input((4,)), keras.layers.Dense(
                2, kernel_regularizer="l2")]))
        model = ShardedModel(keras.Model(inputs, shared(shared(inputs))))  # reused: one owner
        for other in (ZeroOptimizer(keras.optimizers.Adam(), stage=2),
                      DistributedOptimizer(keras.optimizers.Adam())):
            with pytest.raises(ValueError, match="stage=3"):
                model.compile(optimizer=other, loss="mse")
        with pytest.raises(ValueError, match="Expected 2 weights"):
            model.set_weights([np.zeros(1)])
        with pytest.raises(ValueError, match="activity regularizer"):
            ShardedModel(keras.Sequential([keras.Input((4,)), keras.layers.Dense(
                2, activity_regularizer="l2")]))

        class Outer(keras.layers.Layer):  # a parameter of its own beside a Dense sublayer
            def __init__(self):
                super().__init__()
                self.inner = keras.layers.Dense(2)

            def build(self, shape):
                self.scale = self.add_weight(shape=(), initializer="ones")
                self.inner.build(shape)

            def call(self, x):
                return self.inner(x) * self.scale

        with pytest.raises(ValueError, match="holds parameters and also has sublayers"):
            ShardedModel(keras.Sequential([keras.Input((4,)), Outer()]))
        plain = build()
        plain.compile(optimizer=ZeroOptimizer(keras.optimizers.Adam(), stage=3), loss=LOSS)
    with mirrored(4).scope(), pytest.raises(ValueError, match="sharded over 2 replicas and "
                                                          "this optimizer runs on 4"):
        ZeroOptimizer(keras.optimizers.Adam(), stage=3).build(model.trainable_variables)
    with pytest.raises(ValueError, match="ShardedModel"):
        plain.fit(common.distribute(strategy, *common.load_digits(), BATCH, shuffle=False),
                  epochs=1, steps_per_epoch=1, verbose=0)
