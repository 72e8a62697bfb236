"""Every private TF/Keras hook tfdist uses still exists and still does what tfdist needs.

If one of these fails after a TensorFlow or Keras upgrade, the hook moved: fix
tfdist/optimizers/_keras_hooks.py or tfdist/strategies/_tf_hooks.py before anything else.
"""

import keras
import tensorflow as tf

from tfdist.comm import control
from tfdist.optimizers import _keras_hooks
from tfdist.strategies import _tf_hooks, new_mirrored_strategy


def test_keras_reduces_gradients_in_the_hooked_method():
    import inspect

    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    assert hasattr(TFOptimizer, _keras_hooks.ALL_REDUCE_HOOK)
    original = _keras_hooks.original_update_step()
    assert original.__qualname__ == "TFOptimizer._backend_update_step"
    assert _keras_hooks.ALL_REDUCE_HOOK in inspect.getsource(original)


def test_strategy_hooks_replace_build_and_update_step_once():
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    _keras_hooks.install_strategy_hooks()
    hooked = TFOptimizer._backend_update_step
    _keras_hooks.install_strategy_hooks()  # idempotent
    assert TFOptimizer._backend_update_step is hooked
    assert hooked is not _keras_hooks.original_update_step()
    assert "build" in vars(TFOptimizer)


def test_disable_gradient_all_reduce_makes_apply_local(mirrored):
    strategy = mirrored(2)
    with strategy.scope():
        var = keras.Variable([0.0])
        opt = keras.optimizers.SGD(1.0)
        _keras_hooks.disable_gradient_all_reduce(opt)
        opt.build([var])

    @tf.function
    def step():
        strategy.run(lambda: opt.apply([tf.constant([1.0])], [var]))

    step()
    # Without the hook the two replicas' gradients would be summed (-2).
    assert [float(v.numpy()[0]) for v in strategy.experimental_local_results(var.value)] \
        == [-1.0, -1.0]


def test_replica_cond_runs_collectives_in_a_branch(mirrored):
    strategy = mirrored(2)
    with strategy.scope():
        total = tf.Variable(0.0, aggregation=tf.VariableAggregation.NONE)

    @tf.function
    def step(pred):
        def fn():
            rid = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)

            def add_sum(x):  # an all-reduce (merge_call) inside the branch
                s = tf.distribute.get_replica_context().all_reduce("sum", x)
                total.assign_add(s + x)  # x: this replica's own value

            control.replica_cond(pred, add_sum, lambda x: None, args=[rid + 1.0])

        strategy.run(fn)

    step(tf.constant(True))  # plain tf.cond raises "merge_call called while defining a new graph"
    step(tf.constant(False))
    step(tf.constant(True))
    # Each taken step adds (1 + 2) + own value: replica 0 gets 2 x 4, replica 1 gets 2 x 5.
    assert [float(v.numpy()) for v in strategy.experimental_local_results(total)] == [8.0, 10.0]


def test_collective_key_base_hook_lets_strategies_coexist():
    assert hasattr(tf.distribute.MirroredStrategy, _tf_hooks.KEY_BASE_ATTRIBUTE)
    results = []
    for dtype in (tf.float32, tf.int64):
        s = new_mirrored_strategy(["/cpu:0", "/cpu:1"])

        @tf.function
        def gather(s=s, dtype=dtype):
            return s.run(lambda: tf.distribute.get_replica_context().all_gather(
                tf.ones([1], dtype), axis=0))

        results.append(s.experimental_local_results(gather())[0].numpy().tolist())
    assert results == [[1.0, 1.0], [1, 1]]


def test_checkpoint_hooks_hide_objects_and_compute_an_entry(tmp_path):
    """tf.train.Checkpoint asks `_trackable_children` for what to write and round-trips a
    Trackable's `_serialize_to_tensors` / `_restore_from_tensors` (ZeroOptimizer's entry)."""
    module = tf.Module()
    module.kept, module.hidden = tf.Variable(1.0), tf.Variable([2.0, 3.0])
    module.items = [module.kept, module.hidden]
    _tf_hooks.hide_from_checkpoints(module, lambda: [module.hidden])
    restored = {}
    module.entry = _tf_hooks.ComputedCheckpointEntry(lambda: {"whole": [4.0, 5.0, 6.0]},
                                                     restored.update)
    path = tf.train.Checkpoint(m=module).save(str(tmp_path / "c"))
    names = dict(tf.train.list_variables(path))
    assert names["m/entry/.ATTRIBUTES/whole"] == [3]
    assert not any(shape == [2] for shape in names.values())  # hidden: not written
    module.kept.assign(0.0)
    tf.train.Checkpoint(m=module).restore(path).assert_existing_objects_matched()
    assert float(module.kept.numpy()) == 1.0
    assert restored["whole"].tolist() == [4.0, 5.0, 6.0]


def test_executed_devices_reports_the_device_each_node_ran_on():
    def f(x):
        with tf.device("/cpu:0"):
            a = tf.matmul(x, x, name="on_zero")
        with tf.device("/cpu:1"):
            return tf.matmul(a, x, name="on_one")

    x = tf.ones((4, 4))
    placed = _tf_hooks.executed_devices(f, x)
    assert placed["on_zero"][0].endswith("CPU:0")
    assert placed["on_one"][0].endswith("CPU:1")
    assert "MatMul" in placed["on_one"][1]


def test_profile_op_intervals_times_each_executed_node(tmp_path):
    x = tf.ones((256, 256))

    @tf.function
    def f():
        a = tf.matmul(x, x, name="first")
        return tf.matmul(a, x, name="second")

    f()
    intervals = {name: (start, end) for name, start, end in
                 _tf_hooks.profile_op_intervals(f, str(tmp_path))}
    assert intervals["first"][1] > intervals["first"][0]
    assert intervals["second"][0] >= intervals["first"][1]  # the second waits for the first
