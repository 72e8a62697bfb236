"""Every class and function the API reference documents has an example in its docstring, and
the examples run as written.

A docstring example is a ```python block that assumes the lines the reference page states
first (the imports, the digits set as `x, y` and a small `build_model()`). The examples run one
after another in one fresh process, each in a namespace of its own, in a scratch directory: a
process each would cost minutes. An example whose first line names a launcher
(`# python -m tfdist.launch ...`, `# horovodrun ...`) needs several processes: it is compiled
here, and the guides' examples of the same capabilities run under their launcher
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

API_PAGE = Path(ROOT) / "docs" / "reference" / "api.md"
# What every docstring example may assume: the first ```python block of the API reference page
# (which runs as written itself, as every block of docs/ does: tests/test_readme.py).
PRELUDE = re.search(r"^```python\n(.*?)^```", API_PAGE.read_text(), flags=re.S | re.M).group(1)
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
    page = API_PAGE.read_text()
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


def test_every_documented_class_and_function_has_an_example():
    examples = {name for name, _ in docstring_examples()}
    names = documented_names()
    missing = [name for name, obj in names.items()
               if not any(other in examples for other, same in names.items() if same is obj)]
    assert not missing, f"no example in the docstring of {missing}"


def test_docstring_examples_run_as_written(tmp_path):
    examples = docstring_examples()
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


def test_every_public_class_and_function_is_on_the_api_page():
    """The reference documents the public API whole: every class and function in the `__all__`
    of tfdist and of its subpackages."""
    import tfdist

    documented = {id(obj) for obj in documented_names().values()}
    modules = ["tfdist", "tfdist.horovod", "tfdist.strategies",
               *(f"tfdist.{name}" for name in tfdist.__all__
                 if inspect.ismodule(getattr(tfdist, name)))]
    missing = []
    for name in modules:
        module = importlib.import_module(name)
        for member in getattr(module, "__all__", ()):
            obj = getattr(module, member)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and id(obj) not in documented:
                missing.append(f"{name}.{member}")
    assert not missing, f"not on docs/reference/api.md: {missing}"
