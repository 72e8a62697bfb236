"""Tensor-parallel layers equal the unsplit Keras layers: outputs, gradients, training with fit,
saving; each block's kernels placed and differentiated on its own device."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.workers.common import cpu_devices
from tfdist._hooks.profiler import executed_devices
from tfdist.tensor_parallel import (
    ColumnParallelDense,
    ParallelBranches,
    ParallelConv2D,
    ParallelMultiHeadAttention,
    ParallelTransformerBlock,
    RowParallelDense,
    transformer_block,
)


def _close(a, b):
    """rtol 1e-5; atol 1e-6 of the tensor's scale (float32 sums in another order)."""
    for u, v in zip(a, b, strict=True):
        v = np.asarray(v)
        scale = max(1.0, float(np.max(np.abs(v)))) if v.size else 1.0
        np.testing.assert_allclose(np.asarray(u), v, rtol=1e-5, atol=1e-6 * scale)


def _random(*shape, seed=1):
    return tf.constant(np.random.RandomState(seed).randn(*shape).astype("float32"))


def _run(model, *inputs, **kwargs):
    """Output, gradients by variable path, and input gradients of sum(output**2)."""
    with tf.GradientTape() as tape:
        tape.watch(inputs)
        out = model(inputs if len(inputs) > 1 else inputs[0], **kwargs)
        loss = tf.reduce_sum(out ** 2)
    variables = model.trainable_variables
    grads = tape.gradient(loss, [*variables, *inputs])
    return out, dict(zip([v.path for v in variables], grads)), grads[len(variables):]


def _devices_of(variables):
    return [v.value.device[-5:] for v in variables]


# -- Dense --------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 4])
def test_column_and_row_parallel_dense_equal_dense(n):
    x = _random(6, 8)
    keras.utils.set_random_seed(4)
    dense1, dense2 = keras.layers.Dense(12, activation="relu"), keras.layers.Dense(8)
    ref = keras.Sequential([keras.Input((8,)), dense1, dense2])
    devices = cpu_devices(n)
    column = ColumnParallelDense(12, devices, activation="relu")
    row = RowParallelDense(8, devices)
    megatron_col = ColumnParallelDense(12, devices, activation="relu", gather_output=False)
    megatron_row = RowParallelDense(8, devices, input_is_parallel=True)
    inputs = keras.Input((8,))
    tp = keras.Model(inputs, row(column(inputs)))
    meg = keras.Model(inputs, megatron_row(megatron_col(inputs)))
    column.load_from(dense1)
    row.load_from(dense2)
    megatron_col.load_from(dense1)
    megatron_row.load_from(dense2)

    ref_out, ref_grads, (ref_dx,) = _run(ref, x)
    k1, b1, k2, b2 = (ref_grads[v.path] for v in ref.trainable_variables)
    for model, c, r in ((tp, column, row), (meg, megatron_col, megatron_row)):
        out, grads, (dx,) = _run(model, x)
        _close([out, dx], [ref_out, ref_dx])
        _close([tf.concat([grads[v.path] for v in c.kernels], axis=1)], [k1])
        _close([tf.concat([grads[v.path] for v in c.biases], axis=0)], [b1])
        _close([tf.concat([grads[v.path] for v in r.kernels], axis=0)], [k2])
        _close([grads[r.bias.path]], [b2])
        assert _devices_of(c.kernels) == [f"CPU:{d}" for d in range(n)]


def test_tensor_parallel_backward_runs_on_each_block_device():
    column = ColumnParallelDense(8, cpu_devices(2))
    x = tf.ones((4, 6))
    column.build((4, 6))

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(column(x))
        return tape.gradient(loss, column.trainable_variables)

    placed = executed_devices(step)
    # This layer's nodes only: the run metadata also lists any other function instantiated
    # meanwhile (a model another test of this process left behind was seen once).
    grad_matmuls = [(n, d) for n, (d, op) in placed.items()
                    if "MatMul" in op and n.startswith(f"gradient_tape/{column.name}")]
    assert {d[-5:] for _, d in grad_matmuls} == {"CPU:0", "CPU:1"}, grad_matmuls


# -- Conv2D -------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("split", ["output", "input"])
def test_parallel_conv2d_equals_conv2d(n, split):
    x = _random(2, 9, 9, 8)
    keras.utils.set_random_seed(5)
    conv = keras.layers.Conv2D(12, 3, strides=2, padding="same", activation="relu")
    ref = keras.Sequential([keras.Input((9, 9, 8)), conv])
    layer = ParallelConv2D(12, 3, strides=2, padding="same", activation="relu",
                           devices=cpu_devices(n), split=split)
    tp = keras.Sequential([keras.Input((9, 9, 8)), layer])
    layer.load_from(conv)
    assert tp.output_shape == ref.output_shape == (None, 5, 5, 12)

    ref_out, ref_grads, (ref_dx,) = _run(ref, x)
    out, grads, (dx,) = _run(tp, x)
    _close([out, dx], [ref_out, ref_dx])
    axis = 3 if split == "output" else 2
    _close([tf.concat([grads[v.path] for v in layer.kernels], axis=axis),
            tf.concat([grads[v.path] for v in layer.biases], axis=0)],
           [ref_grads[conv.kernel.path], ref_grads[conv.bias.path]])
    assert _devices_of(layer.kernels) == [f"CPU:{d}" for d in range(n)]


@pytest.mark.parametrize("n", [2, 4])
def test_megatron_style_conv_pair_trains_like_two_conv2d_with_fit(n):
    """Filters split, then input channels split, blocks handed on unconcatenated: fit gives the
    unsplit model's weights."""
    keras.utils.set_random_seed(6)
    conv1 = keras.layers.Conv2D(8, 3, padding="same", activation="relu")
    conv2 = keras.layers.Conv2D(4, 3)
    head = keras.layers.Dense(3)

    def model(first, second, head):
        inputs = keras.Input((8, 8, 2))
        h = second(first(inputs))
        return keras.Model(inputs, head(keras.layers.GlobalAveragePooling2D()(h)))

    ref = model(conv1, conv2, head)
    devices = cpu_devices(n)
    first = ParallelConv2D(8, 3, padding="same", activation="relu", devices=devices,
                           gather_output=False)
    second = ParallelConv2D(4, 3, devices=devices, split="input", input_is_parallel=True)
    tp_head = keras.layers.Dense(3)
    tp = model(first, second, tp_head)
    first.load_from(conv1)
    second.load_from(conv2)
    tp_head.set_weights(head.get_weights())

    x = np.random.RandomState(2).randn(32, 8, 8, 2).astype("float32")
    y = np.random.RandomState(3).randint(0, 3, 32)
    for m in (ref, tp):
        m.compile(keras.optimizers.SGD(0.1, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        m.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    _close([tf.concat([k.value for k in first.kernels], axis=3),
            tf.concat([k.value for k in second.kernels], axis=2), second.biases[0].value],
           [conv1.kernel.value, conv2.kernel.value, conv2.bias.value])
    _close([tp.predict(x, verbose=0)], [ref.predict(x, verbose=0)])


# -- attention ----------------------------------------------------------------------------------
def _heads_grads(layer, grads, name):
    """The full (unsplit) gradient of one projection, from the per-device blocks."""
    blocks = [grads[block[name].path] for block in layer.blocks]
    return tf.concat(blocks, axis=0 if name == "output_kernel" else 1 if "kernel" in name else 0)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("mask", ["none", "causal", "padding+causal"])
def test_parallel_multi_head_attention_equals_keras(n, mask):
    query, value = _random(3, 5, 8, seed=1), _random(3, 5, 6, seed=2)
    padding = None
    if mask == "padding+causal":
        padding = tf.constant(np.random.RandomState(3).rand(3, 5, 5) > 0.3)
    causal = mask != "none"
    keras.utils.set_random_seed(7)
    mha = keras.layers.MultiHeadAttention(4, 3, value_dim=5)
    parallel = ParallelMultiHeadAttention(4, 3, value_dim=5, devices=cpu_devices(n))

    def wrap(layer):
        q_in, v_in = keras.Input((5, 8)), keras.Input((5, 6))
        return keras.Model([q_in, v_in], layer(q_in, v_in, attention_mask=padding,
                                                  use_causal_mask=causal))

    ref, tp = wrap(mha), wrap(parallel)
    parallel.load_from(mha)
    ref_out, ref_grads, ref_dx = _run(ref, query, value)
    out, grads, dx = _run(tp, query, value)
    _close([out, *dx], [ref_out, *ref_dx])
    for name, dense in (("query", mha.query_dense), ("key", mha.key_dense),
                        ("value", mha.value_dense), ("output", mha.output_dense)):
        _close([_heads_grads(parallel, grads, f"{name}_kernel")],
               [ref_grads[dense.kernel.path]])
        if name != "output":
            _close([_heads_grads(parallel, grads, f"{name}_bias")], [ref_grads[dense.bias.path]])
    _close([grads[parallel.output_bias.path]], [ref_grads[mha.output_dense.bias.path]])
    assert _devices_of([b["query_kernel"] for b in parallel.blocks]) == [
        f"CPU:{d}" for d in range(n)]


def test_attention_backward_runs_on_each_heads_device():
    parallel = ParallelMultiHeadAttention(2, 4, devices=cpu_devices(2))
    x = tf.ones((2, 3, 8))
    parallel(x, x)

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(parallel(x, x))
        return tape.gradient(loss, parallel.trainable_variables)

    placed = executed_devices(step)
    grads = {d[-5:] for n, (d, op) in placed.items() if "gradient" in n.lower()
             and ("Einsum" in op or "MatMul" in op)}
    assert grads == {"CPU:0", "CPU:1"}, placed


# -- Transformer block --------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 4])
def test_parallel_transformer_block_equals_the_plain_block(n):
    x = _random(2, 6, 16)
    keras.utils.set_random_seed(8)
    plain = transformer_block((6, 16), num_heads=4, key_dim=4, ff_dim=32, causal=True)
    block = ParallelTransformerBlock(4, 4, 32, causal=True, devices=cpu_devices(n))
    inputs = keras.Input((6, 16))
    tp = keras.Model(inputs, block(inputs))
    block.load_from(plain)

    ref_out, ref_grads, (ref_dx,) = _run(plain, x)
    out, grads, (dx,) = _run(tp, x)
    _close([out, dx], [ref_out, ref_dx])
    for norm in ("attention_norm", "mlp_norm"):
        ours, theirs = getattr(block, norm), plain.get_layer(norm)
        _close([grads[v.path] for v in ours.trainable_variables],
               [ref_grads[v.path] for v in theirs.trainable_variables])
    mha = plain.get_layer("attention")
    _close([_heads_grads(block.attention, grads, "query_kernel"),
            _heads_grads(block.attention, grads, "output_kernel")],
           [ref_grads[mha.query_dense.kernel.path], ref_grads[mha.output_dense.kernel.path]])
    _close([tf.concat([grads[v.path] for v in block.mlp_in.kernels], axis=1),
            tf.concat([grads[v.path] for v in block.mlp_out.kernels], axis=0),
            grads[block.mlp_out.bias.path]],
           [ref_grads[plain.get_layer("mlp_in").kernel.path],
            ref_grads[plain.get_layer("mlp_out").kernel.path],
            ref_grads[plain.get_layer("mlp_out").bias.path]])


# -- parallel branches --------------------------------------------------------------------------
def _inception_branches():
    return [
        keras.layers.Conv2D(4, 1, activation="relu", name="b1x1"),
        keras.Sequential([keras.layers.Conv2D(3, 1, activation="relu"),
                          keras.layers.Conv2D(5, 3, padding="same")], name="b3x3"),
        keras.Sequential([keras.layers.MaxPooling2D(3, 1, padding="same"),
                          keras.layers.Conv2D(2, 1)], name="bpool"),
        keras.Sequential([keras.layers.Conv2D(3, 1), keras.layers.BatchNormalization()],
                         name="bnorm"),
    ]


@pytest.mark.parametrize("n", [2, 4])
def test_parallel_branches_equal_the_functional_inception_block(n):
    x = _random(4, 6, 6, 3)
    keras.utils.set_random_seed(9)
    inputs = keras.Input((6, 6, 3))
    plain_branches = _inception_branches()
    ref = keras.Model(inputs, keras.layers.Concatenate()([b(inputs) for b in plain_branches]))
    branches = ParallelBranches(_inception_branches(), devices=cpu_devices(n))
    tp = keras.Model(inputs, branches(inputs))
    branches.load_from(plain_branches)
    assert tp.output_shape == ref.output_shape == (None, 6, 6, 14)

    ref_out, ref_grads, (ref_dx,) = _run(ref, x, training=True)
    out, grads, (dx,) = _run(tp, x, training=True)
    _close([out, dx], [ref_out, ref_dx])
    _close([grads[v.path] for v in tp.trainable_variables],
           [ref_grads[v.path] for v in ref.trainable_variables])
    # BatchNormalization's moving statistics moved the same way inside the placed branch.
    _close([v.value for v in tp.non_trainable_variables],
           [v.value for v in ref.non_trainable_variables])
    for i, branch in enumerate(branches.branches):
        assert {v.value.device[-5:] for v in branch.variables} == {f"CPU:{i % n}"}


def test_parallel_branches_backward_runs_on_each_branch_device():
    branches = ParallelBranches([keras.layers.Dense(4), keras.layers.Dense(4)],
                                devices=cpu_devices(2))
    x = tf.ones((2, 3))
    branches(x)

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(branches(x))
        return tape.gradient(loss, branches.trainable_variables)

    placed = executed_devices(step)
    grads = {d[-5:] for n, (d, op) in placed.items() if "gradient" in n.lower()
             and "MatMul" in op}
    assert grads == {"CPU:0", "CPU:1"}, placed


# -- saving -------------------------------------------------------------------------------------
def test_tensor_parallel_layers_save_and_load(tmp_path):
    devices = cpu_devices(2)
    inputs = keras.Input((6, 6, 4))
    h = ParallelConv2D(8, 3, padding="same", devices=devices, gather_output=False)(inputs)
    h = ParallelConv2D(4, 1, devices=devices, split="input", input_is_parallel=True)(h)
    h = ParallelBranches([keras.layers.Conv2D(2, 1), keras.layers.Conv2D(2, 3, padding="same")],
                         devices=devices)(h)
    h = keras.layers.Reshape((36, 4))(h)
    h = ParallelMultiHeadAttention(2, 4, devices=devices)(h, h)
    h = ParallelTransformerBlock(2, 2, 8, devices=devices)(h)
    outputs = RowParallelDense(3, devices)(ColumnParallelDense(4, devices)(h))
    model = keras.Model(inputs, outputs)
    x = _random(2, 6, 6, 4)
    path = tmp_path / "tp.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    _close([loaded(x)], [model(x)])
    assert [type(layer).__name__ for layer in loaded.layers] == [
        type(layer).__name__ for layer in model.layers]
    block = next(layer for layer in loaded.layers if isinstance(layer, ParallelConv2D))
    assert _devices_of(block.kernels) == ["CPU:0", "CPU:1"]


# -- bad input ----------------------------------------------------------------------------------
def test_tensor_parallel_bad_input():
    four = cpu_devices(4)
    for build, named in ((lambda: ColumnParallelDense(0, four), "units=0"),
                         (lambda: ParallelConv2D(True, 3, devices=four), "filters=True"),
                         (lambda: ParallelMultiHeadAttention(4, 0, devices=four), "key_dim=0")):
        with pytest.raises(ValueError, match=f"must be an integer >= 1. Received: {named}"):
            build()
    with pytest.raises(ValueError, match=r"units=10 is not divisible by the 4 devices"):
        ColumnParallelDense(10, four)
    with pytest.raises(ValueError, match=r"input features=6 is not divisible by the 4 devices"):
        RowParallelDense(3, four).build((2, 6))
    with pytest.raises(ValueError, match=r"filters=6 is not divisible by the 4 devices.*"
                                         r"multiple of 4, or split='input'"):
        ParallelConv2D(6, 3, devices=four)
    with pytest.raises(ValueError, match=r"input channels=6 are not divisible by the 4"):
        ParallelConv2D(8, 3, devices=four, split="input").build((None, 5, 5, 6))
    with pytest.raises(ValueError, match=r"split='rows' is not one of"):
        ParallelConv2D(8, 3, devices=four, split="rows")
    with pytest.raises(ValueError, match=r"num_heads=6 is not divisible by the 4 devices.*"
                                         r"multiple of 4 heads"):
        ParallelMultiHeadAttention(6, 8, devices=four)
    with pytest.raises(ValueError, match=r"load_from takes a keras.layers.MultiHeadAttention"):
        ParallelMultiHeadAttention(4, 8, devices=four).load_from(keras.layers.Dense(3))
    conv = ParallelConv2D(8, 3, devices=four)
    conv.build((None, 5, 5, 2))
    with pytest.raises(ValueError, match=r"kernel has shape \(3, 3, 3, 8\), this layer's "
                                         r"blocks make \(3, 3, 2, 8\)"):
        other = keras.layers.Conv2D(8, 3)
        other.build((None, 5, 5, 3))
        conv.load_from(other)
    with pytest.raises(ValueError, match=r"ColumnParallelDense device '/gpu:7' does not exist"):
        ColumnParallelDense(8, ["/gpu:7", "/gpu:9"])  # TensorFlow would use CPU:0 for both
    with pytest.raises(TypeError, match=r"ParallelMultiHeadAttention\(devices='/cpu:0'\): give "
                                        r"a list of device names"):
        ParallelMultiHeadAttention(4, 8, devices="/cpu:0")
    with pytest.raises(ValueError, match=r"load_from got 1 layers for 2 branches"):
        ParallelBranches([keras.layers.Dense(2), keras.layers.Dense(2)],
                         devices=four).load_from(
            [keras.layers.Dense(2)])


def test_a_wrong_bias_flag_or_device_list_is_refused_naming_it():
    """use_bias takes True or False (not a truthy string); devices is None (this process' first
    devices) or a non-empty list of distinct devices: [] and one device given twice would put
    every shard on one device without a word."""
    with pytest.raises(ValueError, match="use_bias.*Received: use_bias='no'"):
        ColumnParallelDense(8, use_bias="no")
    with pytest.raises(ValueError, match=r"devices=\[\]\): give a non-empty list"):
        ColumnParallelDense(8, devices=[])
    with pytest.raises(ValueError, match="'/cpu:0' is given more than once"):
        RowParallelDense(8, devices=["/cpu:0", "/CPU:0"])
    layer = ColumnParallelDense(8, use_bias=False)
    assert layer.use_bias is False and len(layer.devices) == 2
