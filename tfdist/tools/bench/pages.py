"""Benchmark pages generated from the suites' results, never copied by hand.

`tfdist bench --suite SUITE --out DIR` writes DIR/SUITE.json (the command, the date, the machine,
the rows). Copied to `docs/benchmarks/data/SUITE.json` (or `SUITE.LABEL.json`, for a page that
shows several runs of one suite, e.g. `comm.quick.json`), its table is written into the suite's
page between the markers below by

    python -m tfdist.tools.bench.pages docs/benchmarks

and `tests/test_readme.py` fails when a page's table is not what its JSON gives.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tfdist.tools.bench.suites import table_of

# suite -> its page in docs/benchmarks
PAGES = {"collectives": "collectives.md", "comm": "comm.md", "compression": "compression.md",
         "compressors": "compressor-speed.md", "input": "input.md", "local_sgd": "local-sgd.md",
         "memory": "memory.md",
         "models": "models.md", "overhead": "overhead.md", "pipeline": "pipeline.md",
         "pipeline_hosts": "pipeline-hosts.md", "plan": "planner.md",
         "stragglers": "stragglers.md"}
BEGIN = "<!-- generated from data/{name}.json by python -m tfdist.tools.bench.pages -->"
END = "<!-- end of generated -->"


def section(suite: str, result: dict) -> str:
    """What the page shows of a result: how it was measured, then the table."""
    return (f"`{result['command']}`, measured on {result['date']} on {result['machine']}:\n\n"
            f"{table_of(suite, result)}")


def page_text(text: str, name: str, result: dict, path: Path) -> str:
    """`text` (a page) with the generated section of data file `name` (`SUITE[.LABEL]`)
    replaced by `result`'s."""
    begin = BEGIN.format(name=name)
    if begin not in text or END not in text.split(begin, 1)[1]:
        raise ValueError(f"{path} has no section to generate: put the lines\n{begin}\n{END}\n"
                         "where the table goes.")
    head, rest = text.split(begin, 1)
    tail = rest.split(END, 1)[1]
    return f"{head}{begin}\n{section(name.split('.')[0], result)}\n{END}{tail}"


def generate(docs: Path) -> dict[Path, str]:
    """{page: its text with every generated section up to date} for docs/benchmarks `docs`."""
    pages: dict[Path, str] = {}
    for data in sorted((docs / "data").glob("*.json")):
        suite = data.stem.split(".")[0]
        if suite not in PAGES:
            raise ValueError(f"{data}: no page for suite {suite!r} (PAGES knows {sorted(PAGES)}).")
        path = docs / PAGES[suite]
        text = pages.get(path) or path.read_text()
        pages[path] = page_text(text, data.stem, json.loads(data.read_text()), path)
    return pages


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m tfdist.tools.bench.pages docs/benchmarks", file=sys.stderr)
        return 2
    for path, text in generate(Path(args[0])).items():
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
