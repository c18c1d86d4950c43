"""The repository is self-contained.

A user clones the repository and runs ``make test`` with nothing beside it, so no tracked
file may read a path outside the clone: the real Kubernetes and KubeVirt captures the tests
use live in ``tests/fixtures/kubernetes`` (with their SOURCES.md and NOTES.md). This scans
every tracked file for the ways a path escapes the repository: a relative ``../`` that
resolves above the root, ``Path(__file__).parents[n]`` or ``.parent`` chains climbing past
it, and absolute paths into the machine the repository was written on.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Built from parts so this file does not match its own patterns.
SHARED = "shared" + "/fixtures"
UP_SHARED = ".." + "/shared"
WORK = "/" + "work/"
UP = ".." + "/"
HERE = "Path(__file__).resolve()"

RELATIVE = re.compile(r"(?<![\w./$)}-])((?:\.\./)+[\w.-]*)")
PARENTS = re.compile(r"Path\(__file__\)\.resolve\(\)\.parents\[(\d+)\]")
PARENT_CHAIN = re.compile(r"Path\(__file__\)\.resolve\(\)((?:\.parent)+)")


def tracked_files() -> list[Path]:
    try:
        listing = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: nothing tracked to scan")
    return [ROOT / name for name in listing.split("\0") if name]


def text_of(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
        return None


def escapes(path: Path, text: str) -> list[str]:
    """Every reference in ``text`` (of tracked file ``path``) to a path outside the repository."""
    rel = path.relative_to(ROOT)
    found = [f"{rel}: names {needle!r}" for needle in (SHARED, UP_SHARED, WORK) if needle in text]
    if path.suffix == ".md":
        # Documentation may show a user's own overlay beside the clone; it reads nothing.
        return found
    depth = len(rel.parts) - 1  # directories between the file and the root
    found.extend(
        f"{rel}: {m.group(0)} climbs above the repository root"
        for m in PARENTS.finditer(text)
        if int(m.group(1)) > depth
    )
    found.extend(
        f"{rel}: {m.group(0)} climbs above the repository root"
        for m in PARENT_CHAIN.finditer(text)
        if m.group(1).count(".parent") - 1 > depth
    )
    found.extend(
        f"{rel}: {m.group(1)!r} resolves outside the repository"
        for m in RELATIVE.finditer(text)
        if not (path.parent / m.group(1)).resolve().is_relative_to(ROOT)
    )
    return found


def test_no_tracked_file_refers_to_a_path_outside_the_repository() -> None:
    problems = [
        problem for path in tracked_files() if (text := text_of(path)) is not None for problem in escapes(path, text)
    ]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("tests/x.py", HERE + ".parents[2] / 'fixtures'"),
        ("tests/x.py", HERE + ".parent.parent.parent / 'x'"),
        ("deploy/base/kustomization.yaml", "resources:\n  - " + UP * 3 + "elsewhere\n"),
        ("tests/x.py", "open('" + UP_SHARED + "/fixtures/real/node.yaml')"),
        ("Makefile", "cp " + WORK + "main/x ."),
    ],
)
def test_the_scan_catches_each_way_out(name: str, text: str) -> None:
    """The scanner itself: each escape it is meant to find is found."""
    assert escapes(ROOT / name, text)


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("tests/x.py", HERE + ".parents[1] / 'deploy'"),
        ("gpuplane/settings.py", HERE + ".parent.parent"),
        ("deploy/overlays/cluster/kustomization.yaml", "resources:\n  - " + UP * 2 + "base\n"),
    ],
)
def test_the_scan_allows_paths_inside(name: str, text: str) -> None:
    assert not escapes(ROOT / name, text)


def test_the_real_captures_are_in_the_repository() -> None:
    from harness.shapes import FIXTURES

    assert FIXTURES.is_relative_to(ROOT)
    names = {p.name for p in FIXTURES.iterdir()}
    assert {"SOURCES.md", "NOTES.md", "node-with-gpus.yaml", "vmi-with-gpus.yaml"} <= names
