"""The package's layout rules, checked from the source (no TensorFlow needed):

* no import cycle in tfdist/ (imports inside functions count too);
* the library never imports the tools (`tfdist.tools`); only the two command entry points
  (`python -m tfdist.launch`, `python -m tfdist.emulated`) do;
* the algorithm packages never look for an engine (they are handed one);
* private TensorFlow / Keras APIs are touched in tfdist/_hooks/ only.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tfdist"
ENTRY_POINTS = {"tfdist.launch", "tfdist.emulated"}
ALGORITHMS = ("compression", "averaging", "zero", "pipeline", "tensor_parallel", "optimizers")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _deepest(target: str) -> str:
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target


def _imports(name: str) -> set[str]:
    """The tfdist modules `name` imports anywhere in its source: `from X import a` is an import
    of X.a when that is a module, else of X."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            found |= {_deepest(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {_deepest(f"{node.module}.{a.name}") for a in node.names}
    return {t for t in found if t.startswith("tfdist") and t != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = {name: _imports(name) for name in MODULES}
    assert sum(map(len, graph.values())) > 50  # the graph was read
    assert _cycles(graph) == []


def test_the_library_never_imports_the_tools():
    offenders = {name: sorted(t for t in _imports(name) if t.startswith("tfdist.tools"))
                 for name in MODULES
                 if not name.startswith("tfdist.tools") and name not in ENTRY_POINTS}
    assert {k: v for k, v in offenders.items() if v} == {}


def _calls_and_imports(path: Path) -> tuple[set[str], set[str]]:
    """(attribute names used, top-level module names imported) in a file's code."""
    tree = ast.parse(path.read_text())
    attributes = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    return attributes, imported


@pytest.mark.parametrize("package", ALGORITHMS)
def test_algorithms_are_handed_their_engine(package):
    for path in (PACKAGE / package).glob("*.py"):
        attributes, imported = _calls_and_imports(path)
        probes = attributes & {"get_strategy", "has_strategy", "modules"}
        assert not probes, f"{path.name} looks for its engine: {sorted(probes)}"
        assert not {m for m in imported if m.startswith(("horovod", "sys"))}, path.name


def test_private_tensorflow_and_keras_apis_only_in_hooks():
    for name, path in MODULES.items():
        if name.startswith("tfdist._hooks"):
            continue
        attributes, imported = _calls_and_imports(path)
        private = {m for m in imported if m.startswith(("tensorflow.python", "keras.src",
                                                        "tensorflow.tsl"))}
        assert not private, f"{name} imports {sorted(private)}"
        assert "__internal__" not in attributes, f"{name} uses tf.__internal__"
        assert "__setattr__" not in path.read_text(), f"{name} patches an instance"
