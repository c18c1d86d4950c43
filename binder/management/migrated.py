"""The commands that read or write the mirror check first that the database is migrated."""

from __future__ import annotations

from django.core.management.base import CommandError
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.migrations.executor import MigrationExecutor


def require_migrated() -> None:
    """Stop with "run migrate" when migrations are not applied, instead of a traceback
    about a missing table halfway through (a fresh clone's first command)."""
    connection = connections[DEFAULT_DB_ALIAS]
    executor = MigrationExecutor(connection)
    pending = executor.migration_plan(executor.loader.graph.leaf_nodes())
    if pending:
        where = connection.settings_dict["NAME"]
        raise CommandError(
            f"the database ({where}) is not migrated: {len(pending)} migrations to apply; "
            "run `.venv/bin/python manage.py migrate` first"
        )
