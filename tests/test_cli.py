"""End to end: the `tfdist` command in fresh processes, as a user runs it."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, horovod_available, worker_env
from tfdist.tools.launch import run_horovod, run_tf_workers

TFDIST = [sys.executable, "-m", "tfdist.tools.cli"]


def _run(args, timeout=300):
    return subprocess.run([*TFDIST, *args], capture_output=True, text=True, cwd=ROOT,
                          env=worker_env(), timeout=timeout)


def test_train_default_config_prints_accuracy_and_bytes(tmp_path):
    out = _run(["train", "--config", "configs/default.yaml", "--set", "train.epochs=3",
                "--set", f"train.output_dir={tmp_path}", "--set", "train.verbose=2"])
    assert out.returncode == 0, out.stderr[-4000:]
    assert "test accuracy" in out.stdout and "bytes sent/step" in out.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["test_accuracy"] > 0.8
    assert summary["bytes_sent_per_step"] == summary["gradient_bytes_per_round"]  # N=2: 2(N-1)/N=1
    assert summary["communication_rounds"] == summary["steps"]
    assert list((tmp_path / "tensorboard" / "comm").iterdir())


def test_train_zero_config_keeps_the_optimizer_state_on_the_host(tmp_path):
    out = _run(["train", "--config", "configs/zero.yaml", "--set", "train.epochs=2",
                "--set", f"train.output_dir={tmp_path}", "--set", "train.verbose=0"])
    assert out.returncode == 0, out.stderr[-4000:]
    assert "ZeRO stage 2, offload cpu" in out.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    p = summary["trainable_parameters"]
    assert summary["optimizer_state_bytes"] == {"host": 2 * 2 * 4 * (-(-p // 2))}  # m, v; 2 shards
    assert summary["test_accuracy"] > 0.8


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
    from pathlib import Path

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


def test_info_lists_versions_and_engines():
    out = _run(["info"])
    assert out.returncode == 0, out.stderr[-3000:]
    info = json.loads(out.stdout[out.stdout.index("{"):])
    assert info["tensorflow"].startswith("2.21") and info["keras"].startswith("3.15")
    assert info["engines"]["horovod"] == horovod_available()


@pytest.mark.multiprocess
def test_train_on_two_tf_config_workers(tmp_path):
    results = run_tf_workers(
        [*TFDIST, "train", "--set", "engine.name=multi_worker", "--set", "train.epochs=2",
         "--set", "model.name=mlp", "--set", f"train.output_dir={tmp_path}",
         "--set", "train.verbose=0"], 2, 300, env=worker_env())
    assert [r.returncode for r in results] == [0, 0], results[0].output[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["test_accuracy"] > 0.7


@pytest.mark.multiprocess
@pytest.mark.horovod
@pytest.mark.skipif(not horovod_available(), reason="Horovod is not installed")
def test_train_on_two_horovod_ranks(tmp_path):
    result = run_horovod(
        [*TFDIST, "train", "--set", "engine.name=horovod", "--set", "train.epochs=2",
         "--set", "model.name=mlp", "--set", f"train.output_dir={tmp_path}",
         "--set", "train.verbose=0"], 2, 300, env=worker_env())
    assert result.returncode == 0, result.output[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["engine"] == "horovod" and summary["test_accuracy"] > 0.7



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
