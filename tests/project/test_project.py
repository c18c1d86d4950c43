"""The project itself: migrations match the models, the database is the one asked for, and
the engine's tests import without Django."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.management import call_command
from django.db import connection

ROOT = Path(__file__).resolve().parents[2]
#: Tests of the pure engine, the parsers and the manifests, and the helper modules they use.
DJANGO_FREE_TESTS = (
    "tests.engine.test_engine",
    "tests.engine.test_launcher",
    "tests.engine.test_properties",
    "tests.project.test_deploy",
    "harness.shapes",
    "harness.factories",
    "harness.engine_invariants",
    "harness.manifests",
)
#: The layers .importlinter keeps free of Django (contracts engine-pure and django-free).
DJANGO_FREE_CODE = (
    "binder.engine",
    "binder.kube.objects",
    "binder.kube.core",
    "binder.kube.resources",
    "binder.kube.fields",
    "binder.kube.client",
    "binder.mirror.convert",
    "webhooks.admission",
)


@pytest.mark.django_db
def test_models_match_migrations() -> None:
    out = io.StringIO()
    try:
        call_command("makemigrations", "--check", "--dry-run", stdout=out, stderr=out)
    except SystemExit as exc:  # makemigrations --check exits 1 when a migration is missing
        pytest.fail(f"models and migrations differ:\n{out.getvalue()} (exit {exc.code})")


@pytest.mark.django_db
def test_database_backend_is_the_one_configured() -> None:
    url = os.environ.get("DATABASE_URL", "")
    expected = "postgresql" if url.startswith(("postgres://", "postgresql://")) else "sqlite"
    assert connection.vendor == expected


def test_engine_tests_and_the_django_free_layers_import_without_django_settings() -> None:
    """The engine's tests and the modules they stand on import with no Django settings
    and load no Django at all.

    What the engine (``binder.engine``), the parsers and client (``binder.kube``), the
    converters (``binder.mirror.convert``) and the admission decision (``webhooks.admission``)
    may import is guarded by the import contracts in .importlinter, which ``make lint``
    checks (lint-imports). This is the other end of the same promise: in a fresh
    interpreter with DJANGO_SETTINGS_MODULE removed, importing those modules, the test
    modules of the pure engine and the helper modules they use leaves ``django`` out of
    ``sys.modules`` (a module that needs settings would fail to import, one that merely
    pulls Django in would show there).
    """
    code = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    importlib.import_module(name)\n"
        "loaded = sorted(m for m in sys.modules if m == 'django' or m.startswith('django.'))\n"
        "assert 'django' not in sys.modules, loaded\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    done = subprocess.run(
        [sys.executable, "-c", code, *DJANGO_FREE_TESTS, *DJANGO_FREE_CODE],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_test_module_imports_another() -> None:
    """Tests share objects through fixtures (tests/conftest.py) and helper modules
    (harness/factories.py, harness/shapes.py, harness/workers.py, ...), never by importing a test
    module: that would run its tests' collection twice and hide what is shared."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    pattern = re.compile(
        r"^\s*(from tests(\.\w+)*\.test_\w+ import|from tests(\.\w+)* import .*\btest_\w+|import tests(\.\w+)*\.test_)",
        re.M,
    )
    offenders = [
        str(path.relative_to(root))
        for folder in ("tests", "harness", "bench")
        for path in sorted((root / folder).rglob("*.py"))
        if "vendor" not in path.parts and pattern.search(path.read_text())
    ]
    assert offenders == []
