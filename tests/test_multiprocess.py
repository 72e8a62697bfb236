"""Multi-process parity: TF_CONFIG workers and horovodrun ranks on 127.0.0.1 (hard timeouts).

Each run trains tests/workers/common.py's model; the reference is the same run in this process on
a MirroredStrategy over 2 logical devices, on the same global batches.
"""

import json
import os
import sys
import time

import numpy as np
import pytest

from tests.conftest import ROOT, WORKER, horovod_available, worker_env
from tests.workers import common
from tfdist.comm import ring_bytes
from tfdist.tools.launch import run_horovod, run_tf_workers

pytestmark = pytest.mark.multiprocess
TIMEOUT = 240
needs_horovod = pytest.mark.skipif(
    not horovod_available(),
    reason="Horovod is not installed: run launch/build_horovod.sh (see BUILD.md)",
)


def _outputs(results):
    return "\n".join(f"--- worker {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}"
                     for r in results)


def _reference(mirrored, steps=6, accumulation_steps=1, optimizer="sgd"):
    model, _ = common.train("strategy", steps, 32, strategy=mirrored(2), wrap=False,
                            optimizer=optimizer)
    return common.weights(model)


def _check_ranks(out, reference, params):
    w0, w1 = (common.load_weights(str(out / f"rank{r}.npz")) for r in (0, 1))
    common.assert_weights_close(w0, w1, rtol=0, atol=0)  # identical on both workers
    common.assert_weights_close(w0, reference, rtol=1e-5, atol=1e-6)
    stats = json.loads((out / "rank0.json").read_text())
    assert stats["rounds"] == 6
    assert stats["bytes_sent"] == pytest.approx(6 * ring_bytes("all_reduce", 4 * params, 2))


POWERSGD = '{"name": "powersgd", "rank": 2}'


def _job(prefix: str, offload: str | None) -> str:
    return f"{prefix}_{offload}" if offload else prefix


# The Horovod jobs that must succeed, run one after another in one `horovodrun -np 2` (each its
# own fit from a fresh Keras session) rather than one horovodrun per test: {name: options}.
HOROVOD_JOBS = {
    "sgd": ["--optimizer", "sgd"],
    "adam": ["--optimizer", "adam", "--keras-update"],  # compared with Keras' Adam at 1e-6
    "accumulation": ["--steps", "8", "--global-batch", "128", "--accumulation-steps", "4"],
    "mixed_float16": ["--optimizer", "adam", "--precision", "mixed_float16"],
    "powersgd": ["--hidden", "64", "--compressor", POWERSGD],
    "identity": ["--compressor", '{"name": "none"}', "--min-compress-size", "0"],
    "auto": ["--hidden", "64", "--steps", "12", "--auto-exchange"],
    "local_sgd": ["--steps", "7", "--local-sgd", "3"],
    **{_job(f"zero{stage}", offload): [
        "--optimizer", "adam", "--keras-update", "--steps", "20", "--zero", str(stage),
        *(["--offload", offload] if offload else [])]
       for stage, offload in ((1, None), (2, None), (2, "disk"), (3, None))},
    **{_job("zero_checkpoint", offload): [
        "--optimizer", "adam", "--keras-update", "--steps", "10", "--zero", "2",
        *(["--offload", offload] if offload else [])] for offload in (None, "disk")},
}


@pytest.fixture(scope="module")
def horovod_runs(tmp_path_factory):
    """HOROVOD_JOBS on 2 Horovod ranks: {name: the job's output directory}. A job with a
    checkpoint saves to DIR/ckpt/zero.keras."""
    if not horovod_available():
        pytest.skip("Horovod is not installed: run launch/build_horovod.sh (see BUILD.md)")
    root = tmp_path_factory.mktemp("horovod_jobs")
    jobs = {}
    for name, options in HOROVOD_JOBS.items():
        checkpoint = ["--checkpoint", str(root / name / "ckpt" / "zero.keras")] \
            if name.startswith("zero_checkpoint") else []
        jobs[name] = ["--engine", "horovod", "--out", str(root / name), *options, *checkpoint]
    (root / "jobs.json").write_text(json.dumps(jobs))
    result = run_horovod([sys.executable, WORKER, "--jobs", str(root / "jobs.json")], 2,
                         3 * TIMEOUT, env=worker_env())
    assert result.returncode == 0, result.output[-5000:]
    return {name: root / name for name in jobs}


# The TF_CONFIG jobs that must succeed on tfdist.MultiWorkerMirroredStrategy, run one after
# another by one pair of workers sharing one strategy (creating a TF_CONFIG strategy costs a
# process; each job is its own fit from a fresh Keras session): {name: options}.
TF_CONFIG_JOBS = {
    "sgd": ["--optimizer", "sgd"],
    "adam": ["--optimizer", "adam", "--keras-update"],  # compared with Keras' Adam at 1e-6
    "powersgd": ["--hidden", "64", "--compressor", POWERSGD],
    "auto": ["--hidden", "64", "--steps", "12", "--auto-exchange"],
    "accordion": ["--hidden", "64", "--steps", "8", "--accordion"],
    "local_sgd": ["--steps", "7", "--local-sgd", "3"],
    "zero3": ["--optimizer", "adam", "--keras-update", "--steps", "20", "--zero", "3"],
    "zero_checkpoint": ["--optimizer", "adam", "--keras-update", "--steps", "10", "--zero", "2"],
}


@pytest.fixture(scope="module")
def tf_config_runs(tmp_path_factory):
    """TF_CONFIG_JOBS on 2 TF_CONFIG workers: {name: the job's output directory}. A job with a
    checkpoint saves to DIR/ckpt/zero.keras."""
    root = tmp_path_factory.mktemp("tf_config_jobs")
    jobs = {}
    for name, options in TF_CONFIG_JOBS.items():
        checkpoint = ["--checkpoint", str(root / name / "ckpt" / "zero.keras")] \
            if name == "zero_checkpoint" else []
        jobs[name] = ["--engine", "multi_worker", "--out", str(root / name), *options,
                      *checkpoint]
    (root / "jobs.json").write_text(json.dumps(jobs))
    results = run_tf_workers([sys.executable, WORKER, "--jobs", str(root / "jobs.json")], 2,
                             3 * TIMEOUT, env=worker_env())
    assert [r.returncode for r in results] == [0, 0], _outputs(results)
    return {name: root / name for name in jobs}


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_two_tf_config_workers_match_mirrored_strategy(mirrored, tf_config_runs, optimizer):
    reference = _reference(mirrored, optimizer=optimizer)
    _check_ranks(tf_config_runs[optimizer], reference, common.make_model().count_params())


def test_plain_tf_multi_worker_strategy_fails_under_fit(worker_cmd, tmp_path):
    """keras-team/keras#20585: why tfdist.MultiWorkerMirroredStrategy exists. If this starts to
    pass, upstream fixed it and the override of `reduce` can go."""
    results = run_tf_workers(
        [*worker_cmd, "--engine", "multi_worker", "--out", str(tmp_path), "--plain-strategy"],
        2, TIMEOUT, env=worker_env())
    assert all(r.returncode not in (0, None) for r in results), _outputs(results)
    # Keras' strategy.reduce("MEAN", (x, y)) on a nested batch: TF cannot convert it.
    assert all("PerReplica" in r.output for r in results), _outputs(results)


def test_mismatched_tf_config_worker_fails_fast_and_clearly(worker_cmd, tmp_path):
    start = time.monotonic()
    results = run_tf_workers(
        [*worker_cmd, "--engine", "multi_worker", "--out", str(tmp_path), "--mismatch-rank", "1",
         "--timeout", "30"], 2, TIMEOUT, env=worker_env())
    assert time.monotonic() - start < 120
    # Every worker fails; one that reported its error but was still shutting down TF's
    # coordination service when the launcher's grace period ended is stopped (returncode None).
    assert not any(r.returncode == 0 for r in results), _outputs(results)
    assert any(r.returncode not in (0, None) for r in results), _outputs(results)
    text = _outputs(results)
    assert all("Error" in r.output for r in results), text
    # TF's variable-creation broadcast already compares shapes; tfdist's check covers the rest.
    assert "Shape mismatch" in text or "models differ" in text, text
    assert "[64,17]" in text or "1285 parameters" in text


@needs_horovod
@pytest.mark.horovod
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_two_horovod_ranks_match_mirrored_strategy(mirrored, horovod_runs, optimizer):
    _check_ranks(horovod_runs[optimizer], _reference(mirrored, optimizer=optimizer),
                 common.make_model().count_params())


@needs_horovod
@pytest.mark.horovod
def test_horovod_accumulation_matches_one_big_batch_step(mirrored, horovod_runs):
    big, _ = common.train("strategy", 2, 128, strategy=mirrored(2), wrap=False)
    out = horovod_runs["accumulation"]
    w0, w1 = (common.load_weights(str(out / f"rank{r}.npz")) for r in (0, 1))
    common.assert_weights_close(w0, w1, rtol=0, atol=0)
    common.assert_weights_close(w0, common.weights(big), rtol=1e-5, atol=1e-6)


@needs_horovod
@pytest.mark.horovod
def test_horovod_mixed_float16_ranks_agree(horovod_runs):
    out = horovod_runs["mixed_float16"]
    w0, w1 = (common.load_weights(str(out / f"rank{r}.npz")) for r in (0, 1))
    common.assert_weights_close(w0, w1, rtol=0, atol=0)
    assert all(np.isfinite(w).all() for w in w0)
    initial = common.weights(common.make_model())
    assert any(not np.allclose(a, b) for a, b in zip(w0, initial)), "no step was applied"


@needs_horovod
@pytest.mark.horovod
def test_mismatched_horovod_rank_fails_fast_with_tfdist_error(worker_cmd, tmp_path):
    start = time.monotonic()
    result = run_horovod(
        [*worker_cmd, "--engine", "horovod", "--out", str(tmp_path), "--mismatch-rank", "1"],
        2, TIMEOUT, env=worker_env())
    assert time.monotonic() - start < 120
    assert result.returncode not in (0, None), result.output[-5000:]
    assert "The workers' models differ" in result.output
    assert "rank 1: 4 variables, 1285 parameters" in result.output


def _assert_identical_and_trained(out):
    w0, w1 = (common.load_weights(str(out / f"rank{r}.npz")) for r in (0, 1))
    common.assert_weights_close(w0, w1, rtol=0, atol=0)
    initial = common.weights(common.make_model(hidden=(64,)))
    assert any(not np.allclose(a, b) for a, b in zip(w0, initial))
    stats = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    dense = 6 * 4 * common.make_model(hidden=(64,)).count_params()
    assert stats[0]["bytes_sent"] == stats[1]["bytes_sent"] < 0.5 * dense


def test_two_tf_config_workers_with_powersgd_end_identical(tf_config_runs):
    _assert_identical_and_trained(tf_config_runs["powersgd"])


def test_multi_worker_compressed_strategy_with_powersgd_ends_identical(worker_cmd, tmp_path):
    results = run_tf_workers(
        [*worker_cmd, "--engine", "multi_worker", "--out", str(tmp_path), "--hidden", "64",
         "--strategy-compressor", POWERSGD], 2, TIMEOUT, env=worker_env())
    assert [r.returncode for r in results] == [0, 0], _outputs(results)
    _assert_identical_and_trained(tmp_path)


@needs_horovod
@pytest.mark.horovod
def test_two_horovod_ranks_with_powersgd_end_identical(horovod_runs):
    _assert_identical_and_trained(horovod_runs["powersgd"])


@needs_horovod
@pytest.mark.horovod
def test_horovod_identity_compressor_equals_plain_synchronous(mirrored, horovod_runs):
    w0 = common.load_weights(str(horovod_runs["identity"] / "rank0.npz"))
    common.assert_weights_close(w0, _reference(mirrored), rtol=0, atol=1e-6)


def _assert_same_auto_pick(out):
    stats = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    picks = [s["auto"] for s in stats]
    assert picks[0]["choice"] in ("powersgd", "fp16", "dense") and picks[0]["decisions"] == 1
    assert picks[0] == picks[1]  # the same pick from the same (all-gathered) numbers
    assert stats[0]["bytes_sent"] == stats[1]["bytes_sent"]
    w0, w1 = (common.load_weights(str(out / f"rank{r}.npz")) for r in (0, 1))
    common.assert_weights_close(w0, w1, rtol=0, atol=0)


def test_auto_exchange_picks_the_same_on_two_tf_config_workers(tf_config_runs):
    _assert_same_auto_pick(tf_config_runs["auto"])


@needs_horovod
@pytest.mark.horovod
def test_auto_exchange_picks_the_same_on_two_horovod_ranks(horovod_runs):
    _assert_same_auto_pick(horovod_runs["auto"])


def test_accordion_decisions_agree_across_tf_config_workers(tf_config_runs):
    out = tf_config_runs["accordion"]
    stats = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert len(stats[0]["decisions"]) == 4 and stats[0]["decisions"] == stats[1]["decisions"]
    assert stats[0]["bytes_sent"] == stats[1]["bytes_sent"]
    w0, w1 = (common.load_weights(str(out / f"rank{r}.npz")) for r in (0, 1))
    common.assert_weights_close(w0, w1, rtol=0, atol=0)


@pytest.mark.parametrize("compressor", ['{"name": "topk", "ratio": 0.01, "error_feedback": true}',
                                        '{"name": "powersgd", "rank": 2}'])
def test_save_then_resume_in_a_new_process_equals_an_uninterrupted_run(tmp_path, compressor):
    import subprocess
    import sys

    script = [sys.executable, f"{ROOT}/tests/workers/resume_worker.py"]
    ckpt, resumed, straight = tmp_path / "mid.keras", tmp_path / "r.npz", tmp_path / "s.npz"
    for args in (["first", str(ckpt), compressor], ["second", str(ckpt), compressor, str(resumed)],
                 ["straight", "-", compressor, str(straight)]):
        out = subprocess.run([*script, *args], capture_output=True, text=True, env=worker_env(),
                             timeout=TIMEOUT)
        assert out.returncode == 0, out.stderr[-4000:]
    common.assert_weights_close(common.load_weights(str(resumed)),
                                common.load_weights(str(straight)), rtol=1e-5, atol=1e-6)


def _assert_local_sgd_ranks(out):
    w0, w1 = (common.load_weights(str(out / f"rank{r}.npz")) for r in (0, 1))
    common.assert_weights_close(w0, w1, rtol=0, atol=1e-7)  # the last step was an averaging round
    stats = json.loads((out / "rank0.json").read_text())
    assert stats["rounds"] == 1 + 2  # 1 warm-up step, then averaging after local steps 3 and 6
    assert stats["bytes_sent"] == pytest.approx(3 * 4 * common.make_model().count_params())


@pytest.fixture(scope="module")
def local_sgd_runs(tmp_path_factory, tf_config_runs):
    """Local SGD (H=3, 7 steps) on 2 TF_CONFIG workers, once with each `step_logs`; the
    output directory of each (the averaged one is a job of `tf_config_runs`)."""
    out = tmp_path_factory.mktemp("local_sgd_local")
    results = run_tf_workers(
        [sys.executable, WORKER, "--engine", "multi_worker", "--out", str(out), "--steps",
         "7", "--local-sgd", "3", "--step-logs", "local"], 2, TIMEOUT, env=worker_env())
    assert [r.returncode for r in results] == [0, 0], _outputs(results)
    return {"averaged": tf_config_runs["local_sgd"], "local": out}


def _logs(out):
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_local_sgd_on_two_tf_config_workers_ends_identical(local_sgd_runs):
    """With step_logs="averaged" (the default, Keras' own) each step's logs are the mean over
    the workers, identical on both."""
    _assert_local_sgd_ranks(local_sgd_runs["averaged"])
    r0, r1 = _logs(local_sgd_runs["averaged"])
    assert len(r0["step_losses"]) == 7 and r0["step_losses"] == r1["step_losses"]
    assert r0["epoch_logs"] == r1["epoch_logs"]


def test_local_sgd_with_local_step_logs_waits_only_for_the_averaging(local_sgd_runs):
    """step_logs="local": the local steps' logs are each worker's own (Keras would average them
    over the workers at every step); the epoch's logs are averaged all the same, and training
    is unchanged (the weights of the averaged-logs run). The averaged run's step losses are the
    mean of the two workers' own."""
    _assert_local_sgd_ranks(local_sgd_runs["local"])
    r0, r1 = _logs(local_sgd_runs["local"])
    assert len(r0["step_losses"]) == 7 and r0["step_losses"] != r1["step_losses"]
    assert r0["epoch_logs"] == r1["epoch_logs"] and len(r0["epoch_logs"]) == 1
    averaged, _ = _logs(local_sgd_runs["averaged"])
    np.testing.assert_allclose(averaged["step_losses"],
                               np.mean([r0["step_losses"], r1["step_losses"]], axis=0), rtol=1e-6)
    np.testing.assert_allclose(averaged["epoch_logs"][0]["loss"], r0["epoch_logs"][0]["loss"],
                               rtol=1e-6)
    for a, b in zip(*(common.load_weights(str(local_sgd_runs[m] / "rank0.npz"))
                      for m in ("averaged", "local"))):
        np.testing.assert_array_equal(a, b)


def test_multi_worker_local_sgd_strategy_ends_identical(worker_cmd, tmp_path):
    results = run_tf_workers(
        [*worker_cmd, "--engine", "multi_worker", "--out", str(tmp_path), "--steps", "7",
         "--strategy-local-sgd", "3"], 2, TIMEOUT, env=worker_env())
    assert [r.returncode for r in results] == [0, 0], _outputs(results)
    _assert_local_sgd_ranks(tmp_path)


@needs_horovod
@pytest.mark.horovod
def test_local_sgd_on_two_horovod_ranks_ends_identical(horovod_runs):
    _assert_local_sgd_ranks(horovod_runs["local_sgd"])


@needs_horovod
@pytest.mark.horovod
def test_hierarchical_local_sgd_on_four_horovod_ranks_as_two_hosts(worker_cmd, tmp_path):
    """Horovod process sets as hosts: ranks {0, 1} and {2, 3} average within their host every 2
    local steps and all together every 4; the run ends on a host round (local step 6)."""
    result = run_horovod(
        [*worker_cmd, "--engine", "horovod", "--out", str(tmp_path), "--steps", "7",
         "--levels", "2,4,2"], 4, TIMEOUT, env=worker_env())
    assert result.returncode == 0, result.output[-5000:]
    w = [common.load_weights(str(tmp_path / f"rank{r}.npz")) for r in range(4)]
    common.assert_weights_close(w[0], w[1], rtol=0, atol=1e-7)
    common.assert_weights_close(w[2], w[3], rtol=0, atol=1e-7)
    assert any(not np.allclose(a, b) for a, b in zip(w[0], w[2]))
    params = 4 * common.make_model().count_params()
    for r in range(4):
        stats = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert stats["rounds"] == 1 + 1 + 2  # warm-up, global round, 2 host rounds
        assert stats["bytes_sent"] == pytest.approx(2 * ring_bytes("all_reduce", params, 4)
                                                    + 2 * ring_bytes("all_reduce", params, 2))


@needs_horovod
@pytest.mark.horovod
@pytest.mark.parametrize(("stage", "offload"), [(1, None), (2, None), (2, "disk")])
def test_zero_on_two_horovod_ranks_matches_adam(mirrored, horovod_runs, stage, offload):
    """tfdist.horovod.ZeroOptimizer(Adam): each rank holds half of Adam's state (on the device or
    in files streamed in 8 KiB chunks); 20 steps equal plain Adam under MirroredStrategy;
    bytes = reduce-scatter + all-gather = a dense all-reduce."""
    out = horovod_runs[_job(f"zero{stage}", offload)]
    w0, w1 = (common.load_weights(str(out / f"rank{r}.npz")) for r in (0, 1))
    common.assert_weights_close(w0, w1, rtol=0, atol=0)
    common.assert_weights_close(w0, _reference(mirrored, steps=20, optimizer="adam"),
                                rtol=1e-5, atol=1e-6)
    shard = -(-common.make_model().count_params() // 2)
    stats = json.loads((out / "rank0.json").read_text())
    assert stats["rounds"] == 20
    assert stats["bytes_sent"] == pytest.approx(20 * (
        ring_bytes("reduce_scatter", 8 * (shard + 1), 2)  # + each shard's non-finite count
        + ring_bytes("all_gather", 4 * shard, 2)))


@pytest.mark.parametrize("engine", [
    "multi_worker", pytest.param("horovod", marks=[needs_horovod, pytest.mark.horovod])])
def test_zero3_on_two_processes_matches_adam(mirrored, request, engine):
    """ZeRO stage 3 (ShardedModel + ZeroOptimizer(Adam, stage=3)) over 2 TF_CONFIG workers or
    2 Horovod ranks: each process holds half of every layer's parameters and Adam's state; 20
    steps equal plain Adam under MirroredStrategy (the weights gathered on both processes)."""
    runs = "horovod_runs" if engine == "horovod" else "tf_config_runs"
    out = request.getfixturevalue(runs)["zero3"]
    w0, w1 = (common.load_weights(str(out / f"rank{r}.npz")) for r in (0, 1))
    common.assert_weights_close(w0, w1, rtol=0, atol=0)
    common.assert_weights_close(w0, _reference(mirrored, steps=20, optimizer="adam"),
                                rtol=1e-5, atol=1e-6)
    assert json.loads((out / "rank0.json").read_text())["rounds"] == 20


@pytest.mark.parametrize(("engine", "offload"), [
    ("multi_worker", None),
    pytest.param("horovod", None, marks=[needs_horovod, pytest.mark.horovod]),
    pytest.param("horovod", "disk", marks=[needs_horovod, pytest.mark.horovod])])
def test_zero_checkpoint_of_two_processes_is_consolidated(mirrored, request, engine, offload):
    """ZeroOptimizer(Adam) on 2 processes == plain Adam. Each process holds half of Adam's
    state; tfdist.callbacks.ModelCheckpoint, passed on every rank, has the save gather the
    halves and only rank 0 write. The file loads on 4 replicas and, trained on, equals 20
    uninterrupted steps of plain Adam."""
    import keras

    import tfdist

    runs = "horovod_runs" if engine == "horovod" else "tf_config_runs"
    out = request.getfixturevalue(runs)[_job("zero_checkpoint", offload)]
    ckpt = out / "ckpt" / "zero.keras"
    w0, w1 = (common.load_weights(str(out / f"rank{r}.npz")) for r in (0, 1))
    common.assert_weights_close(w0, w1, rtol=0, atol=0)
    common.assert_weights_close(w0, _reference(mirrored, steps=10, optimizer="adam"),
                                rtol=1e-5, atol=1e-6)
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["checkpoint"] for r in records] == [str(ckpt)] * 2 and ckpt.is_file()
    # Rank 1 saved too (the save gathers both halves) into a scratch directory, removed at once.
    listings = records[1]["temporary_files"]
    assert listings and not any(n.startswith("tfdist-checkpoint-") for ls in listings for n in ls)

    four = mirrored(4)
    with four.scope():
        model = keras.saving.load_model(ckpt)
    assert type(model.optimizer) is tfdist.ZeroOptimizer  # Horovod's checkpoint, this engine
    assert int(model.optimizer.iterations.numpy()) == 10
    x, y = common.load_digits()
    model.fit(common.distribute(four, x[10 * 32:], y[10 * 32:], 32, shuffle=False), epochs=1,
              steps_per_epoch=10, verbose=0)
    assert model.optimizer.plan.world_size == 4
    common.assert_weights_close(common.weights(model),
                                _reference(mirrored, steps=20, optimizer="adam"),
                                rtol=1e-5, atol=1e-6)


@needs_horovod
@pytest.mark.horovod
def test_zero_save_on_rank_0_alone_fails_clearly(worker_cmd, tmp_path):
    """Horovod's usual `if hvd.rank() == 0: model.save(...)` cannot gather the other ranks'
    shards: it fails after $TFDIST_ZERO_SAVE_TIMEOUT seconds, saying how to save instead."""
    start = time.monotonic()
    result = run_horovod(
        [*worker_cmd, "--engine", "horovod", "--out", str(tmp_path), "--optimizer", "adam",
         "--steps", "2", "--zero", "1", "--save-on-rank0-only", str(tmp_path / "zero.keras")],
        2, TIMEOUT, env={**worker_env(), "TFDIST_ZERO_SAVE_TIMEOUT": "5"})
    assert result.returncode != 0
    assert "did not join within 5 s" in result.output, result.output[-5000:]
    assert "tfdist.callbacks.ModelCheckpoint" in result.output
    assert time.monotonic() - start < TIMEOUT


@needs_horovod
@pytest.mark.horovod
@pytest.mark.parametrize(("kind", "schedule"), [("layer", "gpipe"), ("model", "1f1b")])
def test_pipeline_in_each_of_two_horovod_ranks(tmp_path, kind, schedule):
    """Hybrid parallelism: 2 horovodrun ranks x a 2-stage pipeline over 2 logical devices each.
    The ranks end identical, and equal to one pipeline trained on the global batch."""
    import sys

    worker = [sys.executable, f"{ROOT}/tests/workers/pipeline_worker.py", "--out", str(tmp_path),
              "--kind", kind, "--schedule", schedule, "--steps", "8"]
    result = run_horovod(worker, 2, TIMEOUT, env=worker_env())
    assert result.returncode == 0, result.output[-5000:]
    w0, w1 = (common.load_weights(str(tmp_path / f"rank{r}.npz")) for r in (0, 1))
    common.assert_weights_close(w0, w1, rtol=0, atol=0)
    reference = common.train_pipelined("local", kind, 8, 32, schedule)
    common.assert_weights_close(w0, common.weights(reference), rtol=1e-5, atol=1e-6)


@needs_horovod
@pytest.mark.horovod
def test_checkpoints_load_on_the_other_engine_both_ways(mirrored, tmp_path):
    """One class per algorithm, whatever the engine. Saved under MirroredStrategy(2) after 5
    steps and loaded on 2 Horovod ranks, DistributedOptimizer(Adam, PowerSGD) and
    ZeroOptimizer(Adam, stage 2) train 5 more steps to the weights of 10 uninterrupted steps
    (each rank resumes its own replica's PowerSGD residual and Q, and its own shard). Saved by
    the Horovod ranks, both load under MirroredStrategy as the same classes with their state,
    and train on (ZeRO on 4 replicas: == 15 uninterrupted steps of Adam)."""
    import keras

    import tfdist

    psgd = {"compressor": {"name": "powersgd", "rank": 2}, "min_compress_size": 64}
    straight, _ = common.train("strategy", 10, 32, strategy=mirrored(2), optimizer="adam", **psgd)
    first, _ = common.train("strategy", 5, 32, strategy=mirrored(2), optimizer="adam", **psgd)
    first.save(tmp_path / "powersgd.keras")
    zero_first, _ = common.train("strategy", 5, 32, strategy=mirrored(2), optimizer="adam",
                                 zero_stage=2, fused_update=False)  # compared with Keras' Adam
    zero_first.save(tmp_path / "zero.keras")

    result = run_horovod([sys.executable, f"{ROOT}/tests/workers/cross_engine_worker.py",
                          str(tmp_path), str(tmp_path / "powersgd.keras"),
                          str(tmp_path / "zero.keras")], 2, TIMEOUT, env=worker_env())
    assert result.returncode == 0, result.output[-5000:]
    for r in (0, 1):
        common.assert_weights_close(common.load_weights(str(tmp_path / f"powersgd_rank{r}.npz")),
                                    common.weights(straight), rtol=1e-5, atol=1e-6)
        common.assert_weights_close(common.load_weights(str(tmp_path / f"zero_rank{r}.npz")),
                                    _reference(mirrored, steps=10, optimizer="adam"),
                                    rtol=1e-5, atol=1e-6)

    two = mirrored(2)
    with two.scope():
        back = keras.saving.load_model(tmp_path / "powersgd_horovod.keras")
    assert type(back.optimizer) is tfdist.DistributedOptimizer
    assert isinstance(back.optimizer.compressor, tfdist.compression.PowerSGD)
    assert int(back.optimizer.inner_optimizer.iterations.numpy()) == 10
    q = [v for s in back.optimizer.exchange.compression_state.values() for k, v in s.items()
         if k == "q"]
    assert q and all(np.array_equal(*[c.numpy() for c in v.value.values]) for v in q)
    before = common.weights(back)
    x, y = common.load_digits()
    back.fit(common.distribute(two, x[10 * 32:], y[10 * 32:], 32, shuffle=False), epochs=1,
             steps_per_epoch=2, verbose=0)
    assert all(np.isfinite(w).all() for w in common.weights(back))
    assert any(not np.allclose(a, b) for a, b in zip(before, common.weights(back)))

    four = mirrored(4)
    with four.scope():
        zero = keras.saving.load_model(tmp_path / "zero_horovod.keras")
    assert type(zero.optimizer) is tfdist.ZeroOptimizer
    zero.fit(common.distribute(four, x[10 * 32:], y[10 * 32:], 32, shuffle=False), epochs=1,
             steps_per_epoch=5, verbose=0)
    common.assert_weights_close(common.weights(zero),
                                _reference(mirrored, steps=15, optimizer="adam"),
                                rtol=1e-5, atol=1e-6)


@needs_horovod
@pytest.mark.horovod
@pytest.mark.parametrize("mode, message", [
    ("steps", "steps per epoch: rank 0: 4, rank 1: 3"),
    ("compressor", "optimizer configuration (digest): rank 0: 0x"),
])
def test_horovod_ranks_with_different_jobs_stop_with_a_message(tmp_path, mode, message):
    """Before, ranks with different steps per epoch hung forever in MetricAverage, and a
    compressor on one rank only desynchronised the collectives: now every rank stops at once,
    naming what differs on which rank."""
    worker = os.path.join(ROOT, "tests", "workers", "mismatch_worker.py")
    start = time.monotonic()
    result = run_horovod([sys.executable, worker, mode], 2, TIMEOUT, env=worker_env())
    assert time.monotonic() - start < 120
    assert result.returncode not in (0, None), result.output[-5000:]
    assert "The workers' training setups differ" in result.output
    assert message in result.output, result.output[-5000:]


FROZEN_WORKER = os.path.join(ROOT, "tests", "workers", "frozen_worker.py")


@needs_horovod
@pytest.mark.horovod
def test_a_frozen_horovod_rank_is_named_and_the_job_ends(tmp_path):
    """Horovod's peers of a stopped rank wait forever; with tfdist.callbacks.Watchdog the rank
    that waits ends itself after the timeout, naming the silent rank from the heartbeats, which
    cross through Horovod's rendezvous store (no directory is shared)."""
    from tfdist.callbacks import WATCHDOG_EXIT

    start = time.monotonic()
    env = {k: v for k, v in worker_env().items() if k != "TFDIST_HEARTBEAT_DIR"}
    result = run_horovod([sys.executable, FROZEN_WORKER, "--engine", "horovod", "--freeze-rank",
                          "1", "--timeout", "8"], 2, TIMEOUT, env=env)
    assert time.monotonic() - start < 150, result.output[-3000:]
    out = result.output
    assert result.returncode not in (0, None), out[-3000:]
    assert "rank 1: stalling at step 4" in out and "finished" not in out, out[-3000:]
    assert "tfdist.Watchdog: rank 0 of 2: training step 4 has run for more than 8 s" in out, \
        out[-3000:]
    assert "rank 1 (pid " in out and "(frozen or dead)" in out, out[-3000:]
    assert f"exit code {WATCHDOG_EXIT}" in out


def test_a_step_that_runs_too_long_ends_the_process_with_a_message(tmp_path):
    import subprocess

    from tfdist.callbacks import WATCHDOG_EXIT

    start = time.monotonic()
    result = subprocess.run([sys.executable, FROZEN_WORKER, "--engine", "single", "--timeout",
                             "3"], capture_output=True, text=True, timeout=TIMEOUT,
                            env=worker_env())
    assert time.monotonic() - start < 50  # the step sleeps for 60 s
    assert result.returncode == WATCHDOG_EXIT, result.stderr[-3000:]
    assert "training step 4 has run for more than 3 s. Ending this process" \
        in result.stderr, result.stderr[-3000:]
