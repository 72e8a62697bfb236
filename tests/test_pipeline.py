"""Pipeline layer, schedules, skips, balance and tensor-parallel layers (logical CPU devices)."""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.workers.common import cpu_devices, make_pipelined_model
from tfdist._hooks.profiler import executed_devices
from tfdist.data import load_digits
from tfdist.devices import place_slots
from tfdist.pipeline import (
    Pipeline,
    PipelineModel,
    Pop,
    Stash,
    balance_by_size,
    balance_by_time,
    partition,
    schedule,
    split,
)
from tfdist.pipeline.schedule import Task

ATOL = 1e-6


# -- schedules: exact clock tables -------------------------------------------------------------
def F(i, j):
    return Task("F", i, j)


def B(i, j):
    return Task("B", i, j)


def test_gpipe_clock_table_is_exact():
    assert schedule.gpipe(2, 2) == [
        [F(0, 0)], [F(1, 0), F(0, 1)], [F(1, 1)],
        [B(0, 1)], [B(1, 1), B(0, 0)], [B(1, 0)],
    ]


def test_one_f_one_b_clock_table_is_exact():
    assert schedule.one_f_one_b(4, 2) == [
        [F(0, 0)], [F(1, 0), F(0, 1)], [B(0, 1)], [B(0, 0), F(1, 1)], [F(2, 0), B(1, 1)],
        [B(1, 0), F(2, 1)], [F(3, 0), B(2, 1)], [B(2, 0), F(3, 1)], [B(3, 1)], [B(3, 0)],
    ]


@pytest.mark.parametrize("m,k", [(1, 1), (1, 4), (4, 2), (8, 4), (3, 5), (16, 3)])
def test_schedules_run_every_task_once_in_dependency_order(m, k):
    for name in schedule.SCHEDULES:
        table = schedule.build(name, m, k)
        seen = set()
        for tick in table:
            assert len({t.stage for t in tick}) == len(tick)  # one task per stage per tick
            for t in tick:
                if t.kind == "F" and t.stage > 0:
                    assert F(t.micro, t.stage - 1) in seen
                if t.kind == "B":
                    assert F(t.micro, t.stage) in seen
                    assert t.stage == k - 1 or B(t.micro, t.stage + 1) in seen
            seen.update(tick)
        assert seen == {Task(kind, i, j) for kind in "FB" for i in range(m) for j in range(k)}
        assert len(table) == 2 * (m + k - 1)
        assert schedule.idle_fraction(table, k) == pytest.approx(
            [schedule.bubble_fraction(m, k)] * k)


@pytest.mark.parametrize("m,k", [(8, 4), (4, 4), (2, 4), (16, 2)])
def test_in_flight_is_m_for_gpipe_and_bounded_by_k_for_1f1b(m, k):
    assert schedule.in_flight(schedule.gpipe(m, k), k) == [m] * k
    assert schedule.in_flight(schedule.one_f_one_b(m, k), k) == [min(k - j, m) for j in range(k)]


def test_schedule_bad_input():
    with pytest.raises(ValueError, match="Unknown pipeline schedule 'pipedream'"):
        schedule.build("pipedream", 4, 2)
    with pytest.raises(ValueError, match="num_microbatches must be a positive integer, got 0"):
        schedule.gpipe(0, 2)


# -- transparency -------------------------------------------------------------------------------
def _layers(k: int, seed: int = 1):
    keras.utils.set_random_seed(seed)
    widths = [16, 12, 16, 8, 12, 16, 8, 3]
    acts = ["tanh", "relu"]
    return [keras.layers.Dense(w, activation=acts[i % 2] if i < 7 else None)
            for i, w in enumerate(widths)], len(widths) // k


def _data(batch=16, features=5, classes=3):
    rs = np.random.RandomState(0)
    return (tf.constant(rs.randn(batch, features).astype("float32")),
            tf.constant(rs.randint(0, classes, batch)))


def _loss(y_true, y_pred, weight=None):
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
        y_true, y_pred, from_logits=True))


def _reference(x, y, k):
    layers, _ = _layers(k)
    model = keras.Sequential([keras.Input(x.shape[1:]), *layers])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            loss = _loss(y, out)
        return out, loss, tape.gradient(loss, model.trainable_variables)

    return step()


def _pipeline(k, m, schedule_name, remat, **kwargs):
    layers, per = _layers(k)
    stages = [layers[j * per:(j + 1) * per] for j in range(k)]
    return Pipeline(stages, devices=cpu_devices(k), num_microbatches=m, schedule=schedule_name,
                    remat=remat, **kwargs)


def _close(a, b, atol=ATOL, rtol=0.0):
    for u, v in zip(a, b, strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), atol=atol, rtol=rtol)


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize("remat", ["all", "none"])
@pytest.mark.parametrize("schedule_name", ["gpipe", "1f1b"])
def test_pipeline_equals_sequential(schedule_name, remat, m, k):
    """Outputs and gradients of the layer inside a model (the model's loss outside) and of the
    whole schedule with the loss on the last stage equal the plain Sequential's."""
    x, y = _data()
    ref_out, ref_loss, ref_grads = _reference(x, y, k)

    pipe = _pipeline(k, m, schedule_name, remat)
    model = keras.Sequential([keras.Input(x.shape[1:]), pipe])

    @tf.function
    def as_layer():
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            loss = _loss(y, out)
        return out, tape.gradient(loss, model.trainable_variables)

    out, grads = as_layer()
    _close([out], [ref_out])
    _close(grads, ref_grads)

    loss, preds, grads = tf.function(lambda: pipe.forward_backward(x, y, _loss))()
    _close([loss, preds], [ref_loss, ref_out])
    _close(grads, ref_grads)


@pytest.mark.parametrize("batch", [10, 3])
@pytest.mark.parametrize("schedule_name", ["gpipe", "1f1b"])
def test_uneven_micro_batches_equal_sequential(schedule_name, batch):
    """A batch that M does not divide (fit's last partial batch): micro-batches as even as
    possible (10 = 3 + 3 + 2 + 2; 3 leaves one empty), outputs and gradients still the plain
    model's, as a layer and with the loss on the last stage (weighted by each share)."""
    x, y = _data()
    x, y = x[:batch], y[:batch]
    ref_out, ref_loss, ref_grads = _reference(x, y, 2)
    pipe = _pipeline(2, 4, schedule_name, "except_last")
    model = keras.Sequential([keras.Input(x.shape[1:]), pipe])

    @tf.function(input_signature=[tf.TensorSpec([None, 5]), tf.TensorSpec([None], tf.int64)])
    def as_layer(x, y):  # a dynamic batch size, as under fit
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            loss = _loss(y, out)
        return out, tape.gradient(loss, model.trainable_variables)

    out, grads = as_layer(x, tf.cast(y, tf.int64))
    _close([out, *grads], [ref_out, *ref_grads])
    loss, preds, grads = tf.function(lambda: pipe.forward_backward(x, y, _loss))()
    _close([loss, preds, *grads], [ref_loss, ref_out, *ref_grads])


def test_fit_on_arrays_with_a_partial_last_batch():
    """1,438 digits in batches of 64 end with a batch of 30, which 4 micro-batches do not
    divide: fit trains through it (PipelineModel and the layer), no error."""
    x, y = load_digits()
    for kind in ("model", "layer"):
        model = make_pipelined_model(kind, cpu_devices(2))
        model.compile(place_slots(keras.optimizers.SGD(0.05)),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        history = model.fit(x, y, batch_size=64, epochs=1, verbose=0)
        assert np.isfinite(history.history["loss"][0])


def test_input_gradient_flows_back_through_the_pipeline():
    x, _ = _data()
    layers, _ = _layers(2)
    ref = keras.Sequential([keras.Input((5,)), *layers])
    pipe = _pipeline(2, 4, "gpipe", "except_last")
    grads = []
    for model in (ref, keras.Sequential([keras.Input((5,)), pipe])):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(model(x, training=True) ** 2)
        grads.append(tape.gradient(loss, x))
    assert grads[1] is not None
    _close(grads[1:], grads[:1])


def test_remat_recomputes_dropout_with_the_forward_masks():
    """Re-materialization restores the stage's seed state, so the recomputed dropout masks are the
    forward's: gradients equal the run that kept its activations."""
    x, y = _data()
    results = []
    for remat in ("all", "none"):
        keras.utils.set_random_seed(3)
        stages = [[keras.layers.Dense(32, activation="relu"), keras.layers.Dropout(0.5)],
                  [keras.layers.Dense(32, activation="relu"), keras.layers.Dropout(0.5),
                   keras.layers.Dense(3)]]
        pipe = Pipeline(stages, devices=cpu_devices(2), num_microbatches=4, remat=remat)
        pipe.build((16, 5))
        results.append(tf.function(lambda pipe=pipe: pipe.forward_backward(x, y, _loss))())
    (loss_a, _, grads_a), (loss_b, _, grads_b) = results
    _close([loss_a, *grads_a], [loss_b, *grads_b])


# -- skips ---------------------------------------------------------------------------------------
def _skip_model_layers(seed=2):
    keras.utils.set_random_seed(seed)
    return [keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)]


def test_skip_connection_across_stages_equals_the_functional_model():
    x, y = _data()
    d0, d1, d2, d3 = _skip_model_layers()
    inputs = keras.Input((5,))
    h0 = d0(inputs)
    out = d3(keras.layers.Concatenate()([d2(d1(h0)), h0]))
    ref = keras.Model(inputs, out)
    with tf.GradientTape() as tape:
        ref_out = ref(x, training=True)
        ref_loss = _loss(y, ref_out)
    ref_grads = tape.gradient(ref_loss, ref.trainable_variables)

    d0, d1, d2, d3 = _skip_model_layers()
    pipe = Pipeline([[d0, Stash("h0")], [d1], [d2, Pop("h0", merge="concat"), d3]],
                    devices=cpu_devices(3), num_microbatches=4, schedule="1f1b", remat="all",
                    name="skip_pipe")
    pipe.build((16, 5))
    loss, preds, grads = pipe.forward_backward(x, y, _loss)
    _close([loss, preds, *grads], [ref_loss, ref_out, *ref_grads])

    # The skip goes from stage 0 to stage 2 directly: stage 1 keeps only its own input
    # (1F1B: at most 2 micro-batches of 4 x 8 floats), stage 2 its input and the skip.
    assert pipe.stats.peak_microbatches == [3, 2, 1]
    assert pipe.stats.peak_bytes == [3 * 4 * 5 * 4, 2 * 4 * 8 * 4, 1 * 2 * 4 * 8 * 4]

    # ... and stage 1's device never receives it: one tensor per micro-batch arrives there
    # (stage 0's output), while stage 2's device receives two per micro-batch.
    # (receives are named after the node they receive from; graphs of other functions the
    # runtime instantiates meanwhile, e.g. earlier tests' input pipelines, are left out)
    placed = executed_devices(lambda: pipe(x, training=False))
    received = [sum(1 for name, (device, op) in placed.items() if op == "_Recv"
                    and re.match(r"skip_pipe(_\d+)?/stage\d", name)
                    and device.endswith(f"CPU:{j}"))
                for j in (1, 2)]
    assert received == [4, 8]


def test_skip_bad_input():
    with pytest.raises(ValueError, match="'s' is popped at stage 0, layer 0 .* before it is stashed"):
        Pipeline([[Pop("s"), keras.layers.Dense(2)], [Stash("s"), keras.layers.Dense(2)]],
                 devices=cpu_devices(2))
    with pytest.raises(ValueError, match="'s' is stashed at stage 0, layer 0 but never popped"):
        Pipeline([[Stash("s"), keras.layers.Dense(2)], [keras.layers.Dense(2)]],
                 devices=cpu_devices(2))
    with pytest.raises(ValueError, match="'s' is stashed twice"):
        Pipeline([[Stash("s"), Stash("s")], [Pop("s")]], devices=cpu_devices(2))


# -- placement -----------------------------------------------------------------------------------
def test_forward_and_backward_kernels_run_on_their_stage_device():
    x, y = _data()
    pipe = _pipeline(4, 4, "1f1b", "except_last")
    pipe.build((16, 5))
    placed = executed_devices(lambda: pipe.forward_backward(x, y, _loss))
    kernels: dict = {}  # (stage, "F" | "B") -> devices of its MatMul kernels
    for name, (device, op) in placed.items():
        stage = re.search(r"stage(\d+)", name)
        if "MatMul" in op and stage:  # backward nodes: gradient_tape/<forward node name>/...
            kind = "B" if "gradient_tape" in name else "F"
            kernels.setdefault((int(stage.group(1)), kind), []).append(device)
    for j in range(4):
        forward, backward = kernels.get((j, "F")), kernels.get((j, "B"))
        assert forward and backward, (j, sorted(kernels))
        assert {d.rsplit("/", 1)[-1] for d in forward + backward} == {f"device:CPU:{j}"}


def test_optimizer_slots_sit_on_their_variables_devices():
    x, y = _data()
    pipe = _pipeline(2, 2, "gpipe", "none")
    model = PipelineModel(pipe)
    model.compile(keras.optimizers.Adam(1e-2), loss=_loss)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    optimizer = model.optimizer
    for variable in model.trainable_variables:
        for slot in (optimizer._momentums[optimizer._get_variable_index(variable)],
                     optimizer._velocities[optimizer._get_variable_index(variable)]):
            assert slot.value.device == variable.value.device
    assert {v.value.device[-5:] for v in model.trainable_variables} == {"CPU:0", "CPU:1"}
    assert place_slots(optimizer) is optimizer  # idempotent


# -- 1F1B memory ---------------------------------------------------------------------------------
@pytest.mark.parametrize("remat", ["all", "none"])
def test_1f1b_keeps_at_most_k_microbatches_gpipe_m(remat):
    x, y = _data(batch=32)
    stats = {}
    for name in ("gpipe", "1f1b"):
        pipe = _pipeline(4, 8, name, remat)
        pipe.build((32, 5))
        pipe.forward_backward(x, y, _loss)
        stats[name] = pipe.stats
    assert stats["gpipe"].peak_microbatches == [8, 8, 8, 8]
    assert stats["1f1b"].peak_microbatches == [4, 3, 2, 1]
    # bytes scale the same way: each micro-batch keeps the same tensors under both schedules
    for j, (g, o) in enumerate(zip(stats["gpipe"].peak_bytes, stats["1f1b"].peak_bytes)):
        assert g * (4 - j) == o * 8


def test_remat_keeps_only_stage_inputs():
    x, y = _data()
    kept = {}
    for remat in ("all", "none"):
        pipe = _pipeline(2, 4, "gpipe", remat)
        pipe.build((16, 5))
        pipe.forward_backward(x, y, _loss)
        kept[remat] = pipe.stats.peak_bytes
    # stage 0 input: 4 micro-batches of 4 x 5 floats; without remat also its layers' outputs
    # (4 Dense layers of 16, 12, 16, 8 units)
    assert kept["all"][0] == 4 * 4 * 5 * 4
    assert kept["none"][0] == 4 * 4 * (5 + 16 + 12 + 16 + 8) * 4


# -- training, saving ----------------------------------------------------------------------------
def test_pipeline_model_trains_like_the_plain_model_on_the_digits():
    from tfdist.data import load_digits

    (x, y), (xt, yt) = load_digits("train"), load_digits("test")
    x, xt = x.reshape(len(x), -1), xt.reshape(len(xt), -1)
    n, nt = len(x) // 32 * 32, len(xt) // 4 * 4  # batches the micro-batches divide
    x, y, xt, yt = x[:n], y[:n], xt[:nt], yt[:nt]

    def layers():
        keras.utils.set_random_seed(7)
        return [keras.layers.Dense(64, activation="relu"), keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(10)]

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    accuracies = []
    for kind in ("plain", "layer", "model"):
        ls = layers()
        if kind == "plain":
            model = keras.Sequential([keras.Input(x.shape[1:]), *ls])
        elif kind == "layer":
            pipe = Pipeline([ls[:1], ls[1:]], devices=cpu_devices(2), num_microbatches=4)
            model = keras.Sequential([keras.Input(x.shape[1:]), pipe])
        else:
            model = PipelineModel(Pipeline([ls[:1], ls[1:]], devices=cpu_devices(2),
                                           num_microbatches=4, schedule="1f1b"))
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9), loss=loss, metrics=["accuracy"])
        model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
        predictions = model.predict(xt, batch_size=len(xt), verbose=0)
        accuracies.append(float(np.mean(np.argmax(predictions, -1) == yt)))
    print("digits test accuracy plain / Pipeline layer / PipelineModel(1f1b):", accuracies)
    assert accuracies[0] > 0.9
    assert accuracies[1] == pytest.approx(accuracies[0], abs=0.005)
    assert accuracies[2] == pytest.approx(accuracies[0], abs=0.005)


def test_pipeline_saves_and_loads(tmp_path):
    x, y = _data()
    d0, d1, d2, d3 = _skip_model_layers()
    pipe = Pipeline([[d0, Stash("h")], [d1, d2, Pop("h"), d3]], devices=cpu_devices(2),
                    num_microbatches=4, schedule="1f1b", remat="none")
    inputs = keras.Input((5,))
    model = keras.Model(inputs, keras.layers.Softmax()(pipe(inputs)))
    model.compile("adam", "sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    restored = loaded.layers[1]
    assert isinstance(restored, Pipeline)
    assert (restored.devices, restored.num_microbatches, restored.schedule_name, restored.remat) == (
        pipe.devices, 4, "1f1b", "none")
    _close([loaded.predict(x, verbose=0, batch_size=8)], [model.predict(x, verbose=0, batch_size=8)])

    pm = PipelineModel(_pipeline(2, 2, "gpipe", "all"))
    pm.compile(keras.optimizers.Adam(1e-2), loss=_loss)
    pm.fit(x, y, batch_size=8, epochs=1, verbose=0)
    pm.save(tmp_path / "pm.keras")
    loaded = keras.saving.load_model(tmp_path / "pm.keras", custom_objects={"_loss": _loss})
    _close([loaded.predict(x, verbose=0, batch_size=8)], [pm.predict(x, verbose=0, batch_size=8)])
    # training continues identically from the loaded optimizer state
    pm.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    loaded.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    _close(loaded.get_weights(), pm.get_weights())


# -- bad input -----------------------------------------------------------------------------------
def test_pipeline_bad_input():
    dense = keras.layers.Dense
    with pytest.raises(ValueError, match=r"3 stages but 2 devices .* one device per stage"):
        Pipeline([[dense(2)], [dense(2)], [dense(2)]], devices=cpu_devices(2))
    with pytest.raises(ValueError, match=r"8 stages but this process has 4 devices"):
        Pipeline([[dense(2)] for _ in range(8)])
    with pytest.raises(TypeError, match=r"give a list of stages, each a list of Keras layers"):
        Pipeline(dense)
    with pytest.raises(TypeError, match=r"give a list of stages, each a list of Keras layers"):
        Pipeline([dense(2), dense(2)])
    with pytest.raises(ValueError, match=r"stage 1 has no layers"):
        Pipeline([[dense(2)], []], devices=cpu_devices(2))
    with pytest.raises(ValueError, match=r"Unknown pipeline schedule 'interleaved'"):
        Pipeline([[dense(2)]], devices=cpu_devices(1), schedule="interleaved")
    with pytest.raises(ValueError, match=r"remat='sometimes'"):
        Pipeline([[dense(2)]], devices=cpu_devices(1), remat="sometimes")
    with pytest.raises(ValueError, match=r"'/cpu:9' does not exist"):
        Pipeline([[dense(2)], [dense(2)]], devices=["/cpu:0", "/cpu:9"]).build((4, 3))
    with pytest.raises(ValueError, match=r"inside a tf.distribute strategy with 2 replicas"), \
            tf.distribute.MirroredStrategy(cpu_devices(2)).scope():
        pipe = _pipeline(2, 2, "gpipe", "all")
        tf.distribute.get_strategy().run(lambda: pipe(tf.ones((4, 5))))


# -- balance -------------------------------------------------------------------------------------
def test_partition_minimizes_the_largest_stage():
    assert partition([1, 1, 1, 1], 2) == [2, 2]
    assert partition([4, 1, 1, 1, 1], 2) == [1, 4]
    assert partition([1, 2, 3, 4, 5, 6], 3) == [3, 2, 1]
    assert partition([5], 1) == [1]
    with pytest.raises(ValueError, match="Cannot split 2 layers into 3 stages"):
        partition([1, 1], 3)


def test_balance_by_size_and_time():
    layers = [keras.layers.Dense(w) for w in (512, 8, 8, 8, 8, 8)]
    sizes = balance_by_size(layers, 2, input_shape=(None, 64))
    assert sizes == [1, 5]  # the 33k-parameter layer alone, the small ones together
    stages = split(layers, sizes)
    assert [len(s) for s in stages] == [1, 5] and stages[0][0] is layers[0]

    heavy = [keras.layers.Dense(1024), keras.layers.Dense(1024), keras.layers.Dense(4),
             keras.layers.Dense(4)]
    times = balance_by_time(heavy, 2, tf.ones((256, 1024)), repeats=3)
    assert len(times) == 2 and sum(times) == 4 and times[0] == 1
    with pytest.raises(ValueError, match="add up to the 6 layers"):
        split(layers, [2, 2])


def test_stage_idle_fractions_from_op_intervals():
    from tfdist.tools.bench.pipeline import stage_idle_fractions

    intervals = [("stage0/F0/dense/MatMul", 0, 10), ("stage0/F1/dense/MatMul", 5, 20),
                 ("gradient_tape/stage1/F0/dense/MatMul", 20, 30), ("stage1/B0/x", 35, 40),
                 ("unrelated", 0, 1000)]
    assert stage_idle_fractions(intervals, 2) == pytest.approx([0.5, 0.625])
    with pytest.raises(RuntimeError, match="no op of some stage"):
        stage_idle_fractions(intervals[:2], 2)


def test_pipeline_from_a_sequential_model_and_split_points():
    x, y = _data()
    layers, _ = _layers(2)
    model = keras.Sequential([keras.Input((5,)), *layers])
    expected = model(x)
    sizes = balance_by_size(model.layers, 2)
    pipe = Pipeline.from_sequential(model, sizes, devices=cpu_devices(2), num_microbatches=4)
    assert [len(s) for s in pipe.stages] == sizes and pipe.stages[0][0] is model.layers[0]
    _close([pipe(x)], [expected])
    with pytest.raises(TypeError, match="takes a keras.Sequential"):
        Pipeline.from_sequential(keras.Model(model.inputs, model.outputs), sizes)


# -- data parallelism across pipelines (a device grid) -------------------------------------------
def _grid_layers():
    keras.utils.set_random_seed(3)
    return [keras.layers.Dense(16, activation="relu"), keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(12, activation="relu"), keras.layers.Dense(10)]


@pytest.mark.parametrize("kind", ["model", "layer"])
def test_two_pipelines_of_two_stages_train_like_two_replica_data_parallelism(kind, mirrored):
    """2 x 2 on 4 devices, trained with fit (a partial last batch included), ends with the
    weights of MirroredStrategy over 2 devices training the unsplit model; both copies equal."""
    rs = np.random.RandomState(0)
    x, y = rs.randn(100, 6).astype("float32"), rs.randint(0, 10, 100)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with mirrored(2).scope():
        reference = keras.Sequential([keras.Input((6,)), *_grid_layers()])
        reference.compile(keras.optimizers.Adam(1e-2), loss=loss)
    reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)

    ls = _grid_layers()
    devices = cpu_devices(4)
    pipe = Pipeline([ls[:2], ls[2:]], devices=[devices[:2], devices[2:]], num_microbatches=4,
                    schedule="1f1b")
    if kind == "model":
        model = PipelineModel(pipe, input_shape=(6,))
    else:
        model = keras.Sequential([keras.Input((6,)), pipe])
    model.compile(place_slots(keras.optimizers.Adam(1e-2)), loss=loss)
    assert pipe.num_replicas == 2 and len(pipe.trainable_variables) == 16
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    first = [v.numpy() for stage in pipe.replica_stages(0) for layer in stage
             for v in layer.trainable_variables]
    second = [v.numpy() for stage in pipe.replica_stages(1) for layer in stage
              for v in layer.trainable_variables]
    _close(first, second, atol=0)  # the copies never drift apart
    _close(first, reference.get_weights(), rtol=1e-5, atol=1e-5)
    copy = pipe.replica_stages(1)[1][0].kernel
    assert tf.DeviceSpec.from_string(copy.value.device).device_index == 3
    _close([model.predict(x, batch_size=20, verbose=0)],
           [reference.predict(x, batch_size=20, verbose=0)], rtol=1e-5, atol=1e-5)
