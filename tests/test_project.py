"""The project itself: migrations match the models, the database is the one asked for."""

from __future__ import annotations

import io
import os

import pytest
from django.core.management import call_command
from django.db import connection


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


def test_engine_has_no_django_imports() -> None:
    from pathlib import Path

    engine = Path(__file__).resolve().parents[1] / "binder" / "engine"
    for path in engine.glob("*.py"):
        text = path.read_text()
        assert "import django" not in text and "from django" not in text, path.name
