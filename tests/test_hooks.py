"""Every private TF/Keras hook tfdist uses still exists and still does what tfdist needs.

If one of these fails after a TensorFlow or Keras upgrade, the hook moved: fix
tfdist/optimizers/_keras_hooks.py or tfdist/strategies/_tf_hooks.py before anything else.
"""

import keras
import tensorflow as tf

from tfdist.optimizers import _keras_hooks
from tfdist.strategies import _tf_hooks, new_mirrored_strategy


def test_keras_reduces_gradients_in_the_hooked_method():
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    assert hasattr(TFOptimizer, _keras_hooks.ALL_REDUCE_HOOK)
    import inspect

    assert _keras_hooks.ALL_REDUCE_HOOK in inspect.getsource(TFOptimizer._backend_update_step)


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

    @tf.function
    def step(pred):
        def fn():
            out = tf.Variable  # noqa: F841 - placeholder to keep fn a closure
            result = []

            def true_fn():
                ctx = tf.distribute.get_replica_context()
                result.append(ctx.all_reduce("sum", tf.constant(1.0)))

            _keras_hooks.replica_cond(pred, true_fn, lambda: None)
            return tf.constant(0.0)

        return strategy.run(fn)

    step(tf.constant(True))  # would raise "merge_call called while defining a new graph"
    step(tf.constant(False))


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
