"""Benchmark pages generated from the suites' results, never copied by hand.

`tfdist bench --suite SUITE --out DIR` writes DIR/SUITE.json (the command, the date, the machine,
the rows). Copied to `docs/benchmarks/data/SUITE.json` (or `SUITE.LABEL.json`, for a page that
shows several runs of one suite, e.g. `comm.quick.json`), its table is written into the suite's
page between the markers below by

    python -m tfdist.tools.bench.pages docs/benchmarks

and `tests/test_readme.py` fails when a page's table is not what its JSON gives. A suite's own
data file (`SUITE.json`, no label) is also drawn: its plots, as the suite's run draws them, go
to `docs/benchmarks/img/SUITE/` and show under its table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tfdist.tools.bench.suites import table_of

# suite -> its page in docs/benchmarks
PAGES = {"collectives": "collectives.md", "comm": "comm.md", "compression": "compression.md",
         "compressors": "compressor-speed.md", "engines": "overhead.md", "input": "input.md",
         "local_sgd": "local-sgd.md", "memory": "memory.md", "models": "models.md",
         "overhead": "overhead.md", "pipeline": "pipeline.md",
         "pipeline_hosts": "pipeline-hosts.md", "plan": "planner.md",
         "stragglers": "stragglers.md"}
BEGIN = "<!-- generated from data/{name}.json by python -m tfdist.tools.bench.pages -->"
END = "<!-- end of generated -->"


def section(suite: str, result: dict, shown: list[str] = ()) -> str:
    """What the page shows of a result: how it was measured, the table, then its figures
    (`shown`: their paths from the page)."""
    images = "".join(f"\n![{Path(image).stem.replace('_', ' ')}]({image})" for image in shown)
    return (f"`{result['command']}`, measured on {result['date']} on {result['machine']}:\n\n"
            f"{table_of(suite, result)}{chr(10) if images else ''}{images}")


# The suites whose runs draw figures: the files each draws, and how, from its result.
def _comm(result: dict, out: Path) -> list[Path]:
    from tfdist.tools.bench import comm

    return comm.plots(result["rows"], result["target_accuracy"], out)


def _models(result: dict, out: Path) -> list[Path]:
    from tfdist.tools.bench import plots

    rows = result["rows"]
    return [plots.models(rows, model, out / f"models_{model}.png")
            for model in dict.fromkeys(r["model"] for r in rows)]


def _stragglers(result: dict, out: Path) -> list[Path]:
    from tfdist.tools.bench import stragglers

    return [stragglers.plot(result["rows"], result["target_accuracy"],
                            out / "stragglers_accuracy.png")]


def _one(draw: str, name: str):
    def figures(result: dict, out: Path) -> list[Path]:
        from tfdist.tools.bench import plots

        return [getattr(plots, draw)(result["rows"], out / name)]

    return figures


FIGURES = {"comm": _comm, "models": _models, "stragglers": _stragglers,
           "input": _one("input_suite", "input.png"),
           **{suite: _one(suite, f"{suite}.png") for suite in (
               "overhead", "compression", "compressors", "local_sgd", "memory", "pipeline")}}


def figures(docs: Path) -> dict[str, list[Path]]:
    """Draws the figures of every suite's own data file into `docs`/img/SUITE/: {suite: the
    files}."""
    drawn = {}
    for suite, draw in FIGURES.items():
        data = docs / "data" / f"{suite}.json"
        if data.is_file():
            out = docs / "img" / suite
            out.mkdir(parents=True, exist_ok=True)
            drawn[suite] = sorted(draw(json.loads(data.read_text()), out))
    return drawn


def shown(docs: Path, name: str) -> list[str]:
    """The figures drawn for data file `name` (`SUITE[.LABEL]`), as paths from its page."""
    if name not in FIGURES:
        return []
    return sorted(f"img/{name}/{p.name}" for p in (docs / "img" / name).glob("*.png"))


def page_text(text: str, name: str, result: dict, path: Path) -> str:
    """`text` (a page) with the generated section of data file `name` (`SUITE[.LABEL]`)
    replaced by `result`'s."""
    begin = BEGIN.format(name=name)
    if begin not in text or END not in text.split(begin, 1)[1]:
        raise ValueError(f"{path} has no section to generate: put the lines\n{begin}\n{END}\n"
                         "where the table goes.")
    head, rest = text.split(begin, 1)
    tail = rest.split(END, 1)[1]
    return (f"{head}{begin}\n{section(name.split('.')[0], result, shown(path.parent, name))}\n"
            f"{END}{tail}")


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
    for suite, files in figures(Path(args[0])).items():
        print(f"drew {len(files)} figure(s) of {suite}")
    for path, text in generate(Path(args[0])).items():
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
