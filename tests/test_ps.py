"""Parameter-server training: the consistency rules, the worker's optimizer over TensorFlow's RPC
layer, and whole jobs of 1 ps + 2 workers (`python -m tfdist.launch --ps 1 --workers 2`):
staleness 0 equals synchronous data parallelism, asynchronous training reaches the default job's
accuracy, a killed worker does not stop the job, a killed server stops it with a clear error."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.conftest import ROOT, worker_env
from tfdist.ps import Cluster, ParameterServer, ParameterServerOptimizer, assign_shards
from tfdist.ps.server import BUCKETS, REQUEST, STATS_LEN, describe_staleness, staleness_report
from tfdist.security import SECRET_ENV, SECRET_FILE_ENV, Verifier, job_secret, sign
from tfdist.tools.config import ConfigError, load_config
from tfdist.tools.launch import cluster_config, free_ports

SECRET = "a1b2c3d4e5f6a7b8c9d0e1f2a3b4c5d6"  # the tests' job secret


# -- the cluster ---------------------------------------------------------------------------------
def test_the_cluster_comes_from_tf_config_with_the_chief_as_worker_0():
    cluster = {"ps": ["h:1", "h:2"], "chief": ["h:3"], "worker": ["h:4", "h:5"]}
    def parse(kind, index):
        return Cluster.from_tf_config(json.dumps(
            {"cluster": cluster, "task": {"type": kind, "index": index}}))
    assert parse("chief", 0).task_index == 0 and parse("chief", 0).workers == ("h:3", "h:4", "h:5")
    assert parse("worker", 1).task_index == 2 and parse("worker", 1).task_type == "worker"
    assert parse("ps", 1).is_ps and parse("ps", 1).ps == ("h:1", "h:2")
    assert parse("ps", 1).num_workers == 3


@pytest.mark.parametrize("config, message", [
    ("", "needs TF_CONFIG"),
    ("{not json", "not a cluster description"),
    ('{"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 0}}', "no 'ps' job"),
    ('{"cluster": {"ps": ["h:1"]}, "task": {"type": "ps", "index": 0}}', "no 'worker' or 'chief'"),
    ('{"cluster": {"ps": ["h:1"], "worker": ["h:2"]}, "task": {"type": "evaluator", "index": 0}}',
     "'evaluator' has no part"),
    ('{"cluster": {"ps": ["h:1"], "worker": ["h:2"]}, "task": {"type": "worker", "index": 3}}',
     "task index 3 is outside the 1 'worker'"),
])
def test_bad_tf_config_is_refused_with_the_fix(config, message, monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match=re.escape(message)):
        Cluster.from_tf_config(config or None)


def test_variables_spread_over_the_servers_by_size():
    owner = assign_shards([100, 10, 60, 50, 5], 2)
    loads = [sum(s for s, o in zip([100, 10, 60, 50, 5], owner) if o == p) for p in (0, 1)]
    assert owner == assign_shards([100, 10, 60, 50, 5], 2)  # the same on every task
    assert sorted(loads) == [110, 115]  # largest first, each on the lighter server
    assert assign_shards([7, 7, 7], 1) == [0, 0, 0]


def test_the_launcher_writes_ps_and_worker_tasks():
    addresses = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
    tasks = [json.loads(cluster_config(i, addresses, ps=1)) for i in range(3)]
    assert tasks[0]["cluster"] == {"ps": addresses[:1], "worker": addresses[1:]}
    assert [t["task"] for t in tasks] == [{"type": "ps", "index": 0},
                                           {"type": "worker", "index": 0},
                                           {"type": "worker", "index": 1}]


# -- the consistency rules, on a server called directly -------------------------------------------
class _Served:
    """The server's one weight, read as a worker would pull it."""

    def __init__(self, server):
        self.server = server

    def numpy(self):
        return self.server.values()[0]


def _server(staleness, workers=2, timeout=60.0):
    variable = keras.Variable(np.zeros(3, np.float32))
    server = ParameterServer([variable], keras.optimizers.SGD(1.0), workers, staleness=staleness,
                             worker_timeout=timeout)
    return server, _Served(server)


def _grad(value):
    return [np.full(3, value, np.float32)]


def test_synchronous_rounds_apply_the_mean_once_everyone_pushed():
    server, w = _server(0)
    assert server.push(0, 0, 1.0, _grad(1.0)) == 0
    assert not server.ready(0)  # worker 1 has not pushed
    np.testing.assert_array_equal(w.numpy(), 0.0)
    assert server.push(1, 0, 0.5, _grad(3.0)) == 1
    assert server.ready(0) and server.ready(1)
    np.testing.assert_allclose(w.numpy(), -0.5 * 2.0)  # lr of the round's last push x mean
    assert server.report()["staleness_histogram"] == {0: 2}


def test_asynchronous_updates_apply_at_once_and_count_their_staleness():
    server, w = _server(None)
    server.push(0, 0, 1.0, _grad(1.0))
    server.push(0, 1, 1.0, _grad(1.0))
    server.push(1, 0, 1.0, _grad(1.0))  # computed on version 0, applied on version 2
    assert server.ready(1) and server.version == 3
    np.testing.assert_allclose(w.numpy(), -3.0)
    report = server.report()
    assert report["staleness_histogram"] == {0: 2, 2: 1}
    assert report["staleness_max"] == 2 and report["staleness_mean"] == pytest.approx(2 / 3)
    assert describe_staleness(report) == "mean 0.67, max 2"
    # pushes staler than 62 land in the last count, "63 or more": said so, not passed off as 63
    stats = np.zeros(STATS_LEN, np.int64)
    stats[[0, BUCKETS - 1]] = 1
    assert describe_staleness(staleness_report(stats)) == "mean at least 31.50, max 63 or more"


def test_stale_gradients_can_get_a_smaller_learning_rate():
    variable = keras.Variable(np.zeros(3, np.float32))
    server = ParameterServer([variable], keras.optimizers.SGD(1.0), 2, staleness=None,
                             scale_lr_by_staleness=True)
    server.push(0, 0, 1.0, _grad(1.0))
    server.push(0, 1, 1.0, _grad(1.0))
    server.push(0, 2, 1.0, _grad(1.0))
    server.push(1, 0, 1.0, _grad(3.0))  # staleness 3: lr 1/3
    np.testing.assert_allclose(server.values()[0], -3.0 - 1.0)


def test_delay_compensation_corrects_a_stale_gradient_with_the_weights_it_was_computed_on():
    variable = keras.Variable(np.zeros(3, np.float32))
    server = ParameterServer([variable], keras.optimizers.SGD(1.0), 2, staleness=None,
                             delay_compensation=0.25)
    server.pull(1)  # worker 1 computes on w = 0
    server.push(0, 0, 1.0, _grad(1.0))  # w = -1
    server.push(1, 0, 1.0, _grad(2.0))  # 2 + 0.25 * 2 * 2 * (-1 - 0) = 1
    np.testing.assert_allclose(server.values()[0], -2.0)
    with pytest.raises(ValueError, match="with staleness=0 there are none"):
        ParameterServer([variable], keras.optimizers.SGD(1.0), 2, staleness=0,
                        delay_compensation=0.04)


def test_bounded_staleness_holds_a_worker_that_runs_ahead():
    server, _ = _server(1)
    server.push(0, 0, 1.0, _grad(1.0))
    assert server.ready(0)  # one push ahead of worker 1: allowed
    server.push(0, 1, 1.0, _grad(1.0))
    assert not server.ready(0)  # two ahead: waits
    server.push(1, 0, 1.0, _grad(1.0))
    assert server.ready(0) and server.ready(1)
    server.finish(1)  # a finished worker no longer holds the others
    server.push(0, 3, 1.0, _grad(1.0))
    server.push(0, 4, 1.0, _grad(1.0))
    assert server.ready(0)


def test_a_silent_worker_is_lost_and_the_round_goes_on_without_it(capsys):
    server, w = _server(0, timeout=0.2)
    server.push(0, 0, 1.0, _grad(2.0))
    assert not server.ready(0)
    time.sleep(0.3)
    assert server.ready(0)  # worker 1 declared lost; the round is applied with one gradient
    np.testing.assert_allclose(w.numpy(), -2.0)
    assert "worker 1 silent for 0.2 s at clock 0: going on without it" in capsys.readouterr().out
    assert server.report()["workers_lost"] == 1
    server.push(1, 0, 1.0, _grad(1.0))  # it speaks again: taken back
    assert server.report()["workers_lost"] == 0
    assert "worker 1 is back" in capsys.readouterr().out


def test_a_lost_worker_that_comes_back_after_the_others_finished_is_told_the_job_is_over():
    server, _ = _server(None, timeout=0.2)
    server.push(0, 0, 1.0, _grad(1.0))
    time.sleep(0.3)
    assert server.ready(0)  # worker 1 declared lost
    server.finish(0)
    version = server.version
    with pytest.raises(RuntimeError, match="tfdist: the job is over: worker 1 was declared lost "
                                           "after 0.2 s of silence"):
        server.push(1, 0, 1.0, _grad(5.0))
    assert server.version == version and server.report()["pushes"] == 1  # nothing applied


def test_the_flat_update_equals_the_per_variable_one_and_is_written_back():
    shapes = [(3, 4), (4,), (2, 2, 2)]
    init = [np.random.default_rng(i).normal(size=s).astype("float32") for i, s in enumerate(shapes)]
    grads = [[np.random.default_rng(10 * k + i).normal(size=s).astype("float32")
              for i, s in enumerate(shapes)] for k in range(3)]
    results = []
    for flat in (True, False):
        variables = [keras.Variable(v) for v in init]
        server = ParameterServer(variables, keras.optimizers.Adam(0.1), 1, flat=flat)
        for k, g in enumerate(grads):
            server.push(0, k, 0.1, g)
        assert server.flat == flat
        results.append(server.values())
        server.write_back()
        for v, value in zip(variables, server.values()):
            np.testing.assert_array_equal(v.numpy(), value)
    for a, b in zip(*results, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_training_starts_when_every_worker_has_joined_or_is_lost():
    server, _ = _server(None, workers=3, timeout=0.3)
    server.pull(0)
    assert not server.started(0)
    server.pull(2)
    assert not server.started(2)  # worker 1 is starting up
    time.sleep(0.4)
    server.pull(0)
    server.pull(2)
    assert server.started(0)  # worker 1 never came: lost


def test_bad_server_arguments_are_refused():
    variable = keras.Variable(np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="staleness"):
        ParameterServer([variable], keras.optimizers.SGD(1.0), 2, staleness=-1)
    with pytest.raises(ValueError, match="holds no variables"):
        ParameterServer([], keras.optimizers.SGD(1.0), 2)


# -- checkpoints and restarts ----------------------------------------------------------------------
def _adam_server(directory, workers=2, every=2, size=3, staleness=0):
    variables = [keras.Variable(np.arange(size, dtype=np.float32)),
                 keras.Variable(np.ones(2, np.float32))]
    return ParameterServer(variables, keras.optimizers.Adam(0.1), workers, staleness=staleness,
                           checkpoint_dir=None if directory is None else str(directory),
                           checkpoint_every=every)


def _pushes(server, rounds, start=0, size=3):
    for k in range(start, start + rounds):
        for worker in (0, 1):
            server.push(worker, k, 0.1, [np.full(size, k + worker + 1.0, np.float32),
                                         np.full(2, -1.0, np.float32)])


def test_a_server_resumes_its_checkpoint_to_the_weights_of_a_server_never_stopped(tmp_path):
    from tfdist.ps import checkpoint

    first = _adam_server(tmp_path)
    _pushes(first, 5)  # checkpoints at updates 2 and 4 (the newest two kept)
    assert checkpoint.complete_steps(str(tmp_path), 0) == [2, 4]
    assert checkpoint.common_step(str(tmp_path), 1) == 4
    assert first.clock(1) == 5
    reference = _adam_server(None)
    _pushes(reference, 4)
    resumed = _adam_server(tmp_path)
    resumed.restore(4)  # a restarted server: update 4, clocks 4, Adam's moments and step
    assert resumed.version == 4 and resumed.clock(0) == resumed.clock(1) == 4
    assert resumed.report()["staleness_histogram"] == reference.report()["staleness_histogram"]
    _pushes(resumed, 3, start=4)
    _pushes(reference, 3, start=4)
    for a, b in zip(resumed.values(), reference.values(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_checkpoint_of_another_job_is_refused_and_servers_must_agree(tmp_path):
    from tfdist.ps import checkpoint

    _pushes(_adam_server(tmp_path), 2)
    with pytest.raises(ValueError, match=r"written for other workers \(2; here 3\)"):
        _adam_server(tmp_path, workers=3).restore(2)
    with pytest.raises(ValueError, match=r"variables' shapes .*remove the directory"):
        _adam_server(tmp_path, size=4).restore(2)
    os.makedirs(tmp_path / "ps-1")
    (tmp_path / "ps-1" / "step-6.npz").write_bytes(b"")
    with pytest.raises(ValueError, match=r"no checkpoint in common .*\{0: \[2\], 1: \[6\]\}"):
        checkpoint.common_step(str(tmp_path), 2)
    assert checkpoint.common_step(str(tmp_path / "none"), 2) is None


def test_synchronous_servers_resume_where_every_worker_also_has_its_own_checkpoint(tmp_path):
    """A server writes its checkpoint of a step while the workers still finish it: a worker
    stopped in between has none there, and the job resumes from the step before, which every
    server and every worker keeping checkpoints completed (else the servers' newest)."""
    from tfdist.ps import checkpoint

    def steps(name, *numbers):
        for n in numbers:
            checkpoint.save(str(tmp_path), name, n, {}, {})

    steps(0, 30, 35)
    steps(1, 30, 35)
    steps("worker-0", 30, 35)
    steps("worker-1", 25, 30)  # stopped before it wrote its checkpoint of step 35
    assert checkpoint.common_step(str(tmp_path), 2) == 35  # the servers alone
    assert checkpoint.common_step(str(tmp_path), 2, workers=2) == 30
    assert checkpoint.common_step(str(tmp_path), 2, workers=3) == 30  # worker-2 keeps none
    checkpoint.remove(str(tmp_path), "worker-1")
    steps("worker-1", 10, 15)  # none in common with the servers'
    assert checkpoint.common_step(str(tmp_path), 2, workers=2) == 35

def test_a_checkpoint_that_cannot_be_written_stops_the_server_with_the_reason(small_filesystem):
    server = _adam_server(small_filesystem, every=1, size=4000)  # 16 KB weights + 2 moments
    with pytest.raises(OSError, match=r"could not write its checkpoint of update \d+ .*Its last "
                                      r"complete checkpoint is intact"):
        _pushes(server, 3, size=4000)
    assert isinstance(server._failure, OSError)  # serve() raises it and the task exits
    assert not [p for p in (small_filesystem / "ps-0").iterdir() if p.suffix == ".partial"]


def test_start_at_begins_fit_at_a_global_step_without_training_the_steps_before():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = np.ones((8, 4), np.float32), np.zeros((8, 1), np.float32)
    seen = []
    record = keras.callbacks.LambdaCallback(on_epoch_begin=lambda epoch, logs: seen.append(epoch))
    history = model.fit(x, y, batch_size=2, epochs=3,
                        callbacks=[tfdist.callbacks.StartAt(6, 4), record], verbose=0)
    assert seen == [1, 2] and len(history.history["loss"]) == 2
    assert int(model.optimizer.iterations.numpy()) == 6  # 12 steps - the 6 already done
    model.fit(x, y, batch_size=2, epochs=1, verbose=0)  # a later fit is a plain one again
    assert int(model.optimizer.iterations.numpy()) == 10
    with pytest.raises(ValueError, match="steps_per_epoch"):
        tfdist.callbacks.StartAt(3, 0)


def test_the_launcher_starts_a_failed_restartable_process_again(tmp_path, capsys):
    from tfdist.tools.launch import run_processes

    marker = tmp_path / "ran"
    script = (f"import os, sys; p = {str(marker)!r}; first = not os.path.exists(p); "
              "open(p, 'a').write('x'); print('first' if first else 'again'); "
              "sys.exit(3 if first else 0)")
    commands = [([sys.executable, "-c", script], dict(os.environ)),
                ([sys.executable, "-c", "import sys, time; time.sleep(0.5); sys.exit(4)"],
                 dict(os.environ))]
    results = run_processes(commands, 60, stop_on_failure=False, restartable=frozenset({0, 1}),
                            max_restarts=2)
    assert results[0].returncode == 0 and results[0].output == "first\nagain\n"
    assert results[1].returncode == 4  # the one restart left went to it, and it failed again
    err = capsys.readouterr().err
    assert "[launch] worker 0 exited with 3; starting it again (restart 1 of 2)" in err
    assert "(restart 2 of 2)" in err and "restart 3" not in err


def test_once_the_servers_finished_nothing_is_restarted_and_a_straggler_is_stopped(
        capsys, monkeypatch):
    from tfdist.tools import launch

    monkeypatch.setattr(launch, "JOB_OVER_GRACE", 1.0)
    started = time.monotonic()
    commands = [([sys.executable, "-c", "pass"], dict(os.environ)),  # the server ends the job
                ([sys.executable, "-c", "import time; time.sleep(0.5); raise SystemExit(3)"],
                 dict(os.environ)),  # fails after it: not started again
                ([sys.executable, "-c", "import time; time.sleep(600)"], dict(os.environ))]
    results = launch.run_processes(commands, 60, stop_on_failure=frozenset({0}),
                                   labels=["ps 0", "worker 0", "worker 1"],
                                   restartable=frozenset({1, 2}), max_restarts=3,
                                   servers=frozenset({0}))
    assert time.monotonic() - started < 30
    assert [r.returncode for r in results] == [0, 3, 0]
    err = capsys.readouterr().err
    assert "starting it again" not in err
    assert ("[launch] worker 1: still running 1 s after the parameter servers finished the job; "
            "stopped") in err


# -- compressed pushes ---------------------------------------------------------------------------
def test_a_compressed_push_carries_the_payload_and_the_server_decompresses_it():
    from tfdist import compression

    big = np.random.default_rng(0).normal(size=(64, 32)).astype("float32")
    small = np.random.default_rng(1).normal(size=(8,)).astype("float32")
    variables = [keras.Variable(np.zeros_like(big)), keras.Variable(np.zeros_like(small))]
    topk = compression.get({"name": "topk", "ratio": 0.01, "error_feedback": True})
    server = ParameterServer(variables, keras.optimizers.SGD(1.0), 1, staleness=None,
                             compressor=topk)
    assert server.codecs[1] is None  # a bias, and under 1024 elements: as it is
    payload, ctx, state = topk.compress(tf.constant(big), topk.init_state(big.shape, tf.float32),
                                        tf.constant(0, tf.int64))
    parts = [p.numpy() for p in payload] + [small]
    server.push(0, 0, 1.0, parts)
    applied = server.values()
    np.testing.assert_array_equal(applied[0], -topk.decompress(payload, ctx).numpy())
    assert np.count_nonzero(applied[0]) == 21  # ⌈1% of 2,048⌉
    np.testing.assert_array_equal(applied[1], -small)
    assert server.report()["bytes_received"] == sum(p.nbytes for p in parts) == 21 * 8 + 32
    # What the push left out stays in the worker's residual.
    np.testing.assert_allclose(state["residual"].numpy() - applied[0], big, atol=1e-6)


def test_a_compressor_that_needs_the_workers_step_is_refused():
    from tfdist import compression

    with pytest.raises(ValueError, match="RandomK compressor cannot compress pushes"):
        ParameterServer([keras.Variable(np.zeros((64, 32), np.float32))],
                        keras.optimizers.SGD(1.0), 1,
                        compressor=compression.get("randomk", ratio=0.1))


# -- the worker's optimizer over RPC -------------------------------------------------------------
LEARNING_RATE = 0.05


def _model(seed=3):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(2)])


@pytest.mark.parametrize("compressor", [None, "fp16"])
def test_one_worker_on_a_server_equals_plain_keras(compressor):
    """The push, wait and pull inside Keras' traced step; the server's Adam == Keras' Adam
    (FP16 pushes: to the half-precision rounding, with half the bytes)."""
    x = np.random.default_rng(0).normal(size=(32, 6)).astype("float32")
    y = np.random.default_rng(1).integers(0, 2, 32)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference = _model()
    reference.compile(optimizer=keras.optimizers.Adam(LEARNING_RATE), loss=loss)
    reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)

    (port,) = free_ports(1)
    server = subprocess.Popen([sys.executable, "-m", "tests.workers.ps_server", str(port),
                               str(compressor)],
                              cwd=ROOT, env={**worker_env(), SECRET_ENV: SECRET},
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        cluster = Cluster((f"127.0.0.1:{port}",), ("127.0.0.1:1",), "worker", 0, SECRET.encode())
        model = _model(seed=9)  # other initial weights: the worker starts from the server's
        optimizer = ParameterServerOptimizer(LEARNING_RATE, cluster=cluster,
                                             compressor=compressor, min_compress_size=0)
        model.compile(optimizer=optimizer, loss=loss, jit_compile=False)
        finish = tfdist.ps.FinishCallback()
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[finish])
        out, _ = server.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    for a, b in zip(reference.get_weights(), model.get_weights(), strict=True):
        if compressor is None:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_allclose(a, b, atol=2e-3)
    assert finish.report["version"] == 8 and finish.report["workers_finished"] == 1
    assert optimizer.communication_rounds == 8
    kernels = sum(int(np.prod(v.shape)) for v in model.trainable_variables if len(v.shape) == 2)
    biases = sum(int(np.prod(v.shape)) for v in model.trainable_variables if len(v.shape) == 1)
    push = (2 if compressor else 4) * kernels + 4 * biases  # biases go as they are
    assert optimizer.bytes_sent == 8 * push
    assert json.loads(out.splitlines()[-1])["bytes_received"] == 8 * push


def test_a_worker_given_another_setup_than_its_server_stops_both_naming_each_value():
    """A worker and a server given different setups (`tfdist train` gives each task its config
    but the paths, its versions and its data): the worker's join raises naming each key and
    both values, and the server stops with the same line."""
    server_setup = {"optimizer.learning_rate": "0.002", "the versions": "tfdist 0.2.0"}
    (port,) = free_ports(1)
    server = subprocess.Popen([sys.executable, "-m", "tests.workers.ps_server", str(port), "None",
                               json.dumps(server_setup)],
                              cwd=ROOT, env={**worker_env(), SECRET_ENV: SECRET},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        cluster = Cluster((f"127.0.0.1:{port}",), ("127.0.0.1:1",), "worker", 0, SECRET.encode())
        optimizer = ParameterServerOptimizer(
            LEARNING_RATE, cluster=cluster,
            setup={**server_setup, "optimizer.learning_rate": "0.01"})
        with pytest.raises(tfdist.ps.SetupMismatch) as raised:
            optimizer.join(_model().trainable_variables)
        _, err = server.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    said = ("worker 0 and parameter server 0 differ: optimizer.learning_rate is 0.01 on worker "
            "0, 0.002 on parameter server 0")
    assert str(raised.value) == said
    assert server.returncode == 1 and f"SetupMismatch: {said}" in err, err[-3000:]


def test_a_worker_with_no_server_says_where_it_looked():
    (port,) = free_ports(1)
    cluster = Cluster((f"127.0.0.1:{port}",), ("127.0.0.1:1",), "worker", 0, SECRET.encode())
    model = _model()
    model.compile(optimizer=ParameterServerOptimizer(0.05, cluster=cluster, connect_timeout=1.0),
                  loss="mse", jit_compile=False)
    with pytest.raises(ConnectionError, match=f"No parameter server answered at 127.0.0.1:{port}"):
        model.fit(np.zeros((4, 6)), np.zeros((4, 2)), verbose=0)


def test_a_ps_task_refuses_the_workers_optimizer():
    cluster = Cluster(("127.0.0.1:1",), ("127.0.0.1:2",), "ps", 0)
    with pytest.raises(ValueError, match="parameter server 0: it runs `tfdist.ps.serve"):
        ParameterServerOptimizer(cluster=cluster).cluster  # noqa: B018


# -- configs -------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, message", [
    ("engine.staleness=-1", "engine.staleness"),
    ("compression.name=randomk", "compression.name: randomk do(es) not combine"),
    ("train.precision=mixed_float16", "parameter-server training does not do"),
    ("engine.delay_compensation=0.04",
     "engine.delay_compensation: `delay_compensation` corrects stale gradients; with staleness=0"),
])
def test_configs_that_parameter_servers_cannot_run_are_refused(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, ["engine.name=parameter_server", override])


def test_tfdist_train_without_a_ps_task_names_the_fix(monkeypatch):
    from tfdist.tools.runner import train

    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["127.0.0.1:1"]},
                                                "task": {"type": "worker", "index": 0}}))
    with pytest.raises(ConfigError, match="no 'ps' job"):
        train(load_config(None, ["engine.name=parameter_server"]))


# -- whole jobs: 1 ps + 2 workers -----------------------------------------------------------------
JOB = ["--set", "train.epochs=2", "--set", "train.evaluate_each_epoch=false"]


def _command(out, *sets, ps=True, launch=()):
    train = [sys.executable, "-m", "tfdist.tools.cli", "train", *JOB,
             "--set", f"train.output_dir={out}", *sets]
    if not ps:
        return train
    return [sys.executable, "-m", "tfdist.launch", "--ps", "1", "--workers", "2",
            "--timeout", "300", *launch, "--", *train, "--set", "engine.name=parameter_server"]


def _run(command):
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=worker_env(),
                            timeout=330)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result


def _summary_and_weights(out):
    (summary,) = out.glob("*/summary.json")
    model = keras.saving.load_model(summary.parent / "model.keras")  # compiled, plain Keras
    return json.loads(summary.read_text()), model.get_weights()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The default job for two epochs: on 1 ps + 2 workers with staleness 0 and asynchronously
    with FP16 pushes (3 epochs), and with MirroredStrategy over 2 devices: {name: (summary,
    weights, output)}."""
    runs = {}
    for name, command_sets in {
        "sync": (["--set", "engine.staleness=0"], True),
        "async": (["--set", "engine.staleness=null", "--set", "train.epochs=3",
                   "--set", "compression.name=fp16"], True),
        # Keras' own update, as the servers apply it (compared at 1e-4 after 2 epochs)
        "mirrored": (["--set", "engine.name=mirrored", "--set", "engine.devices=2",
                      "--set", "optimizer.fused_update=false"], False),
    }.items():
        sets, ps = command_sets
        out = tmp_path_factory.mktemp(name)
        result = _run(_command(out, *sets, ps=ps))
        runs[name] = (*_summary_and_weights(out), result.stdout + result.stderr)
        runs[f"{name}_dir"] = out
    return runs


@pytest.mark.multiprocess
def test_staleness_0_on_two_workers_equals_synchronous_training_on_two_devices(jobs):
    summary, weights, output = jobs["sync"]
    _, reference, _ = jobs["mirrored"]
    for a, b in zip(reference, weights, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
    ps = summary["parameter_server"]
    steps = summary["steps"]
    assert ps["version"] == steps and ps["pushes"] == 2 * steps
    assert ps["staleness_histogram"] == {"0": 2 * steps} and ps["workers_lost"] == 0
    assert summary["bytes_sent_per_step"] == summary["gradient_bytes_per_round"]
    assert "[ps 0] parameter server 0: serving" in output
    assert "parameter server  synchronous" in output


@pytest.mark.multiprocess
def test_asynchronous_training_with_fp16_pushes_reaches_the_default_jobs_accuracy(jobs):
    summary, _, output = jobs["async"]
    ps = summary["parameter_server"]
    assert summary["test_accuracy"] >= 0.9, summary["test_accuracy"]
    # The CNN's kernels of >= 1024 elements go in half precision, the rest as they are.
    sync = jobs["sync"][0]
    assert summary["bytes_sent_per_step"] < 0.6 * sync["bytes_sent_per_step"]
    assert ps["version"] == ps["pushes"] == 2 * summary["steps"]  # every gradient applied at once
    assert sum(ps["staleness_histogram"].values()) == ps["pushes"]
    assert "parameter server  asynchronous" in output
    # TensorBoard: the staleness histogram and scalars, from the chief.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = jobs["async_dir"].glob("*/tensorboard/parameter_server")
    board = EventAccumulator(str(events)).Reload()
    histogram = board.CompressedHistograms("staleness") or board.Histograms("staleness")
    assert histogram and board.Scalars("staleness_max")[0].value == ps["staleness_max"]


def _pid_of(task_type: str, index: int, marker: str) -> int | None:
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() not in f.read():
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(i.split(b"=", 1) for i in f.read().split(b"\0") if b"=" in i)
        except OSError:
            continue
        task = json.loads(env.get(b"TF_CONFIG", b"{}") or b"{}").get("task", {})
        if task == {"type": task_type, "index": index}:
            return int(entry)
    return None


def _kill_during_epoch_2(out, task_type, index, *sets, launch=(), sig=signal.SIGKILL):
    """Runs the 2-epoch job, sends `sig` to task (`task_type`, `index`) when the chief starts
    epoch 2 (a SIGSTOP is followed by SIGCONT once the chief has finished); returns the
    launcher's (exit code, output, seconds from the chief's summary to the launcher's end)."""
    command = _command(out, *sets, launch=launch)
    launcher = subprocess.Popen(command, cwd=ROOT, env=worker_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    killed = threading.Event()
    pids: list[int] = []
    done_at: list[float] = []

    def watch():
        for line in launcher.stdout:
            lines.append(line)
            if not killed.is_set() and line.startswith("[worker 0] Epoch 2/"):
                pid = _pid_of(task_type, index, str(out))
                if pid is not None:
                    os.kill(pid, sig)
                    pids.append(pid)
                    killed.set()
            if line.startswith("[worker 0] test accuracy") and not done_at:  # trained, released
                done_at.append(time.monotonic())
                if sig == signal.SIGSTOP and pids:
                    os.kill(pids[0], signal.SIGCONT)  # it comes back: the job is over

    reader = threading.Thread(target=watch, daemon=True)
    reader.start()
    try:
        launcher.wait(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
    ended = time.monotonic()
    reader.join(10)
    assert killed.is_set(), "".join(lines)[-3000:]
    return launcher.returncode, "".join(lines), ended - done_at[0] if done_at else None


@pytest.mark.multiprocess
def test_a_stopped_worker_is_lost_and_told_the_job_is_over_when_it_comes_back(tmp_path):
    """Worker 1 is stopped (SIGSTOP) in epoch 2: the servers go on without it after 5 s and
    finish with worker 0; continued then, its first call is answered "the job is over" and it
    exits 0 at once: the job ends within 60 s of its last step, nothing restarted or waited on."""
    code, output, tail = _kill_during_epoch_2(
        tmp_path, "worker", 1, "--set", "engine.staleness=1", "--set", "engine.worker_timeout=5",
        sig=signal.SIGSTOP)
    assert code == 0, output[-4000:]
    assert re.search(r"parameter server 0: worker 1 silent for 5 s at clock \d+: going on "
                     "without it", output), output[-4000:]
    assert tail is not None and tail < 60, output[-4000:]
    assert re.search(r"\[worker 1\] tfdist: the job is over: worker 1 was declared lost after 5 s "
                     r"of silence, and the other workers have finished \(update \d+\); "
                     r"exiting\n", output), output[-4000:]
    assert "still running" not in output
    assert "starting it again" not in output
    summary, _ = _summary_and_weights(tmp_path)
    assert summary["parameter_server"]["workers_lost"] == 1
    assert summary["parameter_server"]["workers_finished"] == 1


@pytest.mark.multiprocess
def test_a_killed_worker_is_started_again_and_synchronous_training_ends_as_if_never_stopped(
        jobs, tmp_path):
    code, output, _ = _kill_during_epoch_2(tmp_path, "worker", 1, "--set", "engine.staleness=0")
    assert code == 0, output[-4000:]
    assert ("[launch] worker 1 was killed by SIGKILL (signal 9); starting it again (restart 1 "
            "of 3)") in output
    assert re.search(r"\[worker 1\] worker 1: resuming at step \d+", output), output[-4000:]
    summary, weights = _summary_and_weights(tmp_path)
    for a, b in zip(jobs["sync"][1], weights, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
    ps = summary["parameter_server"]  # its share of every round pushed, once
    assert ps["pushes"] == 2 * summary["steps"] and ps["workers_lost"] == 0


@pytest.mark.multiprocess
def test_a_killed_parameter_server_stops_the_job_which_resumes_from_its_checkpoint(
        jobs, tmp_path):
    every = ["--set", "train.checkpoint_steps=5"]
    code, output, _ = _kill_during_epoch_2(tmp_path, "ps", 0, *every)
    assert code != 0
    assert re.search(r"parameter server 0 at 127\.0\.0\.1:\d+ failed to answer (push|ready|pull) "
                     r"\(it stopped or hangs; with checkpoints, run the job again to resume\)",
                     output), output[-4000:]
    assert "[launch] ps 0 was killed by SIGKILL (signal 9)" in output
    assert not list(tmp_path.glob("*/summary.json"))
    # The same command again: the server takes its newest checkpoint, the workers go on at its
    # step, and the run ends with the weights of the run never stopped.
    output = _run(_command(tmp_path, *every)).stdout
    assert re.search(r"\[ps 0\] parameter server 0: serving .* resumed from its checkpoint of "
                     r"update [1-9]\d*", output), output[-4000:]
    summary, weights = _summary_and_weights(tmp_path)
    assert summary["resumed_from_step"] % 5 == 0 and summary["resumed_from_step"] > 0
    for a, b in zip(jobs["sync"][1], weights, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
    assert not (tmp_path / "backup").exists()  # the servers' checkpoints end with the job


@pytest.mark.multiprocess
def test_a_termination_notice_ends_every_task_with_76_and_the_rerun_is_exact(jobs, tmp_path):
    """SIGTERM to the launcher in epoch 2 (as a scheduler's notice): it passes it on, the
    servers and the workers exit with 76 at once, the launcher too; the same command resumes
    from the servers' newest checkpoint and ends with the weights of the run never stopped."""
    every = ["--set", "train.checkpoint_steps=5"]
    launcher = subprocess.Popen(_command(tmp_path, *every), cwd=ROOT, env=worker_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    lines: list[str] = []
    noticed_at: list[float] = []
    try:
        assert launcher.stdout is not None
        for line in launcher.stdout:
            lines.append(line)
            if not noticed_at and line.startswith("[worker 0] Epoch 2/"):
                launcher.send_signal(signal.SIGTERM)
                noticed_at.append(time.monotonic())
        launcher.wait(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
    output = "".join(lines)
    assert launcher.returncode == 76, output[-4000:]
    assert time.monotonic() - noticed_at[0] < 30, output[-4000:]  # within the grace period
    for task in ("ps 0", "worker 0", "worker 1"):
        assert f"[{task}] termination notice: exiting with 76" in output, output[-4000:]
    assert "Traceback" not in output
    rerun = _run(_command(tmp_path, *every)).stdout
    assert "resumed from its checkpoint of update" in rerun, rerun[-4000:]
    _, weights = _summary_and_weights(tmp_path)
    for a, b in zip(jobs["sync"][1], weights, strict=True):  # both runs' ends if not
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7,
                                   err_msg=f"{output[-3000:]}\n---\n{rerun[-3000:]}")


_BLOCKED = """
import tensorflow as tf
from tfdist.tools import ps_notices
ps_notices.DEADLINE = 2.0
ps_notices.listen(["SIGTERM"], raising=False)
queue = tf.queue.FIFOQueue(1, tf.float32)
print("blocked", flush=True)
queue.dequeue()  # never returns: the main thread stays inside TensorFlow
"""


def test_a_task_whose_main_thread_never_returns_ends_by_the_notices_deadline():
    """A parameter-server task blocked inside a TensorFlow call (as a worker's call to a server
    that hangs) never runs its Python signal handler; the notice is heard all the same, and the
    task ends with 76 once the deadline passes, saying where each thread was."""
    task = subprocess.Popen([sys.executable, "-c", _BLOCKED], cwd=ROOT, env=worker_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert task.stdout is not None
        assert task.stdout.readline() == "blocked\n"
        time.sleep(0.5)  # inside the dequeue
        task.send_signal(signal.SIGTERM)
        out, err = task.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(task.pid, signal.SIGKILL)
    assert task.returncode == 76, err[-3000:]
    assert "still running 2 s after the termination notice; where each thread is" in err, err
    assert 'File "<string>", line 8 in <module>' in err, err  # the main thread: the dequeue
    assert "termination notice: exiting with 76" in out


_FINISHING = """
import signal, time
from tfdist.tools import epilogue, ps_notices
ps_notices.DEADLINE = 1.0
ps_notices.listen(["SIGTERM"], raising=True)
epilogue.begin(["SIGTERM"])  # a server whose serving loop ended
signal.raise_signal(signal.SIGTERM)
time.sleep(3 * ps_notices.DEADLINE)
print("finished", flush=True)
"""


def test_a_notice_after_a_tasks_training_neither_raises_nor_starts_the_deadline():
    """Once a parameter-server task's training is over, a notice is said and the task runs on
    to its end: no `Notice` raised outside the serving loop, no deadline exit with 76."""
    done = subprocess.run([sys.executable, "-c", _FINISHING], cwd=ROOT, env=worker_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.endswith("finished\n")
    assert "SIGTERM received after training ended: finishing the run" in done.stderr
    assert "still running" not in done.stderr


def test_the_ps_engine_has_no_collectives_between_workers():
    engine = tfdist.ps.ParameterServerEngine(Cluster(("h:1",), ("h:2", "h:3"), "worker", 1))
    assert (engine.world_size, engine.process_index, engine.is_chief) == (2, 1, False)
    assert tfdist.comm.ENGINES["parameter_server"] is tfdist.ps.ParameterServerEngine
    with pytest.raises(NotImplementedError, match="no collectives"):
        engine.communicator()


# -- the job's secret ---------------------------------------------------------------------------
_CALLER = """
import json, sys, tensorflow as tf
from tfdist.ps.server import REQUEST
from tfdist.security import sign
port, secret, replay = sys.argv[1], sys.argv[2].encode(), sys.argv[3] == "replay"
client = tf.distribute.experimental.rpc.Client.create("grpc", f"127.0.0.1:{port}", name="c",
                                                      timeout_in_ms=5000)
# What TensorFlow's server tells any caller: its methods, with their signatures.
listed = {name.removesuffix("_blocking") for name in dir(client) if name.endswith("_blocking")}
print("listed", json.dumps(sorted(listed)), flush=True)
print("specs", json.dumps(str(client._method_registry)), flush=True)
said = []
def call(method, args, token, worker=0, payload=None):
    if payload is None:
        payload = tf.stack([tf.io.serialize_tensor(a) for a in args]) if args else \
            tf.constant([], tf.string)
    status = client.call(REQUEST, [tf.constant(token), tf.constant(method),
                                   tf.constant(worker, tf.int64), payload],
                         output_specs=tf.TensorSpec([None], tf.string), timeout_in_ms=5000)
    if not status.is_ok():
        said.append(status.get_error()[1].numpy().decode())
        return "failed"
    answer = status.get_value().numpy()
    said.append(answer[0].decode())
    return "ok" if answer[0] == b"" else "refused"
w = tf.constant(0, tf.int64)
grad = [tf.ones([4], tf.float32)]
for name, token in (("none", "no-token"),
                    ("forged", sign(b"not-the-job-secret-0123", "push", 0, server="ps-0")),
                    ("other server's", sign(secret, "push", 0, server="ps-1")),
                    ("right", sign(secret, "push", 0, server="ps-0"))):
    print(name.replace(" ", "-"), call("push", [w, w, tf.constant(1.0), *grad], token),
          flush=True)
    if replay and name == "right":
        print("replayed", call("push", [w, w, tf.constant(1.0), *grad], token), flush=True)
print("garbled", call("push", [], sign(secret, "push", 0, server="ps-0"),
                      payload=tf.constant([b"not a tensor"] * 4)), flush=True)
print("finish", call("finish", [w], "no-token"), flush=True)
print("release", call("release", [], sign(b"not-the-job-secret-0123", "release", -1,
                                          server="ps-0"), worker=-1), flush=True)
print("said", json.dumps(said), flush=True)
"""


def test_a_call_without_the_jobs_secret_is_refused_and_changes_nothing():
    """A parameter server bound to 127.0.0.1: a push with no token, a forged token, a token
    made for another server, a replayed token, a finish and a release without proof, and a
    push with a valid token but arguments that are not tensors are refused (the weights,
    version, pushes, finished workers and the release flag unchanged); the push with the right
    token is taken. What a caller learns without the secret: one method taking strings (no
    method names, no variable shapes), and refusals of one line (no traceback, no file path of
    the server)."""
    variable = keras.Variable(np.zeros(4, np.float32))
    server = ParameterServer([variable], keras.optimizers.SGD(1.0), 1, staleness=None)
    (port,) = free_ports(1)
    server.start(f"127.0.0.1:{port}", SECRET)
    caller = subprocess.run([sys.executable, "-c", _CALLER, str(port), SECRET, "replay"],
                            capture_output=True, text=True, cwd=ROOT, env=worker_env(),
                            timeout=120)
    answers = dict(line.split(" ", 1) for line in caller.stdout.splitlines())
    listed, specs, said = (json.loads(answers.pop(k)) for k in ("listed", "specs", "said"))
    assert answers == {"none": "refused", "forged": "refused", "other-server's": "refused",
                       "right": "ok", "replayed": "refused", "garbled": "refused",
                       "finish": "refused", "release": "refused"}, caller.stderr[-2000:]
    assert listed == [REQUEST]
    assert "shape=(4,)" not in specs and "float32" not in specs and "push" not in specs, specs
    assert set(said) == {"", "refused: no proof of the job's secret",
                         "refused: the arguments of push are not those of this server"}, said
    assert server.version == server.pushes == 1  # the one authentic push
    np.testing.assert_allclose(server.values()[0], -np.ones(4))
    assert not server._finished and not server._released
    assert server.verifier.refused == 6


def test_the_secret_is_required_read_safely_and_checked_in_constant_form(tmp_path):
    variable = keras.Variable(np.zeros(4, np.float32))
    server = ParameterServer([variable], keras.optimizers.SGD(1.0), 1)
    with pytest.raises(ValueError, match=f"Parameter server 0 needs the job's secret.*{SECRET_ENV}"):
        server.start("127.0.0.1:1", None)
    assert job_secret({}) is None
    assert job_secret({SECRET_ENV: SECRET}) == SECRET.encode()
    with pytest.raises(ValueError, match="at least 16 random"):
        job_secret({SECRET_ENV: "short"})
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o644)
    with pytest.raises(ValueError, match="readable by others.*chmod 600"):
        job_secret({SECRET_FILE_ENV: str(path)})
    path.chmod(0o600)
    assert job_secret({SECRET_FILE_ENV: str(path)}) == SECRET.encode()
    verifier = Verifier(SECRET.encode(), server="ps-0")
    token = sign(SECRET.encode(), "pull", 3, server="ps-0")
    assert not Verifier(SECRET.encode(), server="ps-1").check(token, "pull", 3)  # another's
    assert not verifier.check(token, "pull", 2)  # another worker's
    assert not verifier.check(token, "push", 3)  # another method's
    assert verifier.check(token, "pull", 3) and not verifier.check(token, "pull", 3)
    stale = sign(SECRET.encode(), "pull", 3, server="ps-0").replace(str(int(time.time())),
                                                                   "1000000000", 1)
    assert not verifier.check(stale, "pull", 3)


def test_a_parameter_server_job_binds_its_tf_config_address_and_never_every_interface(tmp_path):
    """`python -m tfdist.launch --ps 1 --workers 2`: while the job runs, the ps task's port
    listens on 127.0.0.1 (its TF_CONFIG address), not on 0.0.0.0 or [::]; the secret the
    launcher made is in no process's command line."""
    out = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "tfdist.launch", "--ps", "1", "--workers", "2", "--timeout", "300",
         "--", sys.executable, "-m", "tfdist.tools.cli", "train", "--set",
         "engine.name=parameter_server", "--set", "model.name=tests.workers.slow_model:build",
         "--set", "train.epochs=2", "--set", "train.steps_per_epoch=20",
         "--set", f"train.output_dir={out}"],
        cwd=ROOT, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    listening = None
    try:
        assert launcher.stdout is not None
        for line in launcher.stdout:
            found = re.search(r"parameter server 0: serving .* at (\S+):(\d+),", line)
            if found:
                port = found.group(2)
                ss = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout
                listening = [row.split()[3] for row in ss.splitlines()
                             if row.split()[3].rsplit(":", 1)[-1] == port]
                cmdlines = []
                for pid in filter(str.isdigit, os.listdir("/proc")):
                    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmdlines.append(f.read())
                break
        rest, _ = launcher.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 0, rest[-3000:]
    # gRPC binds an IPv6 socket to the IPv4-mapped address: the same single address.
    assert [a.replace("[::ffff:127.0.0.1]", "127.0.0.1") for a in listening] == \
        [f"127.0.0.1:{port}"], listening
    assert not any(b"TFDIST_JOB_SECRET" in c for c in cmdlines)
