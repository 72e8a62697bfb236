"""Every private TF/Keras hook tfdist uses still exists and still does what tfdist needs.

If one of these fails after a TensorFlow or Keras upgrade, the hook moved: fix the module of
tfdist/_hooks/ it names before anything else.
"""

import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import ROOT, worker_env
from tfdist._hooks import checkpoint as checkpoint_hooks
from tfdist._hooks import distribute as distribute_hooks
from tfdist._hooks import graphs as graph_hooks
from tfdist._hooks import optimizer as _keras_hooks
from tfdist._hooks import profiler as profiler_hooks
from tfdist._hooks import training as training_hooks
from tfdist._hooks import variables as variable_hooks
from tfdist.comm import DistributeEngine


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


def test_engine_cond_runs_collectives_in_a_branch(mirrored):
    strategy = mirrored(2)
    comm = DistributeEngine(strategy).communicator()
    assert distribute_hooks.uses_merge_call.__name__ == "uses_merge_call"
    with strategy.scope():
        total = tf.Variable(0.0, aggregation=tf.VariableAggregation.NONE)
        assert distribute_hooks.uses_merge_call()  # MirroredStrategy reduces in merge_call

    @tf.function
    def step(pred):
        def fn():
            rid = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)

            def add_sum(x):  # an all-reduce (merge_call) inside the branch
                s = tf.distribute.get_replica_context().all_reduce("sum", x)
                total.assign_add(s + x)  # x: this replica's own value

            comm.cond(pred, add_sum, lambda x: None, args=[rid + 1.0])

        strategy.run(fn)

    step(tf.constant(True))  # plain tf.cond raises "merge_call called while defining a new graph"
    step(tf.constant(False))
    step(tf.constant(True))
    # Each taken step adds (1 + 2) + own value: replica 0 gets 2 x 4, replica 1 gets 2 x 5.
    assert [float(v.numpy()) for v in strategy.experimental_local_results(total)] == [8.0, 10.0]


def test_every_mirrored_strategy_gets_collective_keys_of_its_own():
    """Two plain tf.distribute.MirroredStrategy objects in one process (after `import tfdist`):
    a float all-reduce on the first, then an int64 gather on the second. Without fresh keys TF
    aborts: "Collective instance 100 expected type 0 and data_type 1 but got type 2"."""
    distribute_hooks.fresh_collective_keys()  # idempotent; tfdist's import installed it
    assert isinstance(vars(tf.distribute.MirroredStrategy)[distribute_hooks.KEY_BASE_ATTRIBUTE],
                      distribute_hooks._FreshKeyBase)
    first = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    second = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert first.extended._collective_key_base != second.extended._collective_key_base

    @tf.function
    def reduce():
        return first.run(lambda: tf.distribute.get_replica_context().all_reduce(
            "sum", tf.ones([1], tf.float32)))

    @tf.function
    def gather():
        return second.run(lambda: tf.distribute.get_replica_context().all_gather(
            tf.ones([1], tf.int64), axis=0))

    assert first.experimental_local_results(reduce())[0].numpy().tolist() == [2.0]
    assert second.experimental_local_results(gather())[0].numpy().tolist() == [1, 1]


_IMPORT_ONLY = """
import atexit, os, sys
import keras, tensorflow as tf
from tfdist._hooks.distribute import KEY_BASE_ATTRIBUTE, _FreshKeyBase

def state():
    optimizer_classes = [c for c in keras.optimizers.Optimizer.__mro__ if c is not object]
    return (atexit._ncallbacks(), list(sys.meta_path), dict(os.environ),
            [(s.st_dev, s.st_ino) for s in map(os.fstat, (0, 1, 2))],
            dict(vars(tf.distribute.MirroredStrategy)),
            [dict(vars(c)) for c in optimizer_classes])

before = state()
import tfdist
after = state()
names = ("atexit handlers", "sys.meta_path", "os.environ", "file descriptors 0-2",
         "MirroredStrategy", "Keras' optimizer classes")
changed = [name for name, a, b in zip(names, before, after) if a != b]
print("unchanged" if not changed else "changed: " + ", ".join(changed))
strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
tfdist.comm.ReplicaCommunicator(strategy)
installed = isinstance(vars(tf.distribute.MirroredStrategy)[KEY_BASE_ATTRIBUTE], _FreshKeyBase)
print("installed at first use" if installed else "not installed")
"""


def test_importing_tfdist_changes_nothing_of_the_process_and_hooks_apply_on_first_use():
    """In a fresh process that has imported TensorFlow and Keras, `import tfdist` leaves the
    exit handlers (their count), sys.meta_path, os.environ, file descriptors 0-2 and the
    attributes of MirroredStrategy and of Keras' optimizer classes as they were; the
    collective-key hook is installed when tfdist first builds a communicator on a strategy."""
    done = subprocess.run([sys.executable, "-c", _IMPORT_ONLY], cwd=ROOT, env=worker_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines() == ["unchanged", "installed at first use"], \
        done.stdout + done.stderr[-2000:]


def test_checkpoint_hooks_hide_objects_and_compute_an_entry(tmp_path):
    """tf.train.Checkpoint asks `_trackable_children` for what to write and round-trips a
    Trackable's `_serialize_to_tensors` / `_restore_from_tensors` (ZeroOptimizer's entry)."""
    module = tf.Module()
    module.kept, module.hidden = tf.Variable(1.0), tf.Variable([2.0, 3.0])
    module.items = [module.kept, module.hidden]
    checkpoint_hooks.hide_from_checkpoints(module, lambda: [module.hidden])
    restored = {}
    module.entry = checkpoint_hooks.ComputedCheckpointEntry(lambda: {"whole": [4.0, 5.0, 6.0]},
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
    placed = profiler_hooks.executed_devices(f, x)
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
                 profiler_hooks.profile_op_intervals(f, str(tmp_path))}
    assert intervals["first"][1] > intervals["first"][0]
    assert intervals["second"][0] >= intervals["first"][1]  # the second waits for the first
    # the same trace with op types; only op kernels (no executor or eager events)
    types = {name: op for name, op, _, _ in profiler_hooks.op_events(str(tmp_path))}
    assert types["first"] == types["second"] and "MatMul" in types["first"]
    assert all(op.isidentifier() for op in types.values())


HOROVOD_TRACE = """
import sys, time
import horovod.tensorflow as hvd
import tensorflow as tf
from tfdist._hooks.profiler import op_events

hvd.init()  # one rank: the op still runs through Horovod's background thread
x = tf.ones([512, 512])


@tf.function
def step():
    y = tf.identity(x)
    return hvd.grouped_allreduce([y * 2.0, y], op=hvd.Sum)


step()
tf.profiler.experimental.start(sys.argv[1])
step()
time.sleep(0.05)  # the done callback's event closes after the function returns
tf.profiler.experimental.stop()
for node, op, start, end in op_events(sys.argv[1]):
    print(op, end - start)
"""


def test_an_asynchronous_kernel_without_its_own_event_spans_from_start_to_done(tmp_path):
    """Horovod's ops record no kernel event of their own: op_events pairs the executor's
    ProcessAsync Start and Done events (node and op type from their stats) into one interval."""
    import subprocess
    import sys

    from tests.conftest import worker_env

    out = subprocess.run([sys.executable, "-c", HOROVOD_TRACE, str(tmp_path)],
                         capture_output=True, text=True, env=worker_env(), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    events = dict(line.split() for line in out.stdout.splitlines())
    assert int(events["HorovodGroupedAllreduce"]) > 0 and "Mul" in events, out.stdout


def test_variable_index_is_keras_own_lookup_and_apply_counter_is_the_wrappers():
    variables = [keras.Variable([1.0]), keras.Variable([2.0, 3.0])]
    opt = keras.optimizers.SGD()
    opt.build(variables)
    assert [_keras_hooks.variable_index(opt, v) for v in variables] == [0, 1]
    wrapper = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    wrapper.build(variables)
    _keras_hooks.count_apply(wrapper)
    assert int(wrapper._iterations.numpy()) == 1 and int(wrapper.iterations.numpy()) == 0


def test_instance_patches_bypass_keras_tracking_and_place_slots():
    opt = keras.optimizers.Adam()
    _keras_hooks.replace_method(opt, "_tfdist_flag", [keras.Variable(1.0)])
    assert opt._tfdist_flag and not any(v is opt._tfdist_flag[0] for v in opt.variables)
    with tf.device("/cpu:1"):
        var = keras.Variable(tf.zeros([2]))
    _keras_hooks.place_on_variable_devices(opt)
    opt.build([var])
    slots = [v for v in opt.variables if tuple(v.shape) == (2,)]
    assert slots and all(v.value.device.endswith("CPU:1") for v in slots)


@pytest.mark.parametrize("weight_decay", [None, 0.1])
def test_updates_and_weight_decay_run_on_the_variables_devices(weight_decay):
    from tfdist._hooks.profiler import executed_devices

    with tf.device("/cpu:2"):
        var = keras.Variable(tf.ones([64, 64]))
    opt = keras.optimizers.AdamW(0.1, weight_decay=weight_decay) if weight_decay else \
        keras.optimizers.Adam(0.1)
    _keras_hooks.place_on_variable_devices(opt)
    opt.build([var])
    with tf.device("/cpu:0"):
        grad = tf.ones([64, 64])
    placed = executed_devices(lambda: opt.apply([grad], [var]))
    big = {name: device for name, (device, op) in placed.items()  # the update's arithmetic
           if name.startswith(f"{opt.name}/") and op in ("Mul", "Sub", "AddV2", "Sqrt",
                                                          "RealDiv", "Square", "IdentityN")}
    assert not any(op == "IdentityN" for _, op in placed.values())  # no one-replica all-reduce
    assert big and all(d.endswith("CPU:2") for d in big.values()), big
    expected = 1 - 0.1 * 0.1 if weight_decay else 1.0  # decay, then Adam's first step: -lr
    np.testing.assert_allclose(var.numpy(), expected - 0.1, rtol=1e-5)


def test_set_initial_epoch_makes_fit_start_there():
    x = tf.zeros([8, 3])
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    epochs = []

    class Start(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            training_hooks.set_initial_epoch(self.model, 2)

        def on_epoch_begin(self, epoch, logs=None):
            epochs.append(epoch)

    model.fit(x, tf.zeros([8, 1]), epochs=4, verbose=0, callbacks=[Start()])
    assert epochs == [2, 3]
    training_hooks.set_initial_epoch(model, None)
    epochs.clear()
    model.fit(x, tf.zeros([8, 1]), epochs=2, verbose=0,
              callbacks=[keras.callbacks.LambdaCallback(
                  on_epoch_begin=lambda epoch, logs: epochs.append(epoch))])
    assert epochs == [0, 1]


def test_local_step_logs_skip_the_per_step_average_and_keep_the_epoch_logs(mirrored):
    """Keras reduces each step's logs with `reduce_per_replica(..., "auto")` (a collective per
    value across workers); with `step_logs = "local"` a step's logs are replica 0's own, and
    the epoch's logs, read from the metrics' variables, are the same as Keras' own."""
    training_hooks.keep_step_logs_local()
    training_hooks.keep_step_logs_local()  # idempotent: wraps Keras' function once
    from keras.src.backend.tensorflow import trainer

    assert trainer.reduce_per_replica.tfdist_local_step_logs
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 4)), rng.normal(size=(64, 1))
    runs = {}
    for mode in ("averaged", "local"):
        strategy = mirrored(2)
        strategy.step_logs = mode
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
        steps: list[float] = []
        record = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda b, logs, steps=steps: steps.append(logs["loss"]))
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                            callbacks=[record])
        runs[mode] = steps, history.history, model.get_weights()
    (avg_steps, avg_epochs, avg_w), (own_steps, own_epochs, own_w) = (runs["averaged"],
                                                                      runs["local"])
    assert not np.allclose(avg_steps, own_steps)  # replica 0's own loss, not the mean
    assert own_epochs.keys() == avg_epochs.keys()
    for key in avg_epochs:
        np.testing.assert_allclose(own_epochs[key], avg_epochs[key], rtol=1e-6)
    for a, b in zip(avg_w, own_w):
        np.testing.assert_allclose(a, b, rtol=1e-6)  # training itself unchanged


def test_central_variable_unwraps_a_central_storage_variable():
    from tests.workers.common import cpu_devices

    strategy = tf.distribute.experimental.CentralStorageStrategy(cpu_devices(2), "/cpu:0")
    with strategy.scope():
        variable = keras.Variable([1.0, 2.0])
    assert type(variable.value).__name__ == "AggregatingVariable"
    inner = distribute_hooks.central_variable(variable)
    assert type(inner).__name__ != "AggregatingVariable" and isinstance(inner, tf.Variable)
    inner.assign_sub([1.0, 1.0])  # the one copy: the wrapper reads it
    assert variable.numpy().tolist() == [0.0, 1.0]
    plain = tf.Variable(1.0)
    assert distribute_hooks.central_variable(plain) is plain


def test_released_variables_read_through_a_stateless_scope_or_their_initializer():
    """ZeRO stage 3: a Keras variable without `_value` reads its `_initializer` outside a
    StatelessScope and the mapped value inside; its layer's own variables and the model's
    nested layers come from `_trainable_variables` and `_flatten_layers`; Keras' symbolic
    shape inference runs in a SymbolicScope."""
    inner = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="d")], name="inner")
    model = keras.Sequential([keras.Input((3,)), inner, keras.layers.Dense(1, name="e")])
    names = [layer.name for layer in variable_hooks.nested_layers(model)]
    assert [n for n in names if not n.startswith("input_layer")] == ["inner", "d", "e"]
    dense = model.get_layer("inner").get_layer("d")
    assert variable_hooks.own_trainable_variables(dense) == [dense.kernel, dense.bias]
    assert variable_hooks.own_trainable_variables(inner) == []
    kernel = dense.kernel
    variable_hooks.release_storage(kernel, lambda shape, dtype=None: tf.fill(shape, 5.0))
    assert not variable_hooks.holds_storage(kernel)
    assert float(tf.reduce_max(tf.convert_to_tensor(kernel))) == 5.0
    with keras.StatelessScope([(kernel, tf.ones((3, 2)))]):
        assert float(tf.reduce_sum(dense(tf.ones((1, 3))))) == 6.0
    seen = []

    class Probe(keras.layers.Layer):
        def call(self, x):
            seen.append(variable_hooks.in_shape_inference())
            return x

    keras.Sequential([keras.Input((3,)), Probe()])
    Probe()(tf.ones((1, 3)))
    assert seen == [True, False]

    captured = []

    class Capture(keras.layers.Layer):  # keeps the autocast scope its call ran in
        def build(self, shape):
            self.w = self.add_weight(shape=(1,), initializer="ones")

        def call(self, x):
            captured.append(variable_hooks.current_autocast())
            return x

    layer = Capture(dtype="mixed_bfloat16")
    layer(tf.ones((1, 3)))
    assert tf.convert_to_tensor(layer.w).dtype == tf.float32  # outside the layer's call
    with captured[0]:
        assert tf.convert_to_tensor(layer.w).dtype == tf.bfloat16
        assert variable_hooks.read_uncast(layer.w).dtype == tf.float32


def test_custom_gradients_traced_in_the_block_are_released_with_their_graph():
    import gc
    import weakref

    @tf.custom_gradient
    def double(x):
        return 2 * x, lambda dy: 2 * dy

    graphs = []

    def step(x):
        graphs.append(weakref.ref(tf.compat.v1.get_default_graph()))  # the traced FuncGraph
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = double(x)
        return tape.gradient(y, x)

    names = set(graph_hooks._registry())
    assert float(tf.function(step)(tf.constant(1.0))) == 2.0
    gc.collect()
    assert graphs[0]() is not None  # TensorFlow keeps a traced custom gradient's graph for good
    with graph_hooks.custom_gradients_released():
        assert float(tf.function(step)(tf.constant(1.0))) == 2.0
        assert len(set(graph_hooks._registry()) - names) == 2
    gc.collect()
    assert len(set(graph_hooks._registry()) - names) == 1
    assert graphs[1]() is None


_KV_WORKER = """
import json, os, sys, time
sys.path.insert(0, os.environ["PYTHONPATH"])
import tfdist
from tfdist.comm import DistributeEngine

strategy = tfdist.MultiWorkerMirroredStrategy(timeout_seconds=120, heartbeat_seconds=45)
from tfdist._hooks.coordination import heartbeat_ms
print("HEARTBEAT", heartbeat_ms(), flush=True)
engine = DistributeEngine(strategy)
store = engine.key_value_store()
me = engine.process_index
store.put(f"beat-{me}", json.dumps({"rank": me, "n": 1}))
store.put(f"beat-{me}", json.dumps({"rank": me, "n": 2}))  # overwritten
other = None
deadline = time.monotonic() + 60
while (other is None or json.loads(other)["n"] < 2) and time.monotonic() < deadline:
    other = store.get(f"beat-{1 - me}")
    time.sleep(0.1)
print("GOT", other, "MISSING", store.get("never-set"), flush=True)
"""


@pytest.mark.multiprocess
def test_the_coordination_service_store_carries_values_between_workers(tmp_path):
    """tfdist._hooks.coordination through tfdist.comm.kv.CoordinationStore: each of 2 TF_CONFIG
    workers writes a key twice and reads the other's second value; an unset key reads None.
    The service runs with the strategy's heartbeat timeout (`configure`, before the strategy)."""
    import sys

    from tests.conftest import worker_env
    from tfdist.tools.launch import run_tf_workers

    script = tmp_path / "kv.py"
    script.write_text(_KV_WORKER)
    results = run_tf_workers([sys.executable, str(script)], 2, 180, env=worker_env())
    assert [r.returncode for r in results] == [0, 0], results[0].output[-3000:]
    for r in results:
        got = next(line for line in r.output.splitlines() if line.startswith("GOT"))
        assert got == f'GOT {{"rank": {1 - r.rank}, "n": 2}} MISSING None', r.output[-2000:]
        assert "HEARTBEAT 45000" in r.output.splitlines(), r.output[-2000:]


def test_a_heartbeat_outside_its_range_is_refused_before_the_service_is_configured():
    """`heartbeat_seconds` takes a number in [1, 86400]: a bad one is named before anything
    of the coordination service is set."""
    import tfdist

    for bad in (0.5, True, "30"):
        with pytest.raises(ValueError, match=f"Received: heartbeat_seconds={bad!r}"):
            tfdist.MultiWorkerMirroredStrategy(heartbeat_seconds=bad)


def test_built_and_own_variables_and_weight_decay_exclusions_read_keras_state():
    variables = [keras.Variable([1.0]), keras.Variable([2.0, 3.0])]
    sgd = keras.optimizers.SGD()
    assert _keras_hooks.built_variables(sgd) == []
    sgd.build(variables)
    assert _keras_hooks.built_variables(sgd) == variables
    scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(momentum=0.9))
    scaled.build(variables)
    own = _keras_hooks.own_variables(scaled)
    inner = scaled.inner_optimizer.variables
    assert own and not any(v is w for v in own for w in inner)
    assert len(scaled.variables) == len(own) + len(inner)
    excluded = [keras.optimizers.AdamW() for _ in range(3)]
    excluded[1].exclude_from_weight_decay(var_list=variables[:1])
    excluded[2].exclude_from_weight_decay(var_names=["bias"])
    assert [_keras_hooks.excludes_from_weight_decay(o) for o in excluded] == [False, True, True]


def _private_names_of_tensorflow_and_keras() -> set[str]:
    """Private attribute names of the TensorFlow and Keras objects tfdist handles, read from built
    instances (Keras sets most of them in `__init__` and `build`)."""
    variables = [keras.Variable([1.0])]
    adam = keras.optimizers.Adam()
    adam.build(variables)
    scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    scaled.build(variables)
    adamw = keras.optimizers.AdamW()
    adamw.exclude_from_weight_decay(var_names=["bias"])
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.zeros((2, 2)), np.zeros((2, 1)), verbose=0)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    objects = [adam, scaled, adamw, model, model.layers[0], variables[0], tf.Variable(1.0), strategy,
               strategy.extended, keras.callbacks.Callback(), model.history,
               tf.data.Dataset.range(1), tf.train.Checkpoint(), tf.Module()]
    return {name for obj in objects for name in dir(obj)
            if name.startswith("_") and not name.startswith("__")}


def _private_accesses(tree) -> tuple[dict[str, int], set[str]]:
    """({private name read: first line}, private names the file defines itself)."""
    import ast

    used: dict[str, int] = {}
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            if isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            else:
                used.setdefault(node.attr, node.lineno)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            used.setdefault(node.args[1].value, node.lineno)
    return used, own


def test_no_private_tensorflow_or_keras_attribute_is_touched_outside_the_hooks():
    """A name that TensorFlow's or Keras' objects keep private, read or written anywhere in tfdist
    but tfdist/_hooks/, unless the file defines that name itself (its own class's attribute)."""
    import ast
    from pathlib import Path

    private = _private_names_of_tensorflow_and_keras()
    assert {"_trainable_variables", "_variables", "_exclude_from_weight_decay"} <= private
    package = Path(tfdist_root()) / "tfdist"
    found = []
    for path in sorted(package.rglob("*.py")):
        if "_hooks" in path.parts:
            continue
        used, own = _private_accesses(ast.parse(path.read_text()))
        found += [f"{path.relative_to(package.parent)}:{line}: {name}"
                  for name, line in sorted(used.items()) if name in private and name not in own]
    assert not found, "private TensorFlow/Keras attributes outside tfdist/_hooks:\n" + \
        "\n".join(found)


def tfdist_root() -> str:
    import os

    import tfdist

    return os.path.dirname(os.path.dirname(os.path.abspath(tfdist.__file__)))


@pytest.mark.parametrize("make, kernel", [
    (lambda: keras.optimizers.SGD(0.1), "ResourceApplyGradientDescent"),
    (lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True), "ResourceApplyKerasMomentum"),
])
def test_a_fused_sgd_update_is_one_kernel_per_variable_on_keras_own_slots(make, kernel):
    """Keras' slots (`momentums`, looked up by `_get_variable_index`) are what the kernel
    updates, and the arithmetic is Keras' to the bit."""
    runs = []
    for fused in (False, True):
        opt, values, graph, patched = _three_updates(
            make, _keras_hooks.fuse_update_step if fused else None)
        assert patched is (True if fused else None)
        assert _keras_hooks.is_fused(opt) is fused
        assert (kernel in {op.type for op in graph.get_operations()}) is fused
        runs.append(values)
    for keras_value, fused_value in zip(*runs, strict=True):
        np.testing.assert_array_equal(fused_value, keras_value)


def _three_updates(make, patch=None):
    """`make()`'s optimizer, patched by `patch` before it is built, applying 3 fixed gradients to
    2 fixed variables in a traced function: (the optimizer, the variables' and its slots'
    values after, the function's graph, what `patch` returned)."""
    rng = np.random.default_rng(0)
    start = rng.normal(size=(2, 64, 32)).astype("float32")
    grads = rng.normal(size=(3, 2, 64, 32)).astype("float32")
    variables = [keras.Variable(w) for w in start]
    opt = make()
    patched = patch(opt) if patch is not None else None
    opt.build(variables)
    step = tf.function(lambda grads: opt.apply(tf.unstack(grads), variables))
    for g in grads:
        step(tf.constant(g))
    graph = step.get_concrete_function(tf.constant(grads[0])).graph
    return opt, [np.asarray(v) for v in [*variables, *opt.variables[2:]]], graph, patched


def test_fusing_picks_xla_for_adam_a_kernel_for_sgd_and_keeps_keras_update_otherwise():
    """`fuse_update(opt, True)`: Adam and AdamW (amsgrad too) compiled by XLA, SGD by its
    kernel, other optimizers untouched; sparse gradients keep Keras' update."""
    for make, fused in ((keras.optimizers.Adam, "xla"), (keras.optimizers.AdamW, "xla"),
                        (lambda: keras.optimizers.Adam(amsgrad=True), "xla"),
                        (lambda: keras.optimizers.SGD(momentum=0.5), True),
                        (keras.optimizers.Lamb, False), (keras.optimizers.RMSprop, False)):
        opt = make()
        _keras_hooks.fuse_update(opt, True)
        assert _keras_hooks.is_fused(opt) == fused, (make, fused)
    for opt in (keras.optimizers.Adam(), keras.optimizers.Lamb(), keras.optimizers.RMSprop()):
        assert _keras_hooks.fuse_update_step(opt) is False and not _keras_hooks.is_fused(opt)
    table = np.arange(12, dtype="float32").reshape(6, 2)
    rows = tf.IndexedSlices(tf.ones([2, 2]), tf.constant([1, 4]), tf.constant([6, 2]))
    results = []
    for fused in (False, True):
        var = keras.Variable(table)
        opt = keras.optimizers.SGD(0.1, momentum=0.9)
        if fused:
            _keras_hooks.fuse_update_step(opt)
        opt.build([var])
        opt.apply([rows], [var])
        results.append(np.asarray(var))
    np.testing.assert_array_equal(results[1], results[0])
    assert (results[1] != table).sum() == 4  # two rows moved, as Keras moves them


@pytest.mark.parametrize("make", [lambda: keras.optimizers.Adam(0.01),
                                  lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
                                  lambda: keras.optimizers.RMSprop(0.01, momentum=0.5),
                                  lambda: keras.optimizers.Lamb(0.01)])
def test_a_compiled_update_is_keras_own_arithmetic_in_one_xla_function_per_device(make):
    """`compile_update_step` runs the optimizer's own `update_step` (any optimizer, kernel or
    not) of both variables in one function XLA must compile; the weights and slots stay Keras'
    to float32 rounding (XLA may fuse a multiply and an add)."""
    def compile_twice(opt):  # once is enough
        return _keras_hooks.compile_update_step(opt), _keras_hooks.compile_update_step(opt)

    runs = []
    for compiled in (False, True):
        opt, values, graph, patched = _three_updates(make, compile_twice if compiled else None)
        assert patched == ((True, True) if compiled else None)
        assert _keras_hooks.is_fused(opt) == ("xla" if compiled else False)
        must_compile = [f for f in graph._functions.values()  # noqa: SLF001 (the test reads it)
                        if f.definition.attr["_XlaMustCompile"].b]
        assert len(must_compile) == (1 if compiled else 0)  # one for both variables
        runs.append(values)
    for keras_value, compiled_value in zip(*runs, strict=True):
        np.testing.assert_allclose(compiled_value, keras_value, rtol=1e-6, atol=1e-7)
    # sparse gradients keep Keras' own update, as fuse_update_step's do, beside a dense one
    # compiled in the same apply
    rows = tf.IndexedSlices(tf.ones([2, 2]), tf.constant([1, 4]), tf.constant([6, 2]))
    dense = tf.fill([3], 0.5)
    after = []
    for compiled in (False, True):
        table, weights = keras.Variable(np.ones((6, 2), "float32")), keras.Variable(np.ones(3))
        opt = make()
        if compiled:
            _keras_hooks.compile_update_step(opt)
        opt.build([table, weights])
        opt.apply([rows, dense], [table, weights])
        after.append((np.asarray(table), np.asarray(weights)))
    assert (after[1][0][[1, 4]] != 1).all() and (after[1][1] != 1).all()
    np.testing.assert_array_equal(after[1][0], after[0][0])  # the table: Keras' to the bit
    np.testing.assert_allclose(after[1][1], after[0][1], rtol=1e-6, atol=1e-7)


KERAS_GALLERIES = """
import sys
import numpy as np
import tfdist
import keras
from keras.src.visualization import plot_bounding_box_gallery, plot_image_gallery

print("matplotlib" in sys.modules, "keras" in sys.modules)
keras.visualization.plot_image_gallery(np.zeros((2, 8, 8, 3)), value_range=(0, 1),
                                       path=sys.argv[1])
import matplotlib.patches
print("matplotlib.pyplot" in sys.modules,
      plot_bounding_box_gallery.patches.Patch is matplotlib.patches.Patch)
"""


def test_keras_loads_without_matplotlib_and_its_galleries_import_it_on_first_use(tmp_path):
    """`import tfdist` loads Keras with matplotlib hidden; Keras' galleries still draw."""
    import subprocess
    import sys

    from tests.conftest import worker_env

    out = subprocess.run([sys.executable, "-c", KERAS_GALLERIES, str(tmp_path / "gallery.png")],
                         capture_output=True, text=True, env=worker_env(), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "True", "True", "True"], out.stdout
    assert (tmp_path / "gallery.png").stat().st_size > 0


def test_a_process_that_loaded_keras_first_keeps_its_matplotlib():
    from keras.src.visualization import plot_image_gallery

    from tfdist._hooks.imports import matplotlib_on_first_use

    before = plot_image_gallery.plt
    with matplotlib_on_first_use():
        import tensorflow  # noqa: F401
    assert plot_image_gallery.plt is before
    assert type(before).__name__ == "module"  # this process imported Keras before tfdist


def test_matplotlib_is_hidden_from_kerass_galleries_only():
    """While the hook is installed, only the two Keras modules are refused matplotlib (a user's
    module that the same block imports gets it)."""
    from tfdist._hooks.imports import _Hidden

    hidden = _Hidden()
    probe = "spec = hidden.find_spec('matplotlib.pyplot')"
    for module in ("keras.src.visualization.plot_image_gallery",
                   "keras.src.visualization.plot_bounding_box_gallery"):
        with pytest.raises(ModuleNotFoundError, match="imported on first use"):
            exec(probe, {"__name__": module, "hidden": hidden})
    mine = {"__name__": "mine", "hidden": hidden}
    exec(probe, mine)
    assert mine["spec"] is None  # the next finder finds it, as without the hook
    assert hidden.find_spec("numpy") is None
