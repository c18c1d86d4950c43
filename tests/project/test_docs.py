"""What README.md and docs/*.md show exists: commands, Make targets, bench flags, links.

A newcomer copies commands from the docs and follows their links. So every
``manage.py <command>`` shown is a command Django knows, every ``make <target>`` is a
target of the Makefile, every ``python -m bench.<name> --flag`` is one of that bench's options
(read from its ``--help``, so argparse is the truth), no bench is shown run as a script
(``python bench/<name>.py``: the benches are a package), and every relative link, image and
``#anchor`` resolves to a file and a heading (GitHub's anchor rules). Commands are looked
for in code only (inline code and fenced blocks), where a reader would copy them from.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest
from django.core.management import get_commands

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
#: The longest table cell a page may have: past it, detail belongs in prose or a list under the table.
MAX_CELL = 300
TABLE_PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


def code_lines(text: str) -> Iterator[str]:
    """Each line of a fenced block, and each inline code span elsewhere (its own "line")."""
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            yield line
        else:
            yield from re.findall(r"`([^`]+)`", line)


def prose_lines(text: str) -> Iterator[str]:
    """The lines outside fenced blocks, with inline code removed (links are not code)."""
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield re.sub(r"`[^`]*`", "", line)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed,
    spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"[`*_]", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = defaultdict(int)
    fenced = False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        match = HEADING.match(line)
        if match and not fenced:
            base = slug(match.group(2))
            found.add(base if not seen[base] else f"{base}-{seen[base]}")
            seen[base] += 1
    return found


def broken_links(page: Path) -> list[str]:
    """Every relative link, image or anchor of ``page`` that leads nowhere."""
    problems = []
    for line in prose_lines(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
                continue
            path_part, _, anchor = target.partition("#")
            linked = (page.parent / path_part).resolve() if path_part else page
            if not linked.exists():
                problems.append(f"{page.name}: {target}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                problems.append(f"{page.name}: {target}: no heading #{anchor} in {linked.name}")
    return problems


def long_cells(text: str, limit: int = MAX_CELL) -> list[str]:
    """``line N: first words`` for every cell of a Markdown table (outside fenced blocks) longer
    than ``limit`` characters; an escaped ``\\|`` is part of its cell."""
    found = []
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced or not line.startswith("|"):
            continue
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        found += [f"line {number}: {len(cell)} characters: {cell[:60]}..." for cell in cells if len(cell) > limit]
    return found


#: A bench on a command line: ``python -m bench.<name>``.
BENCH = re.compile(r"-m\s+bench\.(\w+)")
#: A bench run as a script, which no longer starts (its imports are the package's).
BENCH_SCRIPT = re.compile(r"python[\w.]*\s+(?:\S*/)?bench/\w+\.py")


@cache
def bench_options(name: str) -> frozenset[str]:
    done = subprocess.run(
        [sys.executable, "-m", f"bench.{name}", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"python -m bench.{name} --help failed:\n{done.stderr}"
    return frozenset(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", done.stdout))


def bench_flags(text: str) -> Iterator[tuple[str, str]]:
    """(bench, flag) for every flag shown with a bench: on its command line, its
    continuation lines, and the ``# options: ...`` comment lines after it."""
    name = None
    continued = False
    for line in code_lines(text):
        named = BENCH.findall(line)
        if named:
            name = named[-1]
        elif not (continued or re.match(r"\s*#\s*(options:)?\s*--", line)):
            name = None
        continued = line.rstrip().endswith("\\")
        if name is not None:
            shown = line.split(f"bench.{name}", 1)[-1] if named else line
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", shown):
                yield name, flag


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_manage_py_command_shown_exists(page: Path) -> None:
    known = set(get_commands())
    shown = {m for line in code_lines(page.read_text()) for m in re.findall(r"manage\.py\s+([a-z_]+)", line)}
    assert sorted(shown - known) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_make_target_shown_exists(page: Path) -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z0-9-]*)\s*:(?!=)", makefile, re.MULTILINE))
    shown = {
        m for line in code_lines(page.read_text()) for m in re.findall(r"(?<![\w-])make\s+([a-z][a-z0-9-]*)", line)
    }
    assert sorted(shown - targets) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_bench_flag_shown_is_an_option_of_its_script(page: Path) -> None:
    wrong = sorted({f"bench.{s} {f}" for s, f in bench_flags(page.read_text()) if f not in bench_options(s)})
    assert wrong == []


@pytest.mark.parametrize("page", TABLE_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_table_cell_is_longer_than_a_reader_skims(page: Path) -> None:
    assert long_cells(page.read_text()) == [], f"cells over {MAX_CELL} characters: move detail under the table"


def test_a_long_cell_is_found_and_a_short_one_or_one_in_code_is_not() -> None:
    text = (
        "| a | b |\n|---|---|\n"
        f"| short | {'y' * MAX_CELL} |\n"
        f"| `{'a' * 200}\\|{'b' * 200}` | an escaped bar stays in its cell |\n"
        f"| {'x' * (MAX_CELL + 1)} | fine |\n"
        f"```\n| {'z' * 400} |\n```\n"
        f"not a table {'z' * 400}\n"
    )
    assert long_cells(text) == [f"line 4: 404 characters: `{'a' * 59}...", f"line 5: 301 characters: {'x' * 60}..."]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_bench_shown_is_run_as_a_module(page: Path) -> None:
    assert [line for line in code_lines(page.read_text()) if BENCH_SCRIPT.search(line)] == []


def test_the_docs_show_what_the_checks_look_for() -> None:
    """The finders find: a check that found nothing would pass on any text."""
    text = "\n".join(p.read_text() for p in PAGES)
    assert {"demo", "issue_token", "webhook_cert", "load_snapshot"} <= {
        m for line in code_lines(text) for m in re.findall(r"manage\.py\s+([a-z_]+)", line)
    }
    assert {"demo", "test", "lint"} <= {m for line in code_lines(text) for m in re.findall(r"make\s+([a-z-]+)", line)}
    assert len(set(bench_flags(text))) > 30
    assert sum(len(LINK.findall(line)) for page in PAGES for line in prose_lines(page.read_text())) > 30


def test_a_broken_link_an_unknown_anchor_a_missing_command_and_flag_are_found(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## A section: with punctuation\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\nSee [there](other.md#a-section-with-punctuation), [here](#page),\n"
        "[gone](missing.md), [no anchor](other.md#nothing) and [none here](#nowhere).\n\n"
        "```sh\n# [not a link](in-code.md)\n.venv/bin/python -m bench.engine_bench --nodes 10 --no-such-flag\n"
        "# options: --sets --nor-this\nmanage.py no_such_command\nmake no-such-target\n"
        ".venv/bin/python bench/engine_bench.py --nodes 10\n```\n"
    )
    assert broken_links(page) == [
        "page.md: missing.md: no such file",
        "page.md: other.md#nothing: no heading #nothing in other.md",
        "page.md: #nowhere: no heading #nowhere in page.md",
    ]
    flags = [f for s, f in bench_flags(page.read_text()) if f not in bench_options(s)]
    assert flags == ["--no-such-flag", "--nor-this"]
    assert [line for line in code_lines(page.read_text()) if BENCH_SCRIPT.search(line)] == [
        ".venv/bin/python bench/engine_bench.py --nodes 10"
    ]
    shown = [m for line in code_lines(page.read_text()) for m in re.findall(r"manage\.py\s+([a-z_]+)", line)]
    assert shown == ["no_such_command"] and "no_such_command" not in get_commands()


def test_every_manage_py_line_shown_runs_as_written_with_the_system_python_first(tmp_path: Path) -> None:
    """A newcomer pastes ``./manage.py issue_token ...`` in a shell whose ``python3`` is the
    system's (no Django): each command shown that way starts (its ``--help``) and is the
    project's, from its venv."""
    shown = sorted(
        {
            m
            for page in PAGES
            for line in code_lines(page.read_text())
            for m in re.findall(r"\./manage\.py\s+([a-z_]+)", line)
        }
    )
    assert shown, "the docs show no ./manage.py command any more: drop this test"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    system_python = Path(sys.base_prefix) / "bin" / "python3"
    assert subprocess.run([system_python, "-c", "import django"], capture_output=True, check=False).returncode
    (bin_dir / "python3").symlink_to(system_python)
    for name in shown:
        done = subprocess.run(
            [str(ROOT / "manage.py"), name, "--help"],
            env={"PATH": f"{bin_dir}:/usr/bin:/bin", "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}"},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=tmp_path,
        )
        assert done.returncode == 0, (name, done.stderr)
        assert f"manage.py {name}" in done.stdout
