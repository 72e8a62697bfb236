"""Elastic Horovod with Keras 3 (`tfdist.horovod.elastic`) under `horovodrun --min-np --max-np
--host-discovery-script`: a rank that dies and a host that joins; the job ends with the weights of
one device training on the same global batches (nothing lost, nothing trained twice)."""

from __future__ import annotations

import os
import sys

import keras
import numpy as np
import pytest

import tfdist
from tests.conftest import ROOT, horovod_available, worker_env
from tests.workers import elastic_horovod_worker as job
from tfdist.tools.launch import horovodrun_command, run_processes

WORKER = os.path.join(ROOT, "tests", "workers", "elastic_horovod_worker.py")
pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(not horovod_available(), reason="Horovod is not installed")]


@pytest.fixture(scope="module")
def reference():
    """The job on one device: the same global batches, never interrupted."""
    x, y = tfdist.data.load_digits()
    model = job.build()
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9), loss=job.loss())
    model.fit(tfdist.data.global_batches(x, y, job.GLOBAL_BATCH, seed=0), epochs=job.EPOCHS,
              steps_per_epoch=job.STEPS, verbose=0)
    return model.get_weights()


def _elastic_run(tmp_path, mode: str, hosts: str, np_: int, style: str = "tfdist"):
    (tmp_path / "hosts").write_text(hosts)
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {tmp_path / 'hosts'}\n")
    script.chmod(0o755)
    out = str(tmp_path / "weights.npz")
    command = horovodrun_command([sys.executable, WORKER, out, mode, str(tmp_path / "hosts"), style],
                                 np_, network_interface="lo", min_np=2, max_np=3,
                                 host_discovery_script=str(script))
    # A survivor notices a dead peer after Gloo's timeout: 10 s keeps "die" short. A rank that
    # joins must import TensorFlow before the others' rendezvous times out: on a loaded machine
    # that took over 10 s once in a full-suite run, hence 120 s for "join".
    env = dict(worker_env(), HOROVOD_GLOO_TIMEOUT_SECONDS="10" if mode == "die" else "120")
    (result,) = run_processes([(command, env)], 300)
    assert result.returncode == 0, result.output[-4000:]
    saved = np.load(out)
    return [saved[f"arr_{i}"] for i in range(4)], list(saved["sizes"]), result.output


def _assert_equal(weights, reference):
    for got, want in zip(weights, reference, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_rank_that_dies_leaves_the_others_to_finish_the_same_training(tmp_path, reference):
    """3 ranks (2 on localhost, 1 on 127.0.0.1); the one on 127.0.0.1 is SIGKILLed at global
    step 8: the others restore the last commit, go on as 2 ranks from there and end with the
    uninterrupted weights."""
    weights, sizes, output = _elastic_run(tmp_path, "die", "localhost:2\n127.0.0.1:1\n", 3)
    assert sizes == [3, 2], output[-3000:]
    assert "DONE rank 0 of 2" in output and "DONE rank 1 of 2" in output
    _assert_equal(weights, reference)


def test_a_host_that_joins_is_used_and_changes_nothing_but_the_speed(tmp_path, reference):
    """A script written as Horovod's elastic Keras example is (Horovod's names, a model built at
    its first batch, `fit(epochs=EPOCHS - state.epoch)`), 2 ranks on localhost; at global step 6
    the discovery script starts listing 127.0.0.1:1 and the ranks wait there until Horovod sees
    it (the reset then comes at that step's commit, however loaded the machine): the new rank
    takes rank 0's state, the epoch in flight goes on from its committed batch, and 3 ranks
    finish with the uninterrupted weights."""
    weights, sizes, output = _elastic_run(tmp_path, "join", "localhost:2\n", 2, "horovod")
    assert sizes == [2, 3], output[-3000:]
    assert "DONE rank 2 of 3" in output
    # Rank 0's checkpoints: the fit started after the reset (in epoch 1) ran the 3 epochs.
    assert sorted(p.name for p in tmp_path.glob("weights.npz.checkpoint-*.keras")) == [
        f"weights.npz.checkpoint-{e}.keras" for e in range(1, job.EPOCHS + 1)], output[-3000:]
    _assert_equal(weights, reference)


def test_bad_use_is_refused_with_the_fix():
    from tfdist.horovod import elastic

    model = job.build()
    with pytest.raises(ValueError, match="needs a compiled model"):
        elastic.KerasState(model, epoch=0)
    with pytest.raises(ValueError, match="batches_per_commit must be an integer >= 1"):
        elastic.CommitState(None, batches_per_commit=0)


class _RecordedState:
    """Stands for a KerasState in the callbacks' calls: records (epoch, batch) at each commit."""

    def __init__(self):
        self.epoch, self.batch, self.commits = 0, 0, []

    def commit(self):
        self.commits.append((self.epoch, self.batch))

    def _on_fit_start(self):
        pass

    def _on_batch_end(self):
        pass


@pytest.mark.parametrize("style", ["tfdist", "horovod"])
def test_a_commit_never_leaves_an_epoch_with_no_batch_to_train(style):
    """A reset at the commit of an epoch's last batch would resume that epoch with nothing left
    to train: a rank that has just joined ends it with its metrics unbuilt (Keras raises). The
    last batch is committed by the epoch's end, once the epoch and batch count have moved on."""
    from tfdist.horovod import elastic

    state = _RecordedState()
    if style == "tfdist":
        callbacks = elastic.callbacks(state)
    else:
        callbacks = [elastic.UpdateEpochStateCallback(state),
                     elastic.UpdateBatchStateCallback(state), elastic.CommitStateCallback(state)]
    model = job.build()
    model.compile("sgd", loss=job.loss(), metrics=["accuracy"])
    x, y = tfdist.data.load_digits()
    model.fit(x[:64], y[:64], batch_size=16, epochs=2, callbacks=callbacks, verbose=0)
    assert state.commits == [(0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3), (2, 0)]
