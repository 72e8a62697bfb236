"""Every command line of the README and docs/ that runs tfdist (`tfdist ...`, `python -m
tfdist.launch ...`, `python -m tfdist.emulated ...`) is one its parser takes, and names only
config keys, suites, algorithms and models that exist: what a reader pastes is what runs.

Commands are read from code blocks, line by line (`\\` continuations joined), and from inline
code, where a line break is the space Markdown renders (`--algorithms a,` then `b` on the next
line is two words). A synopsis (`[--quick]`, `a|b`) or a placeholder (`N`, `FILE`, `$PS`) marks a
form, not a command, and is left out; `...` stands for options left out and is skipped (after an
option, the command is checked up to that option). docs/reference/cli.md is the parsers' own help
(`test_readme.py` checks it is what they print) and is not read.

The python examples run as written in `test_readme.py`; these commands train or need root and a
cluster, so each is checked as far as the command itself goes before anything runs: its parser,
then the config (`load_config`), `tfdist plan`'s own checks, and a bench suite's plan.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tfdist.tools import cli, emulated, launch
from tfdist.tools.config import ConfigError, load_config

HELP = Path(ROOT) / "docs" / "reference" / "cli.md"
PAGES = [Path(ROOT) / "README.md", Path(ROOT) / "BUILD.md"] + sorted(
    p for p in (Path(ROOT) / "docs").rglob("*.md") if p != HELP)
START = re.compile(r"(?:[\w./-]*/)?tfdist (?=(?:train|bench|info|plan)\b)"
                   r"|python -m tfdist\.(?:launch|emulated|tools\.cli)\b")
FENCE = re.compile(r"^```[\w-]*\n(.*?)^```", flags=re.S | re.M)
PLACEHOLDER = re.compile(r"\$\w+|[A-Z][A-Z_]*")
# Modules the docs ask the reader to write (`--set model.name=mine:build`): theirs, not ours.
USER_MODULES = {"mine", "my_engine", "my_codecs", "my_rules", "serving_engine"}
# Commands a page shows failing on purpose, with the words it quotes from the error.
MISTAKES = {"tfdist train --set train.epoch=3": "unknown key 'epoch' (did you mean 'epochs'?)"}


def _spans(text: str):
    """(line, text, inline) of every code line and inline code span of a page."""
    for m in FENCE.finditer(text):
        first = text[:m.start()].count("\n") + 2
        lines, i = m.group(1).split("\n"), 0
        while i < len(lines):
            start, line = i, lines[i]
            while line.endswith("\\") and i + 1 < len(lines):  # a continued line
                i += 1
                line = line[:-1] + " " + lines[i]
            yield first + start, line, False
            i += 1
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for m in re.finditer(r"`([^`]+)`", prose):
        yield prose[:m.start()].count("\n") + 1, m.group(1).replace("\n", " "), True


def _words(command: str) -> list[str] | None:
    """The words of `command` to check; None for a form (synopsis, placeholder), not a
    command."""
    words: list[str] = []
    for word in shlex.split(command, comments=True):
        if "..." in word:
            if words and words[-1].startswith("-"):
                words.pop()
                break
            continue
        value = word.partition("=")[2]
        if (word.startswith("[") or "|" in word or word.endswith(")")
                or (word.endswith("]") and "[" not in word)
                or PLACEHOLDER.fullmatch(word) or PLACEHOLDER.fullmatch(value)):
            return None
        words.append(word)
    return words


def _tfdist_argv(words: list[str]) -> list[str] | None:
    """The arguments of a `tfdist` command (`.venv/bin/tfdist`, `python -m tfdist.tools.cli`
    included); None for another command."""
    if words[0].rsplit("/", 1)[-1] == "tfdist":
        return words[1:]
    return words[3:] if words[:3] == ["python", "-m", "tfdist.tools.cli"] else None


def commands() -> list[tuple[str, list[str], bool]]:
    found = []
    for page in PAGES:
        for line, span, inline in _spans(page.read_text()):
            m = START.search(span)
            words = _words(span[m.start():]) if m else None
            if words is None:
                continue
            argv = _tfdist_argv(words)
            if argv is not None:
                words = ["tfdist", *argv]
            if (words[1] not in cli.COMMANDS if argv is not None else len(words) == 3):
                continue  # an error quoted (`tfdist train: ...`), a tool named in a sentence
            found.append((f"{page.relative_to(ROOT)}:{line}", words, inline))
    return found


COMMANDS = commands()


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return parser.parse_args(argv)
        except SystemExit:
            pass
    raise AssertionError(err.getvalue().strip().splitlines()[-1])


def check_tfdist(argv: list[str]) -> None:
    args = _parse(cli.build_parser(), argv)
    if args.command == "train" or (args.command == "plan" and args.parameters is None
                                   and not args.model_file):  # as `cli` reads the config
        try:
            load_config(cli._config_path(args.config), args.set)
        except ConfigError as e:
            module = re.search(r"cannot import module '(\w+)'", str(e))
            if not (module and module.group(1) in USER_MODULES):
                raise
    if args.command == "plan":
        from tfdist.tools import planning

        planning.check(args)
    if args.command == "bench" and args.suite in ("comm", "models", "stragglers"):
        from tfdist.tools.bench import comm, models, stragglers

        if args.suite == "comm":
            comm.load_plan(None, args.quick, args.hosts, args.bandwidths, args.algorithms,
                           args.set)
        elif args.suite == "models":
            models.load(None, args.quick, args.hosts, args.bandwidths, args.algorithms,
                        args.models)
        else:
            stragglers.load(None, args.quick, args.hosts, args.bandwidths, args.algorithms)


def check(words: list[str]) -> None:
    if words[0] == "tfdist":
        check_tfdist(words[1:])
        return
    tool = words[2]
    if tool == "tfdist.emulated":
        _parse(emulated._parser(), words[3:])
        return
    args = _parse(launch._parser(), words[3:])
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        return  # the launcher named in a sentence (`python -m tfdist.launch --elastic`)
    argv = _tfdist_argv(command)
    if argv is not None:
        check_tfdist(argv)


def test_the_docs_show_commands_of_every_kind():
    kinds = {" ".join(w[:2]) if w[0] == "tfdist" else w[2] for _, w, _ in COMMANDS}
    assert {"tfdist train", "tfdist bench", "tfdist plan", "tfdist info", "tfdist.launch",
            "tfdist.emulated"} <= kinds, kinds
    assert len(COMMANDS) >= 150


def test_a_broken_command_is_found():
    """The checks fail where a reader's paste would: a list broken by a line break inside
    inline code, a key that does not exist, an algorithm the suite does not have."""
    (_, span, _), = _spans("run `tfdist bench --suite comm --algorithms fp16,\npowersgd`")
    with pytest.raises(AssertionError, match="unrecognized arguments: powersgd"):
        check(_words(span))
    with pytest.raises(ConfigError, match="unknown key 'epoch'"):
        check(["tfdist", "train", "--set", "train.epoch=3"])
    with pytest.raises(ConfigError, match="nosuch"):
        check(["tfdist", "bench", "--suite", "comm", "--algorithms", "nosuch"])
    with pytest.raises(AssertionError, match="invalid int value: 'two'"):
        check(["python", "-m", "tfdist.launch", "--workers", "two", "--", "tfdist", "train"])


@pytest.mark.parametrize("where, words, inline", COMMANDS,
                         ids=[where for where, _, _ in COMMANDS])
def test_a_command_in_the_docs_is_one_tfdist_takes(where, words, inline, monkeypatch):
    monkeypatch.chdir(ROOT)
    mistake = MISTAKES.get(shlex.join(words))
    if mistake is None:
        try:
            check(words)
        except AssertionError as e:
            # A sentence may name an option without its value (`tfdist train --config`): one
            # the parser has, and the command up to it is checked.
            if not (inline and str(e).endswith(f"argument {words[-1]}: expected one argument")):
                raise
            check(words[:-1])
        return
    with pytest.raises(ConfigError) as error:
        check(words)
    assert mistake in str(error.value)
