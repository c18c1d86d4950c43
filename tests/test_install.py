"""A first install (issue 15, items 2 and 6): what a user installs and builds from the repository.

The end-to-end proofs are CI scripts, because they need a fresh venv or podman:
``.ci/clean-venv-smoke`` (requirements.txt alone starts gunicorn, the worker, beat and
``sync_cluster``) and ``.ci/image`` (builds the Containerfile and smoke-runs it). These tests
check the cheap half on every run: the pins and the scripts those proofs depend on.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pins(name: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in (ROOT / name).read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)(?:\[[^]]*\])?==(\S+)", line.strip())
        if match:
            found[match.group(1).lower()] = match.group(2)
    return found


def test_runtime_requirements_pin_what_kombus_redis_transport_imports() -> None:
    """kombu.transport.redis imports ``packaging`` without declaring it; the worker would not start."""
    runtime = pins("requirements.txt")
    assert "packaging" in runtime
    assert {"celery", "kombu", "redis"} & set(runtime) >= {"celery", "redis"}


def test_every_runtime_requirement_is_pinned_exactly() -> None:
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            assert "==" in line, f"requirements.txt: {line!r} is not pinned with =="


def test_the_clean_venv_smoke_script_is_there_and_executable() -> None:
    script = ROOT / ".ci" / "clean-venv-smoke"
    assert os.access(script, os.X_OK)
    text = script.read_text()
    assert "-r requirements.txt" in text and "requirements-dev" not in text.split("set -euo", 1)[1]
    for step in ("/healthz", "worker -Q binder", " beat ", "sync_cluster --help"):
        assert step in text
