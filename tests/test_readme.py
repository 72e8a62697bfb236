"""Every ```python block of the README and of docs/ runs as written, in a fresh process (what a
user pasting it into a file does), in a scratch directory (files it saves land there).

A block run as `python block.py` runs in a process forked from one that has imported TensorFlow
and Keras and nothing else (`_Zygote`): what the block's own first import would do, done once;
each block then starts in a second instead of six. The fork is otherwise a new process: its own
environment, working directory, argv, stdout and stderr, its exit status.

A block's first line may say how it runs:
    # horovodrun -np 2 ...       -> under `horovodrun --gloo -np 2 -H localhost:2`
    # python -m tfdist.launch --workers 2 ...  -> as 2 TF_CONFIG workers through the launcher
    # python -m tfdist.launch --ps 1 ...        -> as 1 parameter server and 2 workers
    # needs root                 -> runs as root with iproute2 (skipped elsewhere)
Otherwise it runs as `python block.py`.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, horovod_available, worker_env
from tfdist.tools.launch import host_commands, run_horovod, run_processes, run_tf_workers

README = Path(ROOT) / "README.md"
TIMEOUT = 300


DOCS = sorted((Path(ROOT) / "docs").rglob("*.md"))


def python_blocks(path: Path = README) -> list[tuple[int, str]]:
    """(line number, code) of every ```python block of `path`."""
    text = path.read_text()
    return [(text[:m.start()].count("\n") + 1, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M)]


BLOCKS = python_blocks()
DOC_BLOCKS = [(path.relative_to(ROOT), line, code) for path in DOCS
              for line, code in python_blocks(path)]


def test_the_readme_and_the_docs_have_runnable_examples():
    assert len(BLOCKS) >= 1 and len(BLOCKS) + len(DOC_BLOCKS) >= 20
    assert all("..." not in code for _, code in BLOCKS + [(line, code) for _, line, code in
                                                          DOC_BLOCKS]), \
        "placeholders left in an example"


def test_no_page_shows_a_template_placeholder():
    """A line that is only `{name}` (a table meant to be filled in) is never published."""
    left = [f"{path.relative_to(ROOT)}:{number}" for path in [README, *DOCS]
            for number, line in enumerate(path.read_text().splitlines(), 1)
            if re.fullmatch(r"\{\w+\}", line.strip())]
    assert not left, f"unfilled placeholders: {left}"


@pytest.mark.parametrize("line, code", BLOCKS, ids=[f"line{line}" for line, _ in BLOCKS])
def test_readme_example_runs_as_written(tmp_path, line, code, zygote):
    _runs_as_written(tmp_path, line, code, zygote=zygote)


@pytest.mark.parametrize("path, line, code", DOC_BLOCKS,
                         ids=[f"{path}:{line}" for path, line, _ in DOC_BLOCKS])
def test_docs_example_runs_as_written(tmp_path, path, line, code, zygote):
    _runs_as_written(tmp_path, line, code, where=str(path), zygote=zygote)


ZYGOTE = """
import json, os, runpy, sys, traceback
import keras, tensorflow  # noqa: F401  (done once: what every block's first import does)
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.chdir(job["cwd"])
        os.environ.clear()
        os.environ.update(job["env"])
        for fd, name in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(job[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.stdin.close()
        sys.argv = [job["script"]]
        sys.path[0] = os.path.dirname(job["script"])
        try:
            runpy.run_path(job["script"], run_name="__main__")
        except SystemExit:
            raise
        except BaseException:
            traceback.print_exc()
            sys.exit(1)
        sys.exit(0)
    print(pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


class _Zygote:
    """A process that has imported TensorFlow and Keras, forking one child per script."""

    def __init__(self):
        self.process = subprocess.Popen([sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=worker_env())

    def run(self, script, cwd, env, timeout) -> tuple[int, str, str]:
        """(exit status, stdout, stderr) of `python script` in `cwd` with `env`; killed after
        `timeout` seconds."""
        out, err = Path(cwd) / "stdout.txt", Path(cwd) / "stderr.txt"
        self.process.stdin.write(json.dumps({"script": str(script), "cwd": str(cwd), "env": env,
                                             "stdout": str(out), "stderr": str(err)}) + "\n")
        self.process.stdin.flush()
        pid = int(self.process.stdout.readline())
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        status = int(self.process.stdout.readline())
        return status, out.read_text(), err.read_text()

    def close(self):
        self.process.stdin.close()
        self.process.wait(timeout=60)


@pytest.fixture(scope="module")
def zygote():
    z = _Zygote()
    yield z
    z.close()


def _runs_as_written(tmp_path, line, code, where="README", zygote=None):
    script = tmp_path / f"example_line{line}.py"
    script.write_text(code)
    env = worker_env()
    first = code.splitlines()[0]
    if first.startswith("# horovodrun"):
        if not horovod_available():
            pytest.skip("Horovod is not installed")
        result = run_horovod([sys.executable, str(script)], 2, TIMEOUT, env=env)
        assert result.returncode == 0, f"{where} line {line}:\n{result.output[-4000:]}"
        return
    if first.startswith("# python -m tfdist.launch --ps"):
        ps = int(first.split("--ps")[1].split()[0])
        commands = host_commands([sys.executable, str(script)], [("127.0.0.1", ps + 2)],
                                 env=env, ps=ps)
        results = run_processes(commands, TIMEOUT)
        assert [r.returncode for r in results] == [0] * (ps + 2), \
            f"{where} line {line}:\n" + "\n".join(r.output[-3000:] for r in results)
        return
    if first.startswith("# python -m tfdist.launch"):
        results = run_tf_workers([sys.executable, str(script)], 2, TIMEOUT, env=env)
        assert [r.returncode for r in results] == [0, 0], \
            f"{where} line {line}:\n" + "\n".join(r.output[-3000:] for r in results)
        return
    if first.startswith("# needs root") and (os.geteuid() != 0 or not shutil.which("tc")):
        pytest.skip("needs root and iproute2 (network namespaces)")
    status, stdout, stderr = zygote.run(script, tmp_path, env, TIMEOUT)
    assert status == 0, f"{where} line {line}:\n{stdout[-2000:]}\n{stderr[-4000:]}"


def test_the_reference_pages_are_what_the_code_generates():
    """docs/reference/ is generated (`python -m tfdist.tools.reference docs/reference`): every
    config key with its default and rule, every command's options; regenerate after a change."""
    from tfdist.tools import reference

    for name, text in zip(reference.PAGES, (reference.config_reference(),
                                            reference.cli_reference())):
        committed = (Path(ROOT) / "docs" / "reference" / name).read_text()
        assert committed == text, f"docs/reference/{name} is stale: run python -m " \
                                  "tfdist.tools.reference docs/reference"
    from tfdist.tools.config import SCHEMA

    keys = [f"`{s}.{k}`" for s, fields in SCHEMA.items() for k in fields]
    assert all(key in reference.config_reference() for key in keys)


def test_the_benchmark_tables_are_what_their_results_give():
    """Each docs/benchmarks/data/SUITE.json (a `tfdist bench` result: command, date, machine,
    rows) is shown on its page by the generated section, unchanged; regenerate with python -m
    tfdist.tools.bench.pages docs/benchmarks."""
    from tfdist.tools.bench import pages

    docs = Path(ROOT) / "docs" / "benchmarks"
    generated = pages.generate(docs)
    assert generated, "no benchmark result in docs/benchmarks/data"
    for path, text in generated.items():
        assert path.read_text() == text, f"{path} is stale: run python -m " \
                                         "tfdist.tools.bench.pages docs/benchmarks"
        assert "measured on 20" in text and "CPU cores" in text  # the date and the machine


def test_a_suite_that_draws_plots_shows_them_on_its_page():
    """The plots of each suite's own result, drawn from it into docs/benchmarks/img/SUITE/ by
    python -m tfdist.tools.bench.pages, show under its table; a page that names a plot file
    shows an image."""
    from tfdist.tools.bench import pages

    docs = Path(ROOT) / "docs" / "benchmarks"
    for suite in pages.FIGURES:
        if not (docs / "data" / f"{suite}.json").is_file():
            continue
        text = (docs / pages.PAGES[suite]).read_text()
        images = re.findall(rf"!\[[^\]]*\]\((img/{suite}/[^)]+\.png)\)", text)
        assert images, f"{pages.PAGES[suite]} shows none of {suite}'s plots"
        assert all((docs / image).is_file() for image in images), images
    for path in sorted(docs.glob("*.md")):
        text = path.read_text()
        assert ".png" not in text or "![" in text, f"{path.name} names a plot it does not show"


def test_every_benchmark_table_is_generated_from_a_result():
    """No table on a benchmark page is copied by hand: each sits in a section generated from
    a result kept in docs/benchmarks/data (which the test above checks)."""
    docs = Path(ROOT) / "docs" / "benchmarks"
    copied = []
    for path in sorted(docs.glob("*.md")):
        outside = re.sub(r"<!-- generated from .*?<!-- end of generated -->", "",
                         path.read_text(), flags=re.S)
        copied += [f"{path.name}:{line}" for line in outside.splitlines()
                   if line.startswith("|---")]
    assert not copied, f"tables outside a generated section: {copied}"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """`mkdocs build --strict -f launch/mkdocs.yml` into a temporary directory: (the build's
    result, the site's directory)."""
    mkdocs = shutil.which("mkdocs", path=os.path.dirname(sys.executable)) or shutil.which("mkdocs")
    if mkdocs is None:
        pytest.skip("mkdocs is not installed: pip install '.[docs]' (launch/setup.sh --dev does)")
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run([mkdocs, "build", "--strict", "-f", "launch/mkdocs.yml", "-d",
                            str(out)], cwd=ROOT, capture_output=True, text=True,
                           timeout=300, env={**worker_env(), "NO_MKDOCS_2_WARNING": "1"})
    return built, out


def test_the_docs_site_builds_with_no_broken_link_or_reference(site):
    """`mkdocs build --strict -f launch/mkdocs.yml`: every page, every link and anchor between
    pages, and the API reference read from the docstrings, without a warning."""
    built, out = site
    assert built.returncode == 0, built.stderr[-4000:]
    api = (out / "reference" / "api" / "index.html").read_text()
    assert "DistributedOptimizer" in api and "skip_also" in api  # read from the code


# Loads every page of the site in a frame 1280 px wide and lists, per page, the tables wider
# than the page's column: [table number, columns, table width, column width].
_WIDE_TABLES = """<html><body><script>
const pages = %s, found = {};
let left = pages.length;
for (const page of pages) {
  const frame = document.createElement("iframe");
  frame.width = 1280; frame.height = 1000;
  frame.onload = () => {
    const wide = [];
    frame.contentDocument.querySelectorAll(".md-typeset table").forEach((table, i) => {
      const column = table.closest(".md-typeset__scrollwrap") || table.parentElement;
      if (table.scrollWidth > column.clientWidth + 1)
        wide.push([i, table.rows[0].cells.length, table.scrollWidth, column.clientWidth]);
    });
    found[page] = wide;
    if (--left === 0) {
      const said = document.createElement("pre");
      said.textContent = "WIDE" + "=" + JSON.stringify(found) + "=END";
      document.body.appendChild(said);
    }
  };
  frame.src = "file://" + page;
  document.body.appendChild(frame);
}
</script></body></html>"""


def test_every_table_of_the_docs_site_fits_its_page_at_1280_px(site):
    """Every page with a table, laid out by a headless Chromium in a window 1280 px wide: no
    table is wider than the page's column (benchmark tables run to 14 columns; none needs
    scrolling sideways to see its last)."""
    import html

    built, out = site
    assert built.returncode == 0, built.stderr[-4000:]
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no headless browser: apt-get install chromium (launch/setup.sh --dev does "
                    "as root)")
    pages = [str(p) for p in sorted(out.rglob("index.html")) if "<table" in p.read_text()]
    assert len(pages) > 10, pages
    harness = out / "wide-tables.html"
    harness.write_text(_WIDE_TABLES % json.dumps(pages))
    dom = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                          "--allow-file-access-from-files", "--window-size=1400,1000",
                          "--virtual-time-budget=60000", "--dump-dom", f"file://{harness}"],
                         capture_output=True, text=True, timeout=240).stdout
    said = re.search(r"WIDE=(\{.*?\})=END", html.unescape(dom))
    assert said, dom[-2000:]
    found = json.loads(said.group(1))
    assert sorted(found) == sorted(pages)
    wide = {Path(page).parent.relative_to(out).as_posix(): tables
            for page, tables in found.items() if tables}
    assert not wide, wide
