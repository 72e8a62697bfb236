"""End to end: the `tfdist` command in fresh processes, as a user runs it."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT, horovod_available, worker_env
from tfdist.tools.launch import run_horovod, run_tf_workers

TFDIST = [sys.executable, "-m", "tfdist.tools.cli"]


def _run(args, timeout=300, env=None):
    return subprocess.run([*TFDIST, *args], capture_output=True, text=True, cwd=ROOT,
                          env=env or worker_env(), timeout=timeout)


def _user_env() -> dict[str, str]:
    """A user's environment: the test rig's TF_CPP_MIN_LOG_LEVEL left out."""
    return {k: v for k, v in worker_env().items() if k != "TF_CPP_MIN_LOG_LEVEL"}


def _scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_train_default_config_keeps_each_run_quietly(tmp_path):
    """The main job: accuracy and bytes printed; each run in a new directory with its config,
    summary, a model that loads compiled in plain Keras, and TensorBoard scalars (loss, accuracy,
    learning rate, bytes); at most 10 lines on stderr. A name holding a finished run is refused."""
    import keras

    args = ["train", "--config", "configs/default.yaml", "--set", "train.epochs=2",
            "--set", f"train.output_dir={tmp_path}"]
    first = _run(args, env=_user_env())
    assert first.returncode == 0, first.stderr[-4000:]
    assert "test accuracy" in first.stdout and "bytes sent/step" in first.stdout
    assert "collectives/step  1.00" in first.stdout
    assert "to the end of the first step (imports" in first.stdout
    assert len(first.stderr.strip().splitlines()) <= 10, first.stderr
    (run,) = (p for p in tmp_path.iterdir() if p.is_dir())
    assert str(run) in first.stdout
    assert {p.name for p in run.iterdir()} >= {"config.yaml", "summary.json", "model.keras",
                                               "tensorboard"}
    summary = json.loads((run / "summary.json").read_text())
    assert summary["test_accuracy"] > 0.8
    assert summary["bytes_sent_per_step"] == summary["gradient_bytes_per_round"]  # N=2
    assert summary["communication_rounds"] == summary["steps"]
    # Start-up: the parts are measured (imports take > 1 s; the first step traces) and add up
    # to the total printed.
    up = summary["startup_seconds"]
    assert up["before_train"] > 1.0 and up["setup"] > 0 and up["first_step"] > 0
    assert up["fit_before_first_step"] >= 0
    parts = sum(v for k, v in up.items() if k != "total")
    assert up["total"] == pytest.approx(parts, abs=0.005)
    # The machine's cores busy during the timed steps: training kept some busy, no more than all
    # (counted in 10 ms ticks per core, over epochs of a fraction of a second here).
    load = summary["machine_load"]
    assert load["cores"] == os.cpu_count() and 0 < load["busy_cores"] <= 1.2 * load["cores"]
    scalars = _scalars(run)
    assert len(scalars["loss"]) == 2 and scalars["loss"][1] < scalars["loss"][0]
    assert len(scalars["accuracy"]) == 2 and scalars["learning_rate"] == [
        pytest.approx(0.002)] * 2
    assert scalars["bytes_per_step"] == [summary["bytes_sent_per_step"]] * 2
    model = keras.saving.load_model(run / "model.keras")  # compiled, with Keras' Adam
    assert type(model.optimizer) is keras.optimizers.Adam
    assert model.optimizer.get_config()["learning_rate"] == pytest.approx(0.002)
    refused = _run([*args, "--set", f"train.run_name={run.name}"])
    assert refused.returncode == 2 and "holds a finished run" in refused.stderr
    # The same command again: a run of its own, in a new directory, beside the first.
    loud = _run([*args, "--set", "train.epochs=1", "--verbose"], env=_user_env())
    assert loud.returncode == 0 and len(loud.stderr.strip().splitlines()) > 3  # TF's own lines
    (other,) = (p for p in tmp_path.iterdir() if p.is_dir() and p != run)
    assert str(other) in loud.stdout
    assert json.loads((other / "summary.json").read_text())["steps"] == summary["steps"] // 2


def test_train_zero_config_keeps_the_optimizer_state_on_the_host(tmp_path):
    out = _run(["train", "--config", "configs/zero.yaml", "--set", "train.epochs=2",
                "--set", f"train.output_dir={tmp_path}", "--set", "train.run_name=run",
                "--set", "train.verbose=0"])
    assert out.returncode == 0, out.stderr[-4000:]
    assert "ZeRO stage 2, offload cpu" in out.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    p = summary["trainable_parameters"]
    assert summary["optimizer_state_bytes"] == {"host": 2 * 2 * 4 * (-(-p // 2))}  # m, v; 2 shards
    assert summary["test_accuracy"] > 0.8


def test_train_zero_stage_3_shards_the_model_and_saves_it_whole(tmp_path):
    """optimizer.zero_stage 3: the model is a ShardedModel; bytes are 1.5x a dense all-reduce's
    (2 all-gathers + 1 reduce-scatter, plus one non-finite flag per step); model.keras is the
    unsharded model, which evaluates as the run's test accuracy says."""
    out = _run(["train", "--config", "configs/zero.yaml", "--set", "train.epochs=2",
                "--set", "optimizer.zero_stage=3", "--set", "optimizer.offload=null",
                "--set", f"train.output_dir={tmp_path}", "--set", "train.run_name=run",
                "--set", "train.verbose=0"])
    assert out.returncode == 0, out.stderr[-4000:]
    assert "ZeRO stage 3" in out.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["bytes_ratio_vs_dense"] == pytest.approx(1.5, abs=1e-4)
    assert summary["test_accuracy"] > 0.8
    import keras

    model = keras.saving.load_model(tmp_path / "run" / "model.keras", compile=False)
    assert model.count_params() == summary["parameters"]


def test_train_rejects_a_bad_config_before_training(tmp_path):
    out = _run(["train", "--set", "train.epochs=0", "--set", "optimizer.name=adagrad"])
    assert out.returncode == 2
    assert "train.epochs: got 0" in out.stderr and "optimizer.name: got 'adagrad'" in out.stderr
    assert "Epoch" not in out.stdout


def test_unknown_command_is_a_usage_error():
    out = _run(["fit"])
    assert out.returncode == 2 and "invalid choice: 'fit'" in out.stderr
    assert "train" in out.stderr and "bench" in out.stderr  # what to type instead


def _console_script() -> str:
    import shutil

    script = Path(sys.executable).with_name("tfdist")
    return str(script) if script.exists() else shutil.which("tfdist")


@pytest.mark.parametrize("args, expected", [
    (["--help"], ["train", "bench", "info"]),
    (["bench", "--help"], ["engines", "compression", "local_sgd", "memory", "pipeline", "comm"]),
    (["train", "--help"], ["--config", "--set", "--verbose"]),
])
def test_help_answers_at_once_without_tensorflow(args, expected):
    """`tfdist --help` comes from the parser alone: the installed command answers in a fraction of
    the ~4 s TensorFlow's import takes, and TensorFlow is not imported."""
    import time

    probe = ("import runpy, sys; sys.argv = ['tfdist', *sys.argv[1:]]\n"
             "try:\n    runpy.run_module('tfdist.tools.cli', run_name='__main__')\n"
             "except SystemExit:\n    pass\n"
             "print('TENSORFLOW' if 'tensorflow' in sys.modules else 'NO-TENSORFLOW')")
    out = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True,
                         cwd=ROOT, env=worker_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("NO-TENSORFLOW")
    assert all(word in out.stdout for word in expected)
    start = time.perf_counter()
    timed = subprocess.run([_console_script(), *args], capture_output=True, text=True,
                           env=worker_env(), timeout=60)
    assert timed.returncode == 0 and all(word in timed.stdout for word in expected)
    assert time.perf_counter() - start < 3.0


def test_a_bad_config_is_refused_before_tensorflow_loads_with_the_near_names():
    """A config mistake is answered from the schema alone (no TensorFlow import: ~0.2 s instead
    of seconds), each misspelt name with the one meant."""
    probe = ("import runpy, sys; sys.argv = ['tfdist', *sys.argv[1:]]\n"
             "try:\n    runpy.run_module('tfdist.tools.cli', run_name='__main__')\n"
             "except SystemExit as e:\n    print('EXIT', e.code)\n"
             "print('TENSORFLOW' if 'tensorflow' in sys.modules else 'NO-TENSORFLOW')")
    out = subprocess.run([sys.executable, "-c", probe, "train", "--set", "compression.name=topkk",
                          "--set", "engine.name=mirored", "--set", "model.name=cn"],
                         capture_output=True, text=True, cwd=ROOT, env=worker_env(), timeout=60)
    assert out.stdout.split() == ["EXIT", "2", "NO-TENSORFLOW"], out.stdout + out.stderr
    for line in ("compression.name: got 'topkk'", "(did you mean 'topk'?)",
                 "engine.name: got 'mirored'", "(did you mean 'mirrored'?)",
                 "model.name: got 'cn'", "(did you mean 'cnn'?)"):
        assert line in out.stderr, out.stderr


def test_info_lists_versions_and_engines():
    out = _run(["info"])
    assert out.returncode == 0, out.stderr[-3000:]
    info = json.loads(out.stdout[out.stdout.index("{"):])
    assert info["tensorflow"].startswith("2.21") and info["keras"].startswith("3.15")
    assert info["engines"]["horovod"] == horovod_available()
    advice = info["engine_for_several_hosts"]  # no GPU here
    assert advice["name"] == ("horovod" if horovod_available() else "multi_worker")
    assert "collectives" in advice["why"]


def test_the_engine_advice_follows_the_devices_and_the_horovod_build():
    from tfdist.tools.cli import engine_advice

    assert engine_advice(gpus=False, gloo=True)["name"] == "horovod"
    assert engine_advice(gpus=False, gloo=False)["name"] == "multi_worker"
    assert "build_horovod" in engine_advice(gpus=False, gloo=False)["why"]
    assert engine_advice(gpus=True, gloo=True)["name"] == "multi_worker"


USER_MODULE = """
import keras
import numpy as np


def build(input_shape, num_classes, width=32):
    inputs = keras.Input(input_shape)
    h = keras.layers.Dense(width, activation="relu")(keras.layers.Flatten()(inputs))
    return keras.Model(inputs, keras.layers.Dense(num_classes, activation="softmax")(h))


def regressor(input_shape):
    inputs = keras.Input(input_shape)
    return keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Dense(8)(inputs)))


def line(n=512, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]]) + 0.1).astype("float32")
    return (x[: n - 128], y[: n - 128]), (x[n - 128:], y[n - 128:])


def blobs(n=1024, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n).astype("int32")
    x = (rng.normal(size=(n, 6)) + 3.0 * np.eye(3, 6)[y]).astype("float32")
    return (x[: n - 256], y[: n - 256]), (x[n - 256:], y[n - 256:])
"""


@pytest.mark.multiprocess
def test_your_own_model_and_data_train_on_two_tf_config_workers(tmp_path):
    """model.name / data.name as module.path:function, through the launcher on 2 workers."""
    (tmp_path / "mine.py").write_text(USER_MODULE)
    env = {**worker_env(), "PYTHONPATH": f"{ROOT}:{tmp_path}"}
    results = run_tf_workers(
        [*TFDIST, "train", "--set", "engine.name=multi_worker", "--set", "train.epochs=3",
         "--set", "model.name=mine:build", "--set", "model.options={width: 16}",
         "--set", "data.name=mine:blobs", "--set", f"train.output_dir={tmp_path / 'runs'}",
         "--set", "train.run_name=run", "--set", "optimizer.learning_rate=0.01",
         "--set", "train.profile_step=4"],
        2, 300, env=env)
    assert [r.returncode for r in results] == [0, 0], results[0].output[-3000:]
    run = tmp_path / "runs" / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["test_accuracy"] > 0.9
    assert summary["trainable_parameters"] == 6 * 16 + 16 + 16 * 3 + 3  # width=16, 3 classes
    assert "Epoch 3/3" in results[0].output  # a line per epoch under the launcher
    # train.profile_step: the chief's timeline of step 4 holds the step's all-reduce (one
    # collective op per call on one replica), within the step, and every kind of work
    timeline = json.loads((run / "timeline.json").read_text())
    assert timeline["step"] == 4 and summary["timeline"]["step"] == 4
    assert len(timeline["collectives"]) == summary["collectives_per_step"] == 1
    assert {c["op"] for c in timeline["collectives"]} == {"CollectiveReduceV2"}
    assert all(0 <= c["start_ms"] <= c["end_ms"] <= timeline["span_ms"]
               for c in timeline["collectives"])
    assert all(timeline["busy_ms"][k] > 0 for k in ("forward", "backward", "update"))
    assert timeline["exposed_communication_ms"] + timeline["overlapped_communication_ms"] == \
        pytest.approx(timeline["communication_ms"])
    assert (run / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_the_console_script_imports_your_own_module_from_the_working_directory(tmp_path):
    """`tfdist train --set model.name=mine:build ...` run from the folder that holds mine.py,
    with no PYTHONPATH, trains (as `python -m` would find it)."""
    (tmp_path / "mine.py").write_text(USER_MODULE)
    env = {k: v for k, v in worker_env().items() if k != "PYTHONPATH"}
    done = subprocess.run([_console_script(), "train", "--set", "model.name=mine:build",
                           "--set", "data.name=mine:blobs", "--set", "train.epochs=1",
                           "--set", "train.run_name=run"], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "runs" / "default" / "run" / "summary.json").is_file()


def test_a_regression_is_reported_with_its_loss_and_metrics(tmp_path):
    """train.loss=mse on float targets: the end lines and summary.json give the test loss and
    mae (the task's default metric), no accuracy; the test loss is what plain Keras computes for
    the saved model on the same test set."""
    import keras
    import numpy as np

    (tmp_path / "mine.py").write_text(USER_MODULE)
    env = {**worker_env(), "PYTHONPATH": f"{ROOT}:{tmp_path}"}
    out = _run(["train", "--set", "model.name=mine:regressor", "--set", "data.name=mine:line",
                "--set", "train.loss=mse", "--set", "train.epochs=2", "--set",
                "data.global_batch_size=32", "--set", f"train.output_dir={tmp_path}",
                "--set", "train.run_name=run"], env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "test mae" in out.stdout and "test loss" in out.stdout
    assert "accuracy" not in out.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["test_accuracy"] is None and set(summary["test_metrics"]) == {"mae"}
    sys.path.insert(0, str(tmp_path))
    try:
        import mine
    finally:
        sys.path.remove(str(tmp_path))
    _, (x, y) = mine.line()
    model = keras.saving.load_model(tmp_path / "run" / "model.keras")
    predicted = np.asarray(model(x))
    assert summary["test_loss"] == pytest.approx(float(np.mean((predicted - y) ** 2)), rel=1e-5)
    assert summary["test_metrics"]["mae"] == pytest.approx(
        float(np.mean(np.abs(predicted - y))), rel=1e-5)


def test_a_mistyped_config_file_gets_a_did_you_mean(tmp_path):
    out = _run(["train", "--config", "configs/defualt.yaml"])
    assert out.returncode == 2
    assert "Did you mean configs/default.yaml?" in out.stderr
    assert "default.yaml, dgc.yaml" in out.stderr  # the shipped configs listed


def test_a_missing_user_function_is_named(tmp_path):
    out = _run(["train", "--set", "model.name=nowhere.models:build",
                "--set", f"train.output_dir={tmp_path}"])
    assert out.returncode == 2 and "cannot import module 'nowhere.models'" in out.stderr
    out = _run(["train", "--set", "model.name=resnet"])
    assert out.returncode == 2 and "or your own function as 'module.path:function'" in out.stderr


def test_your_own_dataset_with_labels_past_its_classes_is_said_in_one_line(tmp_path, capsys,
                                                                            monkeypatch):
    """A tf.data dataset of one's own with 20 classes, trained without data.num_classes (so
    10): one line naming data.num_classes and the fix, where TensorFlow's error of the loss
    was a traceback."""
    from tfdist.tools.cli import main

    (tmp_path / "twenty_classes.py").write_text(
        "import tensorflow as tf\n\n\ndef data(seed):\n"
        "    ds = tf.data.Dataset.range(640).map(\n"
        "        lambda k: (tf.fill([4], tf.cast(k, tf.float32)), tf.cast(k % 20, tf.int32)))\n"
        "    return ds.skip(128), ds.take(128)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["train", "--set", "data.name=twenty_classes:data", "--set", "model.name=mlp",
                 "--set", "train.steps_per_epoch=4", "--set", "engine.name=single", "--set",
                 f"train.output_dir={tmp_path / 'out'}", "--set", "train.verbose=0"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().splitlines() == [
        "tfdist train: data.name: twenty_classes:data gave a label outside the model's 10 "
        "classes (below 0, or 10 or more: data.num_classes); set data.num_classes to the number "
        "of classes"], err
    # Integer targets of a regression (a loss other than sparse crossentropy) are no classes.
    from tfdist.tools.config import load_config
    from tfdist.tools.workload import load_data

    data = load_data(load_config(None, ["data.name=twenty_classes:data", "train.loss=mse"]))
    labels = np.concatenate([y for _, y in data.global_batches(64, seed=0).take(8)])
    assert sorted(set(labels.tolist())) == list(range(20))


PLAIN_KERAS_LOAD = """
import sys
from pathlib import Path
import numpy as np
sys.modules["tfdist"] = None  # as on a server without tfdist
import keras
for name in sys.argv[1:]:
    model = keras.saving.load_model(f"{name}/model.keras")
    assert type(model.optimizer).__module__.startswith("keras."), type(model.optimizer)
    np.savez(f"{name}/weights.npz", *model.get_weights())
"""


@pytest.mark.multiprocess
def test_the_dense_job_trains_on_the_same_batches_on_every_engine(tmp_path):
    """The sequence of global batches is a pure function of (seed, epoch), shuffled: one
    device, 2 devices, 2 TF_CONFIG workers and 2 Horovod ranks end with the same weights (plain
    Keras gives one device and MirroredStrategy the same weights too)."""

    def job(engine):
        return [*TFDIST, "train", "--set", f"engine.name={engine}", "--set", "train.epochs=2",
                "--set", "model.name=mlp", "--set", f"train.output_dir={tmp_path}",
                "--set", f"train.run_name={engine}", "--set", "train.verbose=0"]

    for engine in ("single", "mirrored"):
        out = subprocess.run(job(engine), capture_output=True, text=True, cwd=ROOT,
                             env=worker_env(), timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
    workers = run_tf_workers(job("multi_worker"), 2, 300, env=worker_env())
    assert [r.returncode for r in workers] == [0, 0], workers[0].output[-3000:]
    engines = ["single", "mirrored", "multi_worker"]
    if horovod_available():
        result = run_horovod(job("horovod"), 2, 300, env=worker_env())
        assert result.returncode == 0, result.output[-3000:]
        engines.append("horovod")
    # Each model.keras loads, compiled, in plain Keras: tfdist cannot be imported there.
    loaded = subprocess.run([sys.executable, "-c", PLAIN_KERAS_LOAD, *engines],
                            capture_output=True, text=True, cwd=tmp_path, timeout=300,
                            env={k: v for k, v in worker_env().items() if k != "PYTHONPATH"})
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    weights = {}
    for engine in engines:
        summary = json.loads((tmp_path / engine / "summary.json").read_text())
        assert summary["engine"] == engine and summary["test_accuracy"] > 0.7
        assert summary["world_size"] == (1 if engine == "single" else 2)
        with np.load(tmp_path / engine / "weights.npz") as saved:
            weights[engine] = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    for engine in engines[1:]:
        for a, b in zip(weights["single"], weights[engine], strict=True):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=engine)


@pytest.mark.multiprocess
def test_bench_engines_writes_table_and_json(tmp_path):
    out = _run(["bench", "--suite", "engines", "--steps", "2", "--repeats", "1",
                "--out", str(tmp_path)], timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "engines.json").read_text())
    engines = [r["engine"] for r in result["rows"]]
    assert engines[0].endswith("(baseline)") and len(engines) == (4 if horovod_available() else 3)
    params = result["rows"][0]["parameters"]
    for row in result["rows"][1:]:
        assert row["step_ms"] > 0
        assert row["bytes_per_step"] == pytest.approx(4 * params)  # 2 workers: 2(N-1)/N = 1
    table = (tmp_path / "engines.md").read_text()
    assert table.count("\n| ") == len(engines) + 1 and "ratio vs baseline" in table
    assert (tmp_path / "engines.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_pipeline_quick_writes_measured_table(tmp_path):
    out = _run(["bench", "--suite", "pipeline", "--quick", "--out", str(tmp_path)], timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads((tmp_path / "pipeline.json").read_text())["rows"]
    assert [(r["schedule"], r["k"]) for r in rows] == [
        ("one device", 1), ("gpipe", 2), ("1f1b", 2), ("gpipe", 4), ("1f1b", 4)]
    for r in rows[1:]:
        assert len(r["idle"]) == r["k"] and all(0 <= f < 1 for f in r["idle"])
        assert r["bubble"] == pytest.approx((r["k"] - 1) / (r["m"] + r["k"] - 1))
        expected = [r["m"]] * r["k"] if r["schedule"] == "gpipe" else \
            [min(r["k"] - j, r["m"]) for j in range(r["k"])]
        assert r["microbatches_kept"] == expected
        assert all(a < b for a, b in zip(r["activation_bytes_remat"],
                                          r["activation_bytes_no_remat"]))
    assert "| gpipe | 4 | 4 |" in (tmp_path / "pipeline.md").read_text()
    assert (tmp_path / "pipeline.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_compressors_times_every_compressor(tmp_path, monkeypatch):
    """The suite's loopback exchange (small tensors here, to be quick): one row per compressor,
    what 2 workers sending this worker's payload would reduce to."""
    import tensorflow as tf

    from tfdist import compression
    from tfdist.comm import reduce_encoded
    from tfdist.tools.bench import compressors
    from tfdist.tools.bench.suites import run_suite

    comm = compressors.LoopbackCommunicator(2)
    x = tf.constant(np.random.RandomState(0).randn(64, 32).astype("float32"))
    (total,), _ = reduce_encoded(compression.get("fp16"), [x], [{}], tf.constant(0, tf.int64), comm)
    np.testing.assert_allclose(total, 2 * x.numpy(), rtol=1e-3)
    gathered = comm.all_gather(x[None])
    assert gathered.shape == (2, 64, 32) and np.array_equal(gathered[1], x)

    monkeypatch.setattr(compressors, "SHAPES", [(96, 64), (64,), (64, 10)])
    rows = run_suite("compressors", quick=True, out=str(tmp_path))
    assert [r["compressor"] for r in rows] == [name for name, _ in compressors.COMPRESSORS]
    megabytes = 96 * 64 * 4 / 1e6  # only the matrix of >= 1,024 elements is compressed
    for r in rows:
        assert r["ms"] > 0 and r["megabytes"] == pytest.approx(megabytes)
        assert r["ms_per_mb"] == pytest.approx(r["ms"] / megabytes)
    table = (tmp_path / "compressors.md").read_text()
    assert table.count("\n| ") == len(rows) + 1 and "| powersgd rank 2 |" in table
    assert (tmp_path / "compressors.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_compressors_in_processes_at_once():
    """`--suite compressors --hosts 2`: two processes time the same exchanges at once, each over
    a loopback of 2 workers; a process that fails is named, with its error, and none is left."""
    import multiprocessing

    from tfdist.tools.bench import compressors
    from tfdist.tools.bench.suites import run_suite

    shapes = [(96, 64), (64, 10)]
    chosen = [("fp16", {"name": "fp16"}), ("ef_topk 1%", {"name": "topk", "ratio": 0.01})]
    lines = []
    rows = compressors.shared_rows(2, quick=True, progress=lines.append, compressors=chosen,
                                   shapes=shapes)
    assert [r["compressor"] for r in rows] == ["fp16", "ef_topk 1%"]
    for r in rows:
        assert r["processes"] == r["workers"] == 2  # the shapes given: all exchanged
        assert r["megabytes"] == (96 * 64 + 64 * 10) * 4 / 1e6
        assert 0 < r["ms"] <= r["slowest_ms"] and r["ms_per_mb"] == r["ms"] / r["megabytes"]
    assert lines[0].startswith("bench: compressors: 2 processes at once") and len(lines) == 3
    assert "| processes at once |" in compressors.compressor_table(rows)

    with pytest.raises(RuntimeError, match=r"process \d failed: ValueError: .*'zip'"):
        compressors.shared_rows(2, quick=True, progress=lines.append,
                                compressors=[("zip", "zip")], shapes=shapes)
    assert not multiprocessing.active_children()
    with pytest.raises(ValueError, match="at least 2"):
        compressors.compressor_rows(processes=["1"])
    with pytest.raises(ValueError, match="--hosts does not apply to the memory suite"):
        run_suite("memory", processes=["2"])


@pytest.mark.parametrize("steps, repeats", [(0, 2), (4, 0), (-1, 2)])
def test_bench_refuses_steps_or_repeats_below_one(steps, repeats, tmp_path):
    """0 is refused, not read as "the default" (`tfdist bench --suite overhead --steps 0` ran
    30 steps 7 times)."""
    from tfdist.tools.bench.suites import run_suite

    with pytest.raises(ValueError, match=f"must be >= 1. Received: {steps}, {repeats}"):
        run_suite("overhead", steps=steps, repeats=repeats, out=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_bench_overhead_reaches_keras_weights(tmp_path, monkeypatch):
    """The overhead suite (a small MLP here, to be quick): one row per optimizer, each trained
    the same steps on the same batches; in a world of one the dense wrapper and local SGD's
    local steps reach Keras' weights: exactly with Keras' update and with SGD's fused kernel,
    to float32 rounding where XLA compiles the update."""
    from tfdist.tools.bench import overhead
    from tfdist.tools.bench.suites import run_suite

    monkeypatch.setattr(overhead, "HIDDEN", (32,))
    monkeypatch.setattr(overhead, "UPDATE_MODELS", (("mlp", (64,), 10, (32,)),))
    rows = run_suite("overhead", steps=4, repeats=2, out=str(tmp_path))
    assert [r["variant"] for r in rows] == [key for key, *_ in overhead.VARIANTS]
    parameters = 64 * 32 + 32 + 32 * 10 + 10
    by_key = {r["variant"]: r for r in rows}
    for r in rows:
        base = by_key[r["baseline"]]
        assert r["parameters"] == parameters and len(r["repeat_ms"]) == 2
        assert r["step_ms"] > 0 and base["optimizer"] == r["optimizer"]
        assert r["overhead_ms"] == pytest.approx(r["step_ms"] - base["step_ms"])
        rounding = r["variant"] in ("dense_adam", "dense_xla")
        assert r["max_weight_diff"] < 1e-5 if rounding else r["max_weight_diff"] == 0, r
        assert r["loss"] == pytest.approx(base["loss"], abs=1e-5)
    assert [r["variant"] for r in rows if r["baseline"] == r["variant"]] == ["keras", "keras_adam"]
    # the update alone: Keras' update, the fused one alone and through the wrapper, Keras'
    # through the wrapper, per optimizer, from the same weights with the same gradients
    updates = json.loads((tmp_path / "overhead.json").read_text())["update_rows"]
    assert [(r["optimizer"], r["variant"]) for r in updates] == [
        (name, key) for name in ("sgd", "adam") for key, *_ in overhead.UPDATE_VARIANTS]
    for r in updates:
        assert r["parameters"] == parameters and r["variables"] == 4
        assert r["update_ms"] > 0 and len(r["repeat_ms"]) == 2
        exact = r["variant"] == "keras_update" or r["variant"] in ("alone", "fused", "flat") and \
            r["optimizer"] == "sgd"
        assert r["max_weight_diff"] == 0 if exact else r["max_weight_diff"] < 1e-5, r
    # Adam's fused update is its arithmetic compiled by XLA, alone, in the wrapper, and once
    # over all parameters (the flat bound) alike
    diffs = {(r["optimizer"], r["variant"]): r["max_weight_diff"] for r in updates}
    assert diffs["adam", "alone"] == diffs["adam", "fused"] == diffs["adam", "xla"] == \
        diffs["adam", "flat"]
    assert [r["speedup"] for r in updates if r["variant"] == "keras"] == [1.0, 1.0]
    table = (tmp_path / "overhead.md").read_text()
    assert table.count("\n| ") == len(rows) + len(updates) + 2
    assert "local SGD (local steps)" in table and "fused update (with its non-finite check)" in table
    assert (tmp_path / "overhead.png").read_bytes()[:4] == b"\x89PNG"


def test_every_suite_draws_its_rows(tmp_path):
    """The compression, local SGD and memory suites' plots, from rows shaped as those suites
    write them (the suites themselves take minutes; their tables are in docs/benchmarks.md)."""
    from tfdist.tools.bench import plots

    compression = [{"compressor": name, "ratio_vs_dense": ratio, "test_accuracy": acc}
                   for name, ratio, acc in (("dense", 1.0, 0.99), ("EF-topk", 0.03, 0.98))]
    local_sgd = [{"devices": 2, "run": run, "rounds": rounds, "test_accuracy": acc}
                 for run, rounds, acc in (("sync", 330, 0.98), ("H=8", 60, 0.98))]
    memory = [{"replicas": n, "baseline": 16e6, "zero1": 9e6 / n, "zero2": 10e6 / n,
               "zero3": 8e6 / n, "formula_zero2": 10e6 / n} for n in (1, 2, 4)]
    for name, rows in (("compression", compression), ("local_sgd", local_sgd),
                       ("memory", memory)):
        path = getattr(plots, name)(rows, tmp_path / f"{name}.png")
        assert path.read_bytes()[:4] == b"\x89PNG" and path.stat().st_size > 10_000


@pytest.mark.parametrize("overrides, message", [
    (["data.global_batch_size=4096"], "data.global_batch_size: 4096 is larger than the training "
                                      "set (1438 examples); use at most 1438."),
    (["train.loss=mean_squared_eror"], "train.loss: Keras knows no loss 'mean_squared_eror' (did "
                                       "you mean 'mean_squared_error'?)"),
    (["train.loss=mse"], "train.loss: 'mse' compares the model's output (shape (None, 10)) with "
                         "labels of one value per example"),
    (["data.test_fraction=1e-6"], "data.test_fraction: 1e-06 leaves no test example"),
    (["train.metrics=[accuracy, maee]"], "train.metrics: Keras knows no metric 'maee' (did you "
                                         "mean 'mae'?)"),
    (["train.profile_step=1000", "train.epochs=2"],
     "train.profile_step: 1000 is past the run's last step (44 = 22 steps x 2 epochs); use at "
     "most 44."),
    (["data.name=synthetic", "data.input_shape=[12]"],
     "model.name 'cnn' takes images (height, width, channels); the data's examples are of shape "
     "(12,): use mlp or transformer (model.name), or a model of your own"),
    (["model.name=resnet50"], "model.name 'resnet50' takes images of at least 32 x 32 (height, "
                              "width, channels); the data's examples are of shape (8, 8, 1): use "
                              "mlp or cnn (model.name)"),
])
def test_values_known_wrong_once_the_data_is_loaded_are_one_line_errors(
        tmp_path, capsys, overrides, message):
    from tfdist.tools.cli import main

    args = ["train", "--set", f"train.output_dir={tmp_path}", "--set", "engine.name=single"]
    code = main([*args, *(a for o in overrides for a in ("--set", o))])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())  # no run directory for a job that never started


def test_a_run_stopped_by_non_finite_gradients_says_so_in_one_line(tmp_path, capsys):
    from tfdist.tools.cli import main

    code = main(["train", "--set", f"train.output_dir={tmp_path}", "--set", "engine.name=single",
                 "--set", "optimizer.learning_rate=1e6", "--set", "train.epochs=1",
                 "--set", "train.verbose=0"])
    err = capsys.readouterr().err
    assert code == 1
    assert "tfdist train: non-finite gradients at optimizer step" in err, err
    assert "optimizer.nan_policy=skip" in err and "Traceback" not in err


def test_a_run_out_of_memory_says_so_in_one_line(tmp_path):
    """A model whose 8192 x 8192 kernel (256 MB) outgrows the memory TensorFlow may use (a
    64 MB ceiling on its CPU pool) stops with a line naming the tensor and what to lower."""
    env = {**worker_env(), "TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPU_BFC_MEM_LIMIT_IN_MB": "64"}
    out = _run(["train", "--set", f"train.output_dir={tmp_path}", "--set", "engine.name=single",
                "--set", "model.hidden=[8192, 8192]", "--set", "train.epochs=1"], env=env)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "tfdist train: out of memory: a float tensor of shape [" in out.stderr, out.stderr
    assert "8192] did not fit on CPU:0" in out.stderr and "data.global_batch_size" in out.stderr
    assert "Traceback" not in out.stderr


QUIET_PROGRAM = """
import tfdist
import keras
import tensorflow as tf

strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))
x, y = tfdist.data.load_digits()
with strategy.scope():
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=tfdist.DistributedOptimizer(keras.optimizers.Adam(1e-3)),
                  loss="sparse_categorical_crossentropy")
model.fit(tfdist.data.distribute(strategy, x, y, global_batch_size=64), epochs=1,
          steps_per_epoch=5, verbose=0)
print("trained")
"""


def test_a_python_program_with_tfdist_quiet_prints_nothing_on_stderr(tmp_path):
    """TensorFlow prints 16 lines on stderr for this program (CUDA probes, oneDNN, CPU features,
    the strategy's notes); with TFDIST_QUIET=1 before `import tfdist`, none."""
    env = {**_user_env(), "TFDIST_QUIET": "1"}
    out = subprocess.run([sys.executable, "-c", QUIET_PROGRAM], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "trained", out.stderr[-3000:]
    assert out.stderr == ""


@pytest.mark.multiprocess
def test_a_worker_that_never_joins_stops_the_start_within_the_timeout_in_one_line(tmp_path):
    """2 TF_CONFIG workers of which only one ever starts (its peer's host down, unreachable):
    worker 0 stops after engine.timeout_seconds naming worker 1, and worker 1 alone stops
    saying it could not join; one line each, no traceback, nothing trained."""
    from tfdist.tools.launch import held_ports, release_ports, tf_config

    ports = held_ports(4)  # each alone in a cluster of its own, its peer's port not served
    try:
        alone = [subprocess.Popen(
            [*TFDIST, "train", "--set", "engine.name=multi_worker", "--set",
             "engine.timeout_seconds=5", "--set", f"train.output_dir={tmp_path / str(i)}"],
            cwd=ROOT, env={**worker_env(), "TF_CONFIG": tf_config(i, ports[2 * i:2 * i + 2])},
            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in (0, 1)]
        done = [p.communicate(timeout=120) for p in alone]
    finally:
        release_ports()
    said = {
        0: "tfdist train: worker 1 did not join the job within engine.timeout_seconds (5 s): "
           "stopped before training.",
        1: "tfdist train: could not join the job led by worker 0 within "
           "engine.timeout_seconds (5 s): stopped before training."}
    for i, (p, (out, err)) in enumerate(zip(alone, done, strict=True)):
        assert p.returncode == 1, err[-3000:]
        assert said[i] in err and "Traceback" not in err, err[-3000:]
        assert "Epoch 1/" not in out


@pytest.mark.multiprocess
def test_workers_given_different_configs_stop_before_training_naming_each_value(tmp_path):
    """2 TF_CONFIG workers, one with another learning rate and data seed (a host's stale
    config; before, the job trained on, each worker stepping with its own rate): both stop
    before anything is built, in the same line naming each key and value (the versions agree);
    their own output directories may differ."""
    from tfdist.tools.launch import held_ports, release_ports, tf_config

    ports = held_ports(2)
    own = {0: [], 1: ["--set", "optimizer.learning_rate=0.01", "--set", "data.seed=3"]}
    try:
        workers = [subprocess.Popen(
            [*TFDIST, "train", "--set", "engine.name=multi_worker", "--set", "engine.devices=1",
             "--set", f"train.output_dir={tmp_path / str(i)}", *own[i]],
            cwd=ROOT, env={**worker_env(), "TF_CONFIG": tf_config(i, ports)},
            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in (0, 1)]
        done = [p.communicate(timeout=120) for p in workers]
    finally:
        release_ports()
    said = ("tfdist train: the workers differ: data.seed is 0 on worker 0, 3 on worker 1; "
            "optimizer.learning_rate is 0.002 on worker 0, 0.01 on worker 1. Give every worker "
            "the same config file and --set values, tfdist and TensorFlow, and data; only "
            "data.path, optimizer.offload_dir, train.output_dir, train.run_name, train.verbose "
            "may differ")
    for p, (out, err) in zip(workers, done, strict=True):
        assert p.returncode == 2, err[-3000:]
        assert said in err and "Traceback" not in err, err[-3000:]
        assert "Epoch 1/" not in out
    assert not (tmp_path / "0").exists() and not (tmp_path / "1").exists()


def test_tfdist_quiet_after_tensorflow_says_it_comes_too_late(tmp_path):
    """TFDIST_QUIET=1 with keras (so TensorFlow) imported before tfdist cannot hide the lines
    TensorFlow printed while it loaded: one line says so and what to do."""
    env = {**_user_env(), "TFDIST_QUIET": "1"}
    out = subprocess.run([sys.executable, "-c", "import keras\nimport tfdist"],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[tfdist] TFDIST_QUIET=1 came after TensorFlow was imported (by keras or your " \
        "program)" in out.stderr
    assert "import tfdist before keras and tensorflow" in out.stderr


def test_the_horovod_engine_where_horovod_is_not_built_says_so_in_one_line(
        tmp_path, monkeypatch, capsys):
    from tfdist.tools.cli import main

    monkeypatch.setitem(sys.modules, "horovod", None)  # an import of it fails, as unbuilt
    monkeypatch.setitem(sys.modules, "horovod.tensorflow", None)
    code = main(["train", "--set", f"train.output_dir={tmp_path}", "--set",
                 "engine.name=horovod", "--set", "train.epochs=1", "--set", "train.verbose=0"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.strip().splitlines()[-1] == (
        "tfdist train: engine.name is 'horovod': The Horovod engine needs Horovod built against "
        "this TensorFlow. Run `launch/build_horovod.sh` (see BUILD.md), or use the "
        "tf.distribute engine."), err
    assert "Traceback" not in err and not list(tmp_path.iterdir())


IMPORT_PROBE = """
import atexit, json, os, sys
import keras, tensorflow as tf  # their own import-time settings are theirs

CLASSES = [c for root in (tf.distribute.MirroredStrategy, keras.optimizers.Adam,
                          keras.optimizers.SGD) for c in root.__mro__ if c is not object]


def state():
    return {"fds 0-2": [list(os.fstat(fd)[1:3]) for fd in (0, 1, 2)],
            "environment": dict(os.environ), "argv": list(sys.argv),
            "meta_path": [repr(finder) for finder in sys.meta_path],
            "atexit handlers": atexit._ncallbacks(),
            **{c.__qualname__: {k: repr(v) for k, v in vars(c).items()} for c in CLASSES}}


before = state()
import tfdist
tfdist.DistributedOptimizer, tfdist.compression.PowerSGD  # the library itself, loaded
after = state()
print(json.dumps(sorted(k for k in before if before[k] != after[k])))
"""


def test_importing_the_library_leaves_the_process_as_it_was():
    """`import tfdist` (and its library, loaded) leaves file descriptors 0-2, the environment,
    argv, the import system's finders, the atexit handlers and the attributes of
    MirroredStrategy and Keras' optimizer classes as they were: what must be patched is patched
    when the first object that needs it is made (`tfdist/_hooks`)."""
    out = subprocess.run([sys.executable, "-c", IMPORT_PROBE], capture_output=True, text=True,
                         env=_user_env(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []





EXTENDING = Path(ROOT) / "docs" / "guides" / "extending.md"


@pytest.fixture
def own_files(tmp_path, monkeypatch):
    """Writes files into `tmp_path` as the Extending page shows them (its ```python block whose
    first line is `# name`), importable as the command's working directory makes them; the
    modules are forgotten after the test (another test's `my_engine` is another file)."""
    blocks = dict(re.findall(r"^```python\n# (\S+)\n(.*?)^```", EXTENDING.read_text(),
                             flags=re.S | re.M))
    monkeypatch.syspath_prepend(str(tmp_path))
    written = []

    def write(*names):
        for name in names:
            (tmp_path / name).write_text(blocks[name])
            written.append(name.removesuffix(".py"))

    yield write
    for module in written:
        sys.modules.pop(module, None)


def test_a_compressor_and_an_outer_rule_of_ones_own_file_train_through_the_command(
        tmp_path, own_files):
    """One file each, as the Extending page shows them, no registration and no other edit:
    `compression.name=my_codecs:Bfloat16` and `averaging.outer.name=my_rules:Slow` (with an
    option) train through `tfdist train`, and end on the weights of the built-in bf16 and
    slowmo (the compressor carries the synchronous warm-up steps, the rule the averaging rounds
    after them)."""
    import keras

    from tfdist.tools.cli import main

    own_files("my_codecs.py", "my_rules.py")
    common = ["--set", "averaging.period=2", "--set", "averaging.warmup_steps=3",
              "--set", "train.epochs=1", "--set", "train.steps_per_epoch=8",
              "--set", "train.verbose=0", "--set", f"train.output_dir={tmp_path}"]
    runs = {"own": ("my_codecs:Bfloat16", "my_rules:Slow"), "built_in": ("bf16", "slowmo")}
    for run, (codec, rule) in runs.items():
        assert main(["train", *common, "--set", f"train.run_name={run}",
                     "--set", f"compression.name={codec}",
                     "--set", f"averaging.outer={{name: '{rule}', momentum: 0.5}}"]) == 0
    summaries = {run: json.loads((tmp_path / run / "summary.json").read_text()) for run in runs}
    assert summaries["own"]["compressor"] == {"name": "my_codecs:Bfloat16"}
    assert summaries["own"]["bytes_sent_total"] == summaries["built_in"]["bytes_sent_total"]
    own, built_in = (keras.saving.load_model(tmp_path / run / "model.keras").get_weights()
                     for run in runs)
    for a, b in zip(own, built_in):
        np.testing.assert_array_equal(a, b)


def test_an_engine_of_ones_own_file_trains_through_the_command(tmp_path, own_files):
    """One file, the Extending page's, no other edit: `engine.name=my_engine:RecordingJob` trains
    through `tfdist train` on the file's own engine (its communicator carried the exchanges)
    and ends on the weights of the built-in one-device engine."""
    import keras

    from tfdist.tools.cli import main

    own_files("my_engine.py")
    common = ["--set", "train.epochs=1", "--set", "train.steps_per_epoch=4",
              "--set", "train.verbose=0", "--set", f"train.output_dir={tmp_path}"]
    runs = {"own": "my_engine:RecordingJob", "built_in": "single"}
    try:
        for run, engine in runs.items():
            assert main(["train", *common, "--set", f"train.run_name={run}",
                         "--set", f"engine.name={engine}"]) == 0
    finally:
        import tfdist

        tfdist.comm.activate(None)
    import my_engine

    assert my_engine.CALLS, "the engine's communicator was never used"
    summaries = {run: json.loads((tmp_path / run / "summary.json").read_text()) for run in runs}
    assert summaries["own"]["engine"] == "my_engine:RecordingJob"
    own, built_in = (keras.saving.load_model(tmp_path / run / "model.keras").get_weights()
                     for run in runs)
    for a, b in zip(own, built_in, strict=True):
        np.testing.assert_array_equal(a, b)
    assert main(["train", *common, "--set", "engine.name=my_engine:Missing"]) == 2


def test_an_engine_of_ones_own_file_takes_its_options_and_serves_a_role(tmp_path, own_files,
                                                                        capsys):
    """One file, the Extending page's: an engine's own `Options` come from `engine.options`
    (checked before anything runs: an unknown or mistyped option is refused naming it); a
    process of its serving role
    returns the engine's report, and its worker trains with the option applied: lr_factor 0.5
    on an SGD rate of 0.02 ends on the built-in engine's weights at a rate of 0.01."""
    import keras

    from tfdist.tools.cli import main

    own_files("serving_engine.py")
    common = ["--set", "train.epochs=1", "--set", "train.steps_per_epoch=3",
              "--set", "train.verbose=0", "--set", f"train.output_dir={tmp_path}",
              "--set", "optimizer.name=sgd", "--set", "optimizer.momentum=0"]
    own = ["--set", "engine.name=serving_engine:Serving"]
    assert main(["train", *common, *own, "--set", "engine.options={role: server}"]) == 0
    import serving_engine

    assert len(serving_engine.SERVED) == 1 and serving_engine.SERVED[0] > 0
    assert not any(tmp_path.glob("*/summary.json")), "a serving process wrote a run"
    assert main(["train", *common, *own, "--set", "train.run_name=own", "--set",
                 "optimizer.learning_rate=0.02", "--set", "engine.options={lr_factor: 0.5}"]) == 0
    assert main(["train", *common, "--set", "engine.name=single", "--set",
                 "train.run_name=built_in", "--set", "optimizer.learning_rate=0.01"]) == 0
    own_weights, built_in = (keras.saving.load_model(tmp_path / run / "model.keras").get_weights()
                             for run in ("own", "built_in"))
    for a, b in zip(own_weights, built_in, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    capsys.readouterr()
    for options, said in (
            ("{colour: red}", "engine.options: Serving takes no option 'colour'; it takes "
                              "role, lr_factor"),
            ("{lr_factor: fast}", "engine.options: Serving's option 'lr_factor' is a float; "
                                  "got 'fast'")):
        assert main(["train", *common, *own, "--set", f"engine.options={options}"]) == 2
        assert said in capsys.readouterr().err


def test_the_command_without_its_tools_extra_names_it():
    """PyYAML and matplotlib are the tools' extra, not the library's dependencies: the command
    without PyYAML says which extra installs it, before anything else."""
    hide = "import sys; sys.modules['yaml'] = None; import tfdist.tools.cli as c; " \
           "sys.exit(c.main(['info']))"
    out = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True,
                         env=_user_env(), timeout=120)
    assert out.returncode == 2
    assert "pip install 'tfdist[tools]'" in out.stderr, out.stderr[-2000:]


def test_a_process_other_than_the_chief_leaves_no_file_behind(tmp_path, monkeypatch):
    """Every process saves the model (a ZeRO save gathers shards from all); a process other
    than the chief saves to a temporary directory that is gone when the save returns, so
    nothing is left in the machine's temporary directory, whether or not the run finishes."""
    import tempfile

    import keras

    from tfdist.tools.run_files import MODEL, RunFiles

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    path = RunFiles(tmp_path / "run", chief=False).save_model(model)
    assert path == tmp_path / "run" / MODEL and not path.exists()  # the chief's file
    assert list((tmp_path / "tmp").iterdir()) == []
    chief = RunFiles(tmp_path / "run", chief=True)
    chief.start({})
    assert chief.save_model(model).exists()


@pytest.mark.parametrize("command", [
    ["bench", "--suite", "overhead", "--out", "{file}/out"],
    ["plan", "--parameters", "1000", "--compute-ms", "300", "--workers", "8", "--json",
     "{file}/plan.json"],
])
def test_an_output_path_that_cannot_be_written_is_named_before_the_run(tmp_path, capsys,
                                                                       command):
    """Said before the suite runs or the plan is printed, not in a traceback after it."""
    from tfdist.tools.cli import main

    file = tmp_path / "a-file"
    file.write_text("")
    argv = [word.format(file=file) for word in command]
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err == (f"tfdist {argv[0]}: {argv[-2]} {argv[-1]}: {file} is not a "
                            "directory; give a directory you can write\n")


def test_a_forgotten_engine_never_trains_several_jobs_alone(tmp_path):
    """Under `python -m tfdist.launch --workers 2`, the default (one-process) engine is refused
    in one line naming the fix, on every worker, before anything trains: never two independent
    jobs ending in exit 0. The Horovod engine in one process outside horovodrun trains, and
    says once that it trains alone."""
    launched = subprocess.run(
        [sys.executable, "-m", "tfdist.launch", "--workers", "2", "--timeout", "200", "--",
         *TFDIST, "train", "--set", "train.epochs=1", "--set", f"train.output_dir={tmp_path}"],
        capture_output=True, text=True, cwd=ROOT, env=worker_env(), timeout=300)
    assert launched.returncode == 2, launched.stderr[-2000:]
    said = [line for line in (launched.stdout + launched.stderr).splitlines()
            if "tfdist train: engine.name is 'mirrored'" in line]
    assert len(said) == 2 and all("engine.name=multi_worker" in line for line in said), said
    assert not any(tmp_path.glob("*/summary.json"))
    if horovod_available():
        alone = _run(["train", "--set", "engine.name=horovod", "--set", "train.epochs=1",
                      "--set", "train.steps_per_epoch=2", "--set",
                      f"train.output_dir={tmp_path}"])
        assert alone.returncode == 0, alone.stderr[-2000:]
        assert alone.stderr.count("engine.name horovod outside horovodrun") == 1
