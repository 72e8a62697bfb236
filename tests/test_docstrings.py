"""The examples in the docstrings of the names the API reference documents run as written.

A docstring example is a ```python block that assumes what the reference page states: the
four imports (`keras`, `numpy as np`, `tensorflow as tf`, `tfdist`), the digits set as `x, y`
and a small `build_model()`. The examples run one after another in one fresh process (each in a namespace
of its own, in a scratch directory), so they cost seconds, not a process each. An example whose
first line names a launcher (`# python -m tfdist.launch ...`, `# horovodrun ...`) needs several
processes: it is checked to compile, and the guides' runnable examples run it for real
(tests/test_readme.py).
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import ROOT, worker_env

# What every docstring example may assume (docs/reference/api.md says so).
PRELUDE = '''import keras
import numpy as np
import tensorflow as tf
import tfdist

x, y = tfdist.data.load_digits()  # 1,438 images of 8x8x1 and their labels (0-9)


def build_model():
    return keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                             keras.layers.Dense(10, activation="softmax")])
'''
LAUNCHERS = ("# python -m tfdist.launch", "# horovodrun")

RUNNER = """
import json, os, sys, traceback
import tfdist
tfdist.devices.local_devices(2)  # as the first line of a fresh script would, before TF runs
examples = json.load(open(sys.argv[1]))
failed = {}
for name, code in examples:
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(PRELUDE + code, name, "exec"), namespace)
    except BaseException:
        failed[name] = traceback.format_exc(limit=-3)
print(json.dumps(failed))
"""


def documented_names() -> dict[str, object]:
    """Qualified name -> object, for every name the API reference page documents."""
    page = (Path(ROOT) / "docs" / "reference" / "api.md").read_text()
    names: dict[str, object] = {}

    def add(qualified: str, obj) -> None:
        if inspect.ismodule(obj):
            for member in getattr(obj, "__all__", []):
                add(f"{qualified}.{member}", getattr(obj, member))
        elif inspect.isclass(obj) or inspect.isfunction(obj):
            names.setdefault(qualified, obj)

    for target in re.findall(r"^::: (\S+)", page, flags=re.M):
        module, _, attribute = target.rpartition(".")
        try:
            obj = importlib.import_module(target)
        except ImportError:
            obj = getattr(importlib.import_module(module), attribute)
        add(target, obj)
    return names


def docstring_examples() -> list[tuple[str, str]]:
    """(qualified name, code) of every ```python block of a documented name's docstring."""
    out = []
    for qualified, obj in sorted(documented_names().items()):
        doc = inspect.getdoc(obj) or ""
        for _, code in re.findall(r"^( *)```python\n(.*?)^\1```", doc, flags=re.S | re.M):
            out.append((qualified, textwrap.dedent(code)))
    return out


def test_docstring_examples_run_as_written(tmp_path):
    examples = docstring_examples()
    assert len(examples) >= 30
    launched = [(name, code) for name, code in examples if code.startswith(LAUNCHERS)]
    for name, code in launched:
        compile(PRELUDE + code, name, "exec")
    (tmp_path / "examples.json").write_text(json.dumps(
        [e for e in examples if e not in launched]))
    out = subprocess.run(
        [sys.executable, "-c", f"PRELUDE = {PRELUDE!r}\n{RUNNER}", str(tmp_path / "examples.json")],
        capture_output=True, text=True, cwd=tmp_path, env=worker_env(), timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    failed = json.loads(out.stdout.strip().splitlines()[-1])
    assert not failed, "\n\n".join(f"{name}:\n{trace}" for name, trace in failed.items())
