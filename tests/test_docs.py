"""The documents a user reads: the mkdocs site over ``docs/`` builds with ``--strict``; every
relative link of README.md, ``docs/*.md`` and ``benchmarks/RESULTS.md`` reaches a file (and, with
``#anchor``, a heading of it); every result file their prose cites exists; every ``benchmarks/``
script named anywhere exists, and docs/benchmarks.md lists each one; every ``--flag`` written after
``precache <command>`` is an option of that command's parser, built in-process from
:func:`precache.cli.build_parser`; and ``docs/cli.md`` documents every command and option.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from precache.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
CLI_DOC = REPO / "docs" / "cli.md"
RESULTS = REPO / "benchmarks" / "RESULTS.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, *DOCS, RESULTS]

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE_CODE = re.compile(r"`([^`]+)`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
SCRIPT = re.compile(r"benchmarks/[\w/.-]+\.(?:py|sh)\b")


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks."""
    return FENCE.sub("", text)


def _slugs(text: str) -> set[str]:
    """The anchors of ``text``'s headings, as GitHub and Python-Markdown's ``toc`` (mkdocs) spell
    them: lower case, punctuation dropped, spaces to ``-`` (toc also folds runs of ``-``)."""
    slugs = set()
    for _, title in HEADING.findall(_prose(text)):
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title).replace("`", "")
        slugs.add(re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-"))
        slugs.add(re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", title).strip().lower()))
    return slugs


def _broken_links(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    prose = INLINE_CODE.sub("", _prose(text))
    broken = []
    for target in LINK.findall(prose):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _slugs(dest.read_text(encoding="utf-8")):
            broken.append(f"{target}: no heading '#{anchor}' in {dest.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_reaches_a_file_and_heading(page):
    assert _broken_links(page) == []


def test_the_site_builds_with_strict_links_and_nav(tmp_path):
    """``mkdocs build --strict``: a broken link or anchor, or a page left out of the nav, fails."""
    site = tmp_path / "site"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(REPO / "mkdocs.yml"),
            "-d",
            str(site),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    built = {p.relative_to(site).parent.as_posix() for p in site.rglob("index.html")}
    assert {"." if p.stem == "index" else p.stem for p in DOCS} <= built


def test_the_benchmark_scripts_named_anywhere_exist():
    """A renamed or removed script leaves no reference behind in the docs, code or tests."""
    files = [*PAGES, REPO / "Makefile", *REPO.glob("benchmarks/*.*"), *REPO.glob("precache/**/*.py")]
    files += REPO.glob("tests/*.py")
    missing = {
        f"{path.relative_to(REPO)}: {name}"
        for path in files
        if path.is_file() and path.suffix in {".md", ".py", ".sh", ""}
        for name in SCRIPT.findall(path.read_text(encoding="utf-8"))
        if not (REPO / name).exists()
    }
    assert sorted(missing) == []


def _expand(path: str) -> list[str]:
    """``a{b,c}d`` as ``abd``, ``acd`` (the shell's brace expansion, nested braces left out)."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [x for alt in m.group(1).split(",") for x in _expand(path[: m.start()] + alt + path[m.end() :])]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_result_file_named_in_prose_exists(page):
    """A result file the text cites (``benchmarks/results/...``, or ``results/...`` from
    RESULTS.md) exists; paths inside code blocks are a command's outputs and are not checked."""
    prose = _prose(page.read_text(encoding="utf-8"))
    missing = []
    for span in INLINE_CODE.findall(prose):
        for name in re.findall(r"(?<![\w/])(?:benchmarks/)?results/[\w./{},*-]+", span.replace("\n", " ")):
            for path in _expand(name.rstrip(".,")):
                full = path if path.startswith("benchmarks/") else f"benchmarks/{path}"
                if not (list(REPO.glob(full)) if "*" in full else (REPO / full).exists()):
                    missing.append(full)
    assert missing == []


def test_the_benchmarks_page_lists_every_script_and_only_those():
    """docs/benchmarks.md's table of the scripts in ``benchmarks/`` names each one, by its path
    under ``benchmarks/``, and names none that is not there."""
    text = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    table = text.split("## The scripts in `benchmarks/`", 1)[1]
    listed = set(re.findall(r"^\| `([\w/.-]+\.(?:py|sh))`", table, re.M))
    listed |= set(re.findall(r"\(\+ `([\w/.-]+\.(?:py|sh))`\)", table))
    scripts = {p.relative_to(REPO / "benchmarks").as_posix() for p in (REPO / "benchmarks").rglob("*.*")}
    scripts = {s for s in scripts if s.endswith((".py", ".sh")) and not s.startswith("results/")}
    assert listed == scripts


def test_the_library_example_is_the_same_in_readme_and_docs():
    def first_python_block(path: Path, heading: str) -> str:
        section = path.read_text(encoding="utf-8").split(f"\n{heading}\n", 1)[1]
        return re.search(r"```python\n(.*?)```", section, re.S).group(1)

    assert first_python_block(README, "## Library") == first_python_block(
        REPO / "docs" / "library.md", "## A first session"
    )


# --- the command line --------------------------------------------------------------------------


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


@cache
def _parsers() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every parser of the ``precache`` command line by its command path (``()`` is the root)."""
    found, todo = {}, [((), build_parser())]
    while todo:
        path, parser = todo.pop()
        found[path] = parser
        todo += [((*path, name), sub) for name, sub in _subcommands(parser).items()]
    return found


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for s in parser._option_string_actions if s.startswith("--")}


def _documented_options(parser: argparse.ArgumentParser) -> set[str]:
    """The long options ``--help`` lists (suppressed ones, kept to refuse old names, are not)."""
    return {
        s
        for a in parser._actions
        if a.help is not argparse.SUPPRESS
        for s in a.option_strings
        if s.startswith("--") and s != "--help"
    }


def _command_lines(text: str) -> list[str]:
    """Each ``precache ...`` command written in ``text``: code-block lines (continuations joined)
    and inline code spans, from ``precache`` (or ``.venv/bin/precache``, ``python -m
    precache.cli``) on, env assignments and ``time`` before it dropped."""
    lines = []
    for block in FENCE.findall(text):
        lines += block.replace("\\\n", " ").splitlines()[1:-1]
    lines += (span.replace("\n", " ") for span in INLINE_CODE.findall(_prose(text)))
    start = re.compile(
        r"^\s*(?:\$\s+)?(?:time\s+)?(?:\w+=\S*\s+)*(?:\S*/)?(?:precache|\S*python\S* -m precache\.cli)\s"
    )
    return [line[m.end() :] for line in lines if (m := start.match(line))]


def _check_command(words: str) -> list[str]:
    """Problems of one command line's words after ``precache``: an unknown sub-command, or a
    ``--flag`` its command does not take."""
    try:
        tokens = shlex.split(words, comments=True)
    except ValueError:  # an unclosed quote in prose: fall back to plain words
        tokens = words.split()
    path: tuple[str, ...] = ()
    parsers = _parsers()
    rest = list(tokens)
    while rest and _subcommands(parsers[path]):
        word = rest.pop(0)
        if word.startswith("-"):
            if word.split("=")[0] not in parsers[path]._option_string_actions and not re.fullmatch(
                r"-v+", word
            ):
                return [f"precache {words}: the root takes no {word}"]
            continue
        if word.isupper() or not re.fullmatch(r"[a-z][a-z0-9-]*", word):
            return []  # a placeholder such as COMMAND: nothing to resolve
        if word not in _subcommands(parsers[path]):
            return [f"precache {words}: no command '{' '.join((*path, word))}'"]
        path = (*path, word)
    known = _options(parsers[path])
    return [
        f"precache {words}: 'precache {' '.join(path)}' takes no {flag}"
        for token in rest
        for flag in FLAG.findall(token.split("=")[0])
        if flag not in known
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_precache_command_written_parses_its_flags(page):
    text = page.read_text(encoding="utf-8")
    commands = _command_lines(text)
    problems = [p for words in commands for p in _check_command(words)]
    assert problems == []
    if page in (README, CLI_DOC):
        assert len(commands) >= 10


def _cli_sections() -> dict[str, str]:
    """docs/cli.md's text under each heading (to the next heading of any level), by heading."""
    text = _prose(CLI_DOC.read_text(encoding="utf-8"))
    marks = list(HEADING.finditer(text))
    return {
        m.group(2): text[m.end() : marks[i + 1].start() if i + 1 < len(marks) else len(text)]
        for i, m in enumerate(marks)
    }


def test_cli_doc_documents_every_command_and_option():
    """Each command has a section headed ``precache <command>`` that names every option it takes
    (as ``--help`` lists them), and names no option it does not take."""
    sections = _cli_sections()
    problems = []
    for path, parser in _parsers().items():
        if not path or _subcommands(parser):
            continue  # the root and the groups (adapters, bench) have no options of their own
        heading = "precache " + " ".join(path)
        if heading not in sections:
            problems.append(f"no section '{heading}'")
            continue
        named = set(FLAG.findall(sections[heading]))
        problems += [
            f"{heading}: {flag} not documented" for flag in sorted(_documented_options(parser) - named)
        ]
        problems += [f"{heading}: {flag} is not an option" for flag in sorted(named - _options(parser))]
    assert problems == []


def test_every_flag_in_the_cli_doc_is_an_option_of_some_command():
    every = set().union(*(_options(p) for p in _parsers().values()))
    unknown = sorted(set(FLAG.findall(_prose(CLI_DOC.read_text(encoding="utf-8")))) - every)
    assert unknown == []
