"""Pipeline stages in other processes on other (emulated) hosts, through TF's cluster runtime:
equal to the one-process pipeline; two such pipelines equal 2-replica data parallelism; a host
that dies stops the job with an error naming it; bad cluster shapes refused first."""

from __future__ import annotations

import os
import shutil
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import ROOT, worker_env
from tests.workers import pipeline_hosts_worker as job
from tests.workers.common import cpu_devices
from tfdist.pipeline import Pipeline, PipelineModel, cluster_devices

WORKER = os.path.join(ROOT, "tests", "workers", "pipeline_hosts_worker.py")
needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="needs root and iproute2 (ip, tc) for the emulated hosts")


def _weights(saved, prefix: str) -> list[np.ndarray]:
    return [saved[f"{prefix}_{i}"] for i in range(8)]


@pytest.fixture(scope="module")
def four_hosts(tmp_path_factory):
    """One job on 4 emulated hosts (1 Gbit/s links): every check's weights."""
    from tfdist.tools.emulated import EmulatedCluster

    shared = tmp_path_factory.mktemp("hosts")  # the job's shared storage
    out = str(shared / "weights.npz")
    with EmulatedCluster(4, "1gbit", shared=[shared]) as cluster:
        results = cluster.run_workers([sys.executable, WORKER, out], timeout=300,
                                      env=worker_env())
    assert [r.returncode for r in results] == [0] * 4, results[0].output[-3000:]
    for task, result in enumerate(results[1:], 1):
        assert f"worker 0 has ended; worker {task} stops" in result.output
    return dict(np.load(out))


@needs_netns
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_stages_on_two_hosts_equal_the_one_process_pipeline(four_hosts, schedule):
    reference = job.train(cpu_devices(2), schedule)
    for got, want in zip(_weights(four_hosts, schedule), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert str(four_hosts[f"{schedule}_device"]) == "/job:worker/replica:0/task:1/device:CPU:0"


@needs_netns
def test_two_pipelines_on_four_hosts_equal_two_replica_data_parallelism(four_hosts, mirrored):
    with mirrored(2).scope():
        reference = keras.Sequential([keras.Input((job.FEATURES,)), *job.layers()])
        reference.compile(keras.optimizers.Adam(1e-2),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    reference.fit(*job.data(), batch_size=job.BATCH, epochs=2, shuffle=False, verbose=0)
    first, second = _weights(four_hosts, "hybrid0"), _weights(four_hosts, "hybrid1")
    for a, b, want in zip(first, second, reference.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)  # the copies on hosts 0-1 and 2-3 stay equal
        np.testing.assert_allclose(a, want, rtol=1e-5, atol=1e-5)
    assert str(four_hosts["hybrid_device"]) == "/job:worker/replica:0/task:3/device:CPU:0"


@needs_netns
def test_a_host_that_dies_stops_the_job_with_an_error_naming_it(tmp_path):
    from tfdist.tools.emulated import EmulatedCluster

    flag = str(tmp_path / "training")
    start = time.monotonic()
    with EmulatedCluster(2, "1gbit", shared=[tmp_path]) as cluster:
        results = cluster.run_workers([sys.executable, WORKER, flag, "die"], timeout=180,
                                      env=worker_env())
    assert os.path.exists(flag)  # worker 0 had trained two epochs across both hosts
    assert results[1].returncode == -9
    assert results[0].returncode not in (0, None), results[0].output[-2000:]
    assert "UnavailableError: Pipeline worker 1 (10." in results[0].output
    assert "no longer answers" in results[0].output
    assert time.monotonic() - start < 170  # ended by the error, not by the timeout


def test_any_error_while_a_worker_is_gone_is_reported_as_that_worker_unavailable(monkeypatch):
    """Which TensorFlow error a lost worker causes depends on what was under way (a step, a
    function being registered on it): each is re-raised as UnavailableError naming the worker;
    while every worker answers, the error is TensorFlow's own."""
    import socket

    from tfdist.pipeline import cluster

    with socket.socket() as alive, socket.socket() as gone:
        alive.bind(("127.0.0.1", 0))
        alive.listen()
        gone.bind(("127.0.0.1", 0))  # bound, not listening: refuses connections
        addresses = [f"127.0.0.1:{s.getsockname()[1]}" for s in (alive, alive, gone)]
        monkeypatch.setattr(cluster, "_connected", addresses)
        for error in (tf.errors.InternalError, tf.errors.UnavailableError):
            named = rf"Pipeline worker 2 \({addresses[2]}\) no longer answers"
            with pytest.raises(tf.errors.UnavailableError, match=named), \
                    cluster.naming_lost_workers():
                raise error(None, None, "Failed to register function remotely due to Socket "
                                        "closed")
        monkeypatch.setattr(cluster, "_connected", addresses[:2])
        monkeypatch.setattr(cluster, "LOST_PROBE_SECONDS", 0.3)
        with pytest.raises(tf.errors.InternalError, match="^Socket closed$"), \
                cluster.naming_lost_workers():
            raise tf.errors.InternalError(None, None, "Socket closed")


def test_a_worker_still_closing_its_port_when_the_error_comes_is_named(monkeypatch):
    """A killed worker resets its connections a moment before its port closes: the probe that
    follows the error may still get in, and the next one does not."""
    from tfdist.pipeline import cluster

    answers = iter([True, True, False])  # accepts twice more, then its port is gone
    monkeypatch.setattr(cluster, "_accepts", lambda address: next(answers))
    monkeypatch.setattr(cluster, "_connected", ["127.0.0.1:1", "127.0.0.1:2"])
    with pytest.raises(tf.errors.UnavailableError, match=r"Pipeline worker 1 \(127.0.0.1:2\)"), \
            cluster.naming_lost_workers():
        raise tf.errors.UnavailableError(None, None, "recvmsg:Connection reset by peer")


def _resolver(workers: int, jobs=None):
    spec = tf.train.ClusterSpec(jobs or {"worker": [f"127.0.0.1:{2222 + i}"
                                                     for i in range(workers)]})
    return tf.distribute.cluster_resolver.SimpleClusterResolver(spec, task_type="worker",
                                                                task_id=0)


def test_cluster_shapes_that_do_not_fit_are_refused_before_anything_starts(monkeypatch):
    with pytest.raises(ValueError, match=r"3 stages x 1 replicas = 3 hosts, but the cluster "
                                         r"has 2 workers.*start 3 workers"):
        cluster_devices(stages=3, resolver=_resolver(2))
    with pytest.raises(ValueError, match=r"2 stages x 2 replicas = 4 hosts, but the cluster "
                                         r"has 6 workers.*stages=3"):
        cluster_devices(stages=2, replicas=2, resolver=_resolver(6))
    with pytest.raises(ValueError, match=r"5 workers, which 2 pipeline replicas cannot share"):
        cluster_devices(replicas=2, resolver=_resolver(5))
    with pytest.raises(ValueError, match=r"stages=0"):
        cluster_devices(stages=0, resolver=_resolver(2))
    with pytest.raises(ValueError, match=r"also has \['ps'\]"):
        cluster_devices(resolver=_resolver(0, {"worker": ["a:1"], "ps": ["b:2"]}))
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match=r"TF_CONFIG, which is not set.*tfdist.launch"):
        cluster_devices()


def test_a_grid_whose_rows_do_not_match_the_stages_is_refused():
    dense = keras.layers.Dense
    with pytest.raises(ValueError, match=r"2 stages but 3 devices \(replica 1\)"):
        Pipeline([[dense(2)], [dense(2)]], devices=[cpu_devices(2), cpu_devices(3)])
    pipe = Pipeline([[dense(2)], [dense(2)]], devices=[cpu_devices(2), cpu_devices(4)[2:]])
    config = PipelineModel(pipe).get_config()
    restored = keras.saving.deserialize_keras_object(config["pipeline"])
    assert restored.device_grid == pipe.device_grid and restored.num_replicas == 2


def test_a_serving_worker_whose_driver_never_comes_stops_with_a_message():
    import socket
    import subprocess

    from tfdist.tools.launch import cluster_config

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    code = "from tfdist.pipeline import cluster_devices; cluster_devices(wait=2)"
    env = dict(worker_env(), TF_CONFIG=cluster_config(1, [f"127.0.0.1:{p}" for p in ports]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "worker 1 serves its devices" in out.stdout
    assert f"worker 0 (127.0.0.1:{ports[0]}) did not come up in 2 s" in out.stderr
