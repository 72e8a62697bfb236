"""tfdist.DistributedOptimizer on the tf.distribute engine (in-process, logical CPU devices)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.workers import common
from tfdist.comm import ring_bytes

STEPS, BATCH = 6, 32


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_same_weights_as_plain_mirrored_strategy(mirrored, n, optimizer):
    """The exchange adds nothing to Keras' arithmetic: with Keras' own update (the fused kernel
    rounds differently, checked on its own below) the weights are Keras' to 1e-6."""
    plain, _ = common.train("strategy", STEPS, BATCH, strategy=mirrored(n), wrap=False,
                            optimizer=optimizer)
    ours, opt = common.train("strategy", STEPS, BATCH, strategy=mirrored(n), optimizer=optimizer,
                             fused_update=False)
    common.assert_weights_close(common.weights(ours), common.weights(plain), rtol=0, atol=1e-6)
    params = ours.count_params()
    assert opt.communication_rounds == STEPS
    assert opt.bytes_sent == pytest.approx(STEPS * ring_bytes("all_reduce", 4 * params, n))


def test_the_xla_update_is_keras_arithmetic_under_mirrored_strategy(mirrored):
    """fused_update="xla": each replica's update compiled by XLA gives Keras' weights to
    float32 rounding, with Adam (which has a kernel) and RMSprop (which has none)."""
    for optimizer in ("adam", "rmsprop"):
        plain, _ = common.train("strategy", STEPS, BATCH, strategy=mirrored(2), wrap=False,
                                optimizer=optimizer)
        ours, opt = common.train("strategy", STEPS, BATCH, strategy=mirrored(2),
                                 optimizer=optimizer, fused_update="xla")
        assert opt.fused_update == "xla"
        common.assert_weights_close(common.weights(ours), common.weights(plain), rtol=0,
                                    atol=1e-6)
    with pytest.raises(ValueError, match="`fused_update` must be True, False or 'xla'. "
                                         "Received: fused_update='XLA'"):
        tfdist.DistributedOptimizer(keras.optimizers.Adam(), fused_update="XLA")


def test_buckets_go_last_tensors_first_and_close_at_the_size():
    from tfdist.comm import static_nbytes
    from tfdist.comm.base import buckets

    tensors = [tf.zeros([n]) for n in (10, 300, 5, 5, 100)]  # 40, 1200, 20, 20, 400 bytes
    assert buckets(tensors, 400) == [[4], [3, 2, 1], [0]]
    assert buckets(tensors, 10**6) == [[4, 3, 2, 1, 0]]
    assert sum(static_nbytes([tensors[i]]) for i in buckets(tensors, 1)[0]) == 400


def test_bucketed_dense_exchange_equals_one_all_reduce(mirrored):
    """Same sums, one collective call per bucket: the 64-unit MLP's 4 tensors in 2 buckets."""
    one, _ = common.train("strategy", STEPS, BATCH, strategy=mirrored(2), optimizer="adam",
                          hidden=(64,))
    split, opt = common.train("strategy", STEPS, BATCH, strategy=mirrored(2), optimizer="adam",
                              hidden=(64,), bucket_bytes=1024)
    common.assert_weights_close(common.weights(split), common.weights(one), rtol=0, atol=0)
    # Last first: (logits bias 40 B, logits kernel 2,560 B), (hidden bias, hidden kernel 16 KiB).
    assert opt.collective_calls == 2 * STEPS
    assert opt.exchange.get_config()["bucket_bytes"] == 1024


def test_world_of_one_sends_nothing_and_matches_plain(mirrored):
    plain, _ = common.train("strategy", STEPS, BATCH, strategy=mirrored(1), wrap=False)
    ours, opt = common.train("strategy", STEPS, BATCH, strategy=mirrored(1))
    common.assert_weights_close(common.weights(ours), common.weights(plain), rtol=0, atol=1e-6)
    assert opt.bytes_sent == 0.0


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_accumulation_of_4_micro_steps_equals_one_4x_batch_step(mirrored, optimizer):
    big, _ = common.train("strategy", 2, 4 * BATCH, strategy=mirrored(2), wrap=False,
                          optimizer=optimizer)
    acc, opt = common.train("strategy", 8, 4 * BATCH, strategy=mirrored(2), optimizer=optimizer,
                            accumulation_steps=4)
    common.assert_weights_close(common.weights(acc), common.weights(big), rtol=1e-5, atol=1e-6)
    assert opt.communication_rounds == 2           # one exchange per 4 micro-steps
    assert int(opt.iterations.numpy()) == 2        # the inner optimizer stepped twice
    assert int(opt._iterations.numpy()) == 8       # eight micro-steps


def test_keras_own_accumulation_fails_under_mirrored_fit_ours_does_not(mirrored):
    """Documents why the wrapper does accumulation itself (merge_call inside a cond)."""
    strategy = mirrored(2)
    x, y = common.load_digits()
    with strategy.scope():
        model = common.make_model()
        model.compile(optimizer=keras.optimizers.SGD(0.05, gradient_accumulation_steps=2),
                      loss="sparse_categorical_crossentropy")
    data = common.distribute(strategy, x, y, BATCH, shuffle=False)
    with pytest.raises(Exception, match="merge_call"):
        model.fit(data, epochs=1, steps_per_epoch=2, verbose=0)


def test_serialization_round_trip():
    opt = tfdist.DistributedOptimizer(keras.optimizers.Adam(3e-3, beta_1=0.8),
                                      accumulation_steps=3, loss_scale=None, name="dist")
    config = keras.saving.serialize_keras_object(opt)
    again = keras.saving.deserialize_keras_object(config)
    assert type(again) is tfdist.DistributedOptimizer
    assert again.accumulation_steps == 3 and again.loss_scale is None and again.name == "dist"
    assert isinstance(again.inner_optimizer, keras.optimizers.Adam)
    assert again.inner_optimizer.beta_1 == pytest.approx(0.8)
    assert again.get_config() == opt.get_config()


def test_an_optimizer_saved_with_the_removed_batched_key_loads():
    """A DistributedOptimizer saved when GradientExchange took `batched` (tfdist 0.2) loads,
    as the exchange that reduces its tensors together (the same sums)."""
    opt = tfdist.DistributedOptimizer(keras.optimizers.SGD(0.1), compressor="powersgd")
    config = keras.saving.serialize_keras_object(opt)
    found = []

    def add_batched(node):  # as tfdist 0.2 wrote the exchange's config
        if isinstance(node, dict):
            if "start_step" in node and "bucket_bytes" in node:
                node["batched"] = False
                found.append(node)
            for value in node.values():
                add_batched(value)
        elif isinstance(node, list):
            for value in node:
                add_batched(value)

    add_batched(config)
    assert len(found) == 1
    again = keras.saving.deserialize_keras_object(config)
    assert again.get_config() == opt.get_config()


def test_model_save_and_load_keeps_optimizer_state(mirrored, tmp_path):
    model, opt = common.train("strategy", STEPS, BATCH, strategy=mirrored(2), optimizer="adam")
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded.optimizer) is tfdist.DistributedOptimizer
    common.assert_weights_close(common.weights(loaded), common.weights(model), rtol=0, atol=0)
    assert loaded.optimizer.bytes_sent == opt.bytes_sent
    assert loaded.optimizer.communication_rounds == STEPS
    saved_m = [v.numpy() for v in opt.inner_optimizer.variables if "momentum" in v.path]
    loaded_m = [v.numpy() for v in loaded.optimizer.inner_optimizer.variables if "momentum" in v.path]
    assert saved_m and len(saved_m) == len(loaded_m)
    for a, b in zip(saved_m, loaded_m):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_policies_train(mirrored, policy):
    keras.config.set_dtype_policy(policy)
    try:
        strategy = mirrored(2)
        x, y = common.load_digits()
        with strategy.scope():
            model = common.make_model(hidden=(32,))
            opt = tfdist.DistributedOptimizer(keras.optimizers.Adam(1e-2))
            model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
        assert model.optimizer is opt, "Keras must not wrap a tfdist optimizer again"
        assert opt.dynamic == (policy == "mixed_float16")
        data = common.distribute(strategy, x, y, 64)
        hist = model.fit(data, epochs=3, steps_per_epoch=20, verbose=0)
    finally:
        keras.config.set_dtype_policy("float32")
    losses = hist.history["loss"]
    assert all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0]
    if policy == "mixed_float16":
        assert float(opt.dynamic_scale.numpy()) > 0


def test_dynamic_loss_scale_skips_non_finite_steps_on_every_replica(mirrored):
    strategy = mirrored(2)
    with strategy.scope():
        var = keras.Variable(np.ones(3, np.float32))
        opt = tfdist.DistributedOptimizer(keras.optimizers.SGD(1.0), loss_scale="dynamic",
                                          initial_scale=4.0)
        opt.build([var])

    @tf.function
    def step(bad):
        def fn():
            rid = tf.distribute.get_replica_context().replica_id_in_sync_group
            g = tf.fill([3], 4.0)  # scaled gradient: 1.0 after unscaling by 4
            g = tf.where(tf.logical_and(bad, tf.equal(rid, 1)), tf.fill([3], np.inf), g)
            opt.apply([g], [var])
        strategy.run(fn)

    step(tf.constant(True))  # replica 1 overflows: every replica must skip and halve the scale
    for v in strategy.experimental_local_results(var.value):
        np.testing.assert_array_equal(v, np.ones(3))
    assert float(opt.dynamic_scale.numpy()) == 2.0
    step(tf.constant(False))
    for v in strategy.experimental_local_results(var.value):
        np.testing.assert_allclose(v, 1.0 - 2 * 4.0 / 2.0)  # sum of 2 replicas / scale 2


@pytest.mark.parametrize("kwargs, match", [
    (dict(accumulation_steps=0), "accumulation_steps"),
    (dict(accumulation_steps=2.5), "accumulation_steps"),
    (dict(loss_scale="static"), "loss_scale"),
])
def test_bad_arguments_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tfdist.DistributedOptimizer(keras.optimizers.SGD(), **kwargs)


def test_rejects_wrapped_or_accumulating_inner_optimizers():
    with pytest.raises(ValueError, match="LossScaleOptimizer"):
        tfdist.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2"):
        tfdist.DistributedOptimizer(keras.optimizers.SGD(gradient_accumulation_steps=2))
    with pytest.raises(ValueError, match="Keras optimizer"):
        tfdist.DistributedOptimizer("adam")


@pytest.mark.parametrize("options", [{}, {"algorithm": "auto"}])
def test_embedding_gradients_sparse_in_keras_are_exchanged_whole(mirrored, options):
    """Keras hands embeddings' gradients over as tf.IndexedSlices (rows of unknown count when
    traced): the exchange densifies them to the tables' shapes, and dense training equals plain
    Keras on the same strategy. (The bench's encoder: its token embedding.)"""
    from tfdist.tools.models import build_model

    x = np.random.default_rng(0).standard_normal((64, 8)).astype("float32")
    y = np.random.default_rng(1).integers(0, 10, 64)
    weights = {}
    for name, wrap in (("plain", False), ("tfdist", True)):
        strategy = mirrored(2)
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = build_model("transformer", (8,), 10, (16,), layers=1, heads=2, vocab=32)
            opt = keras.optimizers.SGD(0.1)
            if wrap:
                opt = tfdist.DistributedOptimizer(opt, **options)
            model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
        weights[name] = common.weights(model)
    if not options:
        common.assert_weights_close(weights["tfdist"], weights["plain"], rtol=0, atol=1e-6)
    assert all(np.isfinite(w).all() for w in weights["tfdist"])


def test_sparse_gradients_become_dense_tensors_of_the_variables_shape():
    """Under MultiWorkerMirroredStrategy the rows of an embedding's tf.IndexedSlices gradient
    have no static count; the chain hands the parts a dense tensor of the table's shape."""
    from tfdist.optimizers.parts import dense_gradient

    table = tf.Variable(tf.zeros([5, 3]))

    @tf.function(input_signature=[tf.TensorSpec([None, 3]), tf.TensorSpec([None], tf.int32)])
    def densify(values, indices):
        grad = tf.IndexedSlices(values, indices, dense_shape=tf.shape(table, out_type=tf.int32))
        dense = dense_gradient(grad, table)
        assert dense.shape == (5, 3)  # static, when traced
        return dense

    out = densify(tf.ones([3, 3]), tf.constant([4, 0, 4]))
    np.testing.assert_array_equal(out.numpy()[:, 0], [1, 0, 0, 0, 2])
    plain = tf.ones([5, 3])
    assert dense_gradient(plain, table) is plain and dense_gradient(None, table) is None

    @tf.function(input_signature=[tf.TensorSpec([None, 3])])
    def shaped(grad):
        out = dense_gradient(grad, table)
        assert out.shape == (5, 3)
        return out

    np.testing.assert_array_equal(shaped(tf.ones([5, 3])).numpy(), np.ones([5, 3]))


def _fit_parts(strategy, *parts, **shortcuts):
    x, y = common.load_digits()
    with strategy.scope():
        model = common.make_model()
        opt = tfdist.DistributedOptimizer(common.make_inner_optimizer("sgd"), *parts, **shortcuts)
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    model.fit(common.distribute(strategy, x, y, BATCH, shuffle=False), epochs=1,
              steps_per_epoch=8, verbose=0)
    return model, opt


def test_parts_run_in_the_order_given_and_the_shortcuts_build_the_usual_order(mirrored):
    """Accumulation before the exchange (what `accumulation_steps=4` builds) exchanges once per
    4 micro-steps; after it, every micro-step, accumulating the reduced gradients: the same
    dense training either way, four times the rounds."""
    parts = tfdist.optimizers
    shortcut, by_shortcut = _fit_parts(mirrored(2), accumulation_steps=4)
    before, by_parts = _fit_parts(mirrored(2), parts.Accumulation(4), parts.GradientExchange())
    after, late = _fit_parts(mirrored(2), parts.GradientExchange(), parts.Accumulation(4))
    assert [type(p).__name__ for p in by_shortcut.chain.parts] == [
        "NanPolicy", "Accumulation", "GradientExchange"]
    assert (by_shortcut.communication_rounds, by_parts.communication_rounds,
            late.communication_rounds) == (2, 2, 8)
    common.assert_weights_close(common.weights(before), common.weights(shortcut), rtol=0, atol=0)
    common.assert_weights_close(common.weights(after), common.weights(shortcut), rtol=1e-5,
                                atol=1e-6)


def test_a_chain_is_checked_by_what_its_parts_declare():
    parts, sgd = tfdist.optimizers, keras.optimizers.SGD
    schedule = tfdist.averaging.PeriodicSchedule(4)
    with pytest.raises(ValueError, match="put it before the exchange"):
        tfdist.DistributedOptimizer(sgd(), parts.GradientExchange(), parts.LocalSGD(schedule))
    with pytest.raises(ValueError, match="exactly one exchange.*received 2"):
        tfdist.DistributedOptimizer(sgd(), parts.GradientExchange(), parts.AutoExchange())
    with pytest.raises(ValueError, match="Two parts of the same kind: Accumulation"):
        tfdist.DistributedOptimizer(sgd(), parts.Accumulation(2), parts.Accumulation(4))
    with pytest.raises(ValueError, match="not both.*accumulation_steps"):
        tfdist.DistributedOptimizer(sgd(), parts.TrackNorms(), accumulation_steps=4)
    with pytest.raises(ValueError, match="Expected a tfdist.optimizers.Part"):
        tfdist.DistributedOptimizer(sgd(), "powersgd")
    # The shortcuts and the list they stand for are one optimizer.
    listed = parts.parts_from_shortcuts(accumulation_steps=2, local_sgd=schedule,
                                        track_norms=True)
    assert [type(p).__name__ for p in listed] == [
        "TrackNorms", "Accumulation", "LocalSGD", "GradientExchange"]
    a = tfdist.DistributedOptimizer(sgd(), *listed)
    b = tfdist.DistributedOptimizer(sgd(), accumulation_steps=2, local_sgd=schedule,
                                    track_norms=True)
    assert a.get_config()["parts"] == b.get_config()["parts"]


PART_OF_ONES_OWN = '''
import tfdist


class Scale(tfdist.optimizers.Part):
    """Multiplies the reduced gradients by `factor` (after the exchange)."""

    def __init__(self, factor):
        self.factor = factor

    def step(self, ctx, grads, next):
        next(ctx, [None if g is None else g * self.factor for g in grads])

    def get_config(self):
        return {"factor": self.factor}
'''


def test_a_part_of_ones_own_is_one_file_and_saves_by_its_import_path(mirrored, tmp_path,
                                                                     monkeypatch):
    """A part after the exchange that halves the gradients trains as SGD at half the learning
    rate; the optimizer's config names it `my_parts:Scale` and loads it back."""
    (tmp_path / "my_parts.py").write_text(PART_OF_ONES_OWN)
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_parts

    x, y = common.load_digits()
    trained = []
    for inner, parts in ((keras.optimizers.SGD(0.05), ()),
                         (keras.optimizers.SGD(0.1), (tfdist.optimizers.GradientExchange(),
                                                      my_parts.Scale(0.5)))):
        strategy = mirrored(2)
        with strategy.scope():
            model = common.make_model()
            model.compile(optimizer=tfdist.DistributedOptimizer(inner, *parts),
                          loss="sparse_categorical_crossentropy")
        model.fit(common.distribute(strategy, x, y, BATCH, shuffle=False), epochs=1,
                  steps_per_epoch=4, verbose=0)
        trained.append(model)
    common.assert_weights_close(common.weights(trained[1]), common.weights(trained[0]),
                                rtol=1e-5, atol=1e-6)
    config = trained[1].optimizer.get_config()
    assert [p["class_name"] for p in config["parts"]] == ["GradientExchange", "my_parts:Scale"]
    again = tfdist.DistributedOptimizer.from_config(config)
    scale = again.chain.part(my_parts.Scale)
    assert scale is not None and scale.factor == 0.5
