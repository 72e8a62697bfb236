"""Horovod Keras users move with one import: scripts written as Horovod's examples are, with
`import tfdist.horovod as hvd`, run under `horovodrun --gloo -np 2`
(tests/workers/horovod_style_worker.py), and what tfdist cannot do as Horovod does is refused."""

from __future__ import annotations

import json
import sys

import keras
import numpy as np
import pytest

import tfdist
import tfdist.horovod as hvd
from tests.conftest import ROOT, horovod_available, worker_env
from tests.workers import horovod_style_worker as worker
from tfdist.tools.launch import run_horovod

needs_horovod = pytest.mark.skipif(not horovod_available(), reason="Horovod is not installed")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The worker's jobs on 2 Horovod ranks: {job: [(weights, record) of rank 0, of rank 1]}."""
    out = tmp_path_factory.mktemp("horovod_style")
    result = run_horovod([sys.executable, f"{ROOT}/tests/workers/horovod_style_worker.py",
                          str(out)], 2, 400, env=worker_env())
    assert result.returncode == 0, result.output[-5000:]
    jobs = {}
    for job in ("mnist", "lazy", "fp16", "tfdist_fp16", "dense"):
        jobs[job] = []
        for rank in (0, 1):
            with np.load(out / f"{job}-rank{rank}.npz") as saved:
                weights = [saved[f"arr_{i}"] for i in range(len(saved.files))]
            jobs[job].append((weights, json.loads((out / f"{job}-rank{rank}.json").read_text())))
    jobs["checkpoints"] = sorted(p.name for p in out.glob("checkpoint-*.keras"))
    return jobs


def _same(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(y, x, rtol=rtol, atol=atol)


@needs_horovod
@pytest.mark.multiprocess
@pytest.mark.horovod
def test_horovods_keras_mnist_example_trains_with_only_the_import_changed(runs):
    (w0, r0), (w1, _) = runs["mnist"]
    _same(w0, w1, rtol=0, atol=0)  # the ranks hold one model
    accuracy = r0["history"]["accuracy"]
    assert len(accuracy) == 6 and accuracy[-1] > 0.8, accuracy
    assert runs["checkpoints"] == [f"checkpoint-{e}.keras" for e in range(1, 7)]  # rank 0's


@needs_horovod
@pytest.mark.multiprocess
@pytest.mark.horovod
def test_a_sequential_without_input_with_metric_average_equals_mirrored(runs, mirrored):
    """The lazily built model trains on 2 ranks and ends with the weights MirroredStrategy over
    2 devices reaches on the same global batches."""
    x, y = tfdist.data.load_digits()
    strategy = mirrored(2)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = worker.lazy_model()
        model.compile(optimizer=tfdist.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    data = tfdist.data.distribute_batches(strategy, lambda: tfdist.data.global_batches(
        x, y, worker.LAZY_BATCH, seed=1))
    history = model.fit(data, epochs=2, steps_per_epoch=worker.LAZY_STEPS, verbose=0)
    (w0, r0), (w1, _) = runs["lazy"]
    _same(w0, w1, rtol=0, atol=0)
    _same(model.get_weights(), w0)
    np.testing.assert_allclose(r0["history"]["loss"], history.history["loss"], rtol=1e-5)


@needs_horovod
@pytest.mark.multiprocess
@pytest.mark.horovod
def test_compression_fp16_is_tfdists_fp16_at_half_the_dense_bytes(runs):
    (fp16, horovod_way), (tfdist_way, tfdist_record) = runs["fp16"][0], runs["tfdist_fp16"][0]
    _same(fp16, tfdist_way, rtol=0, atol=0)
    dense_bytes = runs["dense"][0][1]["bytes_sent"]
    assert horovod_way["bytes_sent"] == tfdist_record["bytes_sent"] == dense_bytes // 2


def test_horovod_arguments_are_mapped_or_refused_with_the_alternative():
    sgd = keras.optimizers.SGD(0.1)
    opt = hvd.DistributedOptimizer(sgd, backward_passes_per_step=3,
                                   average_aggregated_gradients=True,
                                   gradient_predivide_factor=2.0, sparse_as_dense=True)
    assert isinstance(opt, tfdist.DistributedOptimizer) and opt.accumulation_steps == 3
    for kwargs, message in (
            ({"op": hvd.Sum, "local_sgd": 4}, "use op=hvd.Average with local_sgd"),
            ({"op": hvd.Adasum}, "op=hvd.Adasum is not implemented"),
            ({"backward_passes_per_step": 2}, "average_aggregated_gradients=True"),
            ({"backward_passes_per_step": 0}, "Received: backward_passes_per_step=0"),
            ({"device_dense": "/gpu:0"}, "leave them ''"),
            ({"compression": "bf16"}, "hvd.Compression.none or .fp16"),
            ({"compression": hvd.Compression.fp16, "compressor": "topk"}, "not both")):
        with pytest.raises(ValueError, match=message):
            hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), **kwargs)
    assert hvd.Compression.none is None and hvd.Compression.fp16 == "fp16"
    for name in ("BroadcastGlobalVariablesCallback", "MetricAverageCallback",
                 "LearningRateWarmupCallback", "LearningRateScheduleCallback"):
        assert hasattr(hvd.callbacks, name)


def test_op_sum_hands_the_sum_of_the_replicas_gradients_to_the_optimizer(mirrored):
    """hvd.DistributedOptimizer(SGD(lr), op=hvd.Sum) on 2 replicas: the weights of SGD(2 lr) on
    their mean (SGD is linear in the gradient), and it survives a save and load."""
    from tests.workers import common

    x, y = common.load_digits()

    def fit(optimizer):
        strategy = mirrored(2)
        with strategy.scope():
            model = common.make_model()
            model.compile(optimizer=optimizer(), loss="sparse_categorical_crossentropy")
        model.fit(common.distribute(strategy, x, y, 64, shuffle=False), epochs=1,
                  steps_per_epoch=6, verbose=0)
        return model

    summed = fit(lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.02, momentum=0.9),
                                                  op=hvd.Sum))
    doubled = fit(lambda: tfdist.DistributedOptimizer(keras.optimizers.SGD(0.04, momentum=0.9)))
    for a, b in zip(doubled.get_weights(), summed.get_weights(), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)
    config = summed.optimizer.get_config()
    again = tfdist.DistributedOptimizer.from_config(config)
    assert [type(p).__name__ for p in again.chain.parts].count("SumOverRanks") == 1


@needs_horovod
@pytest.mark.multiprocess
@pytest.mark.horovod
def test_a_notice_to_one_horovod_rank_backs_up_every_rank_and_the_rerun_is_exact(tmp_path):
    """Under horovodrun, SIGTERM to rank 1 while step 9 runs: both ranks back up at step 9 and
    exit with 76; the same command again resumes there and ends with the weights of a run
    never stopped."""
    script = f"{ROOT}/tests/workers/horovod_preempt_worker.py"
    straight = run_horovod([sys.executable, script, str(tmp_path / "straight"), "run"], 2, 240,
                           env=worker_env())
    assert straight.returncode == 0, straight.output[-3000:]
    noticed = run_horovod([sys.executable, script, str(tmp_path / "again"), "notice"], 2, 240,
                          env=worker_env())
    assert "[tfdist] preempted (SIGTERM): backed up step 9" in noticed.output, \
        noticed.output[-3000:]
    assert noticed.returncode != 0
    for rank in (0, 1):
        assert sorted(p.name for p in (tmp_path / "again" / "backup" / f"process-{rank}")
                      .iterdir()) == ["step-9"]
    again = run_horovod([sys.executable, script, str(tmp_path / "again"), "run"], 2, 240,
                        env=worker_env())
    assert again.returncode == 0, again.output[-3000:]
    for rank in (0, 1):
        with np.load(tmp_path / "straight" / f"run-rank{rank}.npz") as a, \
                np.load(tmp_path / "again" / f"run-rank{rank}.npz") as b:
            for key in a.files:
                np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-6)
