"""`pip install .` into an existing environment: the wheel holds the whole package (data and
typing marker included) and its console script, and the installed package trains the main job
from its built-in defaults in a directory without the repository's configs/."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile

from tests.conftest import ROOT, worker_env


def test_the_wheel_installs_and_trains_outside_the_checkout(tmp_path):
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), ROOT],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("tfdist-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names if n.endswith("entry_points.txt"))
        metadata = next(z.read(n).decode() for n in names if n.endswith("METADATA"))
    for module in ("tfdist/__init__.py", "tfdist/tools/cli.py", "tfdist/comm/engine.py",
                   "tfdist/_hooks/optimizer.py", "tfdist/data/digits.npz", "tfdist/py.typed"):
        assert module in names
    assert not any(n.startswith("tests/") for n in names)
    assert "tfdist = tfdist.tools.cli:run" in entry_points
    assert "License-Expression: Apache-2.0" in metadata

    target = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q",
                                "--target", str(target), str(wheel)],
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    work = tmp_path / "elsewhere"  # no configs/ here: the built-in defaults are the main job
    work.mkdir()
    env = {**worker_env(), "PYTHONPATH": str(target)}
    where = subprocess.run([sys.executable, "-c", "import tfdist.tools; print(tfdist.tools.__file__)"],
                           capture_output=True, text=True, cwd=work, env=env, timeout=120)
    assert where.stdout.strip().startswith(str(target)), where.stdout + where.stderr
    run = subprocess.run(
        [sys.executable, "-c", "import sys, tfdist.tools.cli as c; sys.exit(c.main(sys.argv[1:]))",
         "train", "--set", "train.epochs=1", "--set", "train.output_dir=runs",
         "--set", "train.run_name=one"],
        capture_output=True, text=True, cwd=work, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((work / "runs" / "one" / "summary.json").read_text())
    assert summary["config"]["optimizer"]["learning_rate"] == 0.002  # default.yaml's value
    assert summary["test_accuracy"] > 0.5
