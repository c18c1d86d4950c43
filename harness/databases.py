"""One migrated PostgreSQL template per set of migrations; every test database is its copy.

With xdist each worker has a test database of its own (``test_<name>_gw0``, ...), and
migrating each from nothing costs every worker the whole migration history. Instead the
first worker migrates a template once (``test_<name>_template_<digest>``, the digest of
every migration file, so a changed or added migration makes a new template and never
reuses a stale one) and every worker's database is created from it
(``CREATE DATABASE ... TEMPLATE``, Django's ``TEST["TEMPLATE"]``); Django's migrate on
the copy then finds nothing to apply. Unlike ``--reuse-db``, no test database is ever
reused: each run starts from a copy of what the migrations make. A template is marked
complete (a comment on the database) only after its migrate succeeded; an unmarked one
(a run killed half way) is dropped and made again. Workers take turns through an
advisory lock while they check or make it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from django.db import connection

ROOT = Path(__file__).resolve().parents[1]
COMPLETE = "gpuplane test template: migrated"
#: pg_advisory_lock key of the template's making (any fixed number; per server).
LOCK_KEY = 0x6770_7465_6D70


def migrations_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(ROOT.glob("*/migrations/*.py")):
        digest.update(str(path.relative_to(ROOT)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def _url(db: dict[str, Any], name: str) -> str:
    auth = db["USER"] + (f":{db['PASSWORD']}" if db.get("PASSWORD") else "")
    return f"postgres://{auth}@{db.get('HOST') or '127.0.0.1'}:{db.get('PORT') or 5432}/{name}"


def migrated_template(db: dict[str, Any]) -> str:
    """The name of a complete template for ``db``'s test databases, made if missing."""
    base = f"test_{db['NAME']}_template"
    name = f"{base}_{migrations_digest()}"
    with connection._nodb_cursor() as cursor:  # the server's maintenance database, as Django's test set-up
        cursor.execute("SELECT pg_advisory_lock(%s)", [LOCK_KEY])
        try:
            cursor.execute("SELECT shobj_description(oid, 'pg_database') FROM pg_database WHERE datname = %s", [name])
            row = cursor.fetchone()
            if row is not None and row[0] == COMPLETE:
                return name
            cursor.execute("SELECT datname FROM pg_database WHERE datname LIKE %s", [base.replace("_", r"\_") + "%"])
            for (old,) in cursor.fetchall():  # older digests, or this one half made
                cursor.execute(f'DROP DATABASE IF EXISTS "{old}"')
            cursor.execute(f'CREATE DATABASE "{name}"')
            env = {**os.environ, "DATABASE_URL": _url(db, name), "GPUPLANE_AUTO_PASS": "false"}
            done = subprocess.run(
                [sys.executable, "manage.py", "migrate", "--verbosity", "0"],
                cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            if done.returncode != 0:
                cursor.execute(f'DROP DATABASE IF EXISTS "{name}"')
                raise RuntimeError(f"migrating the test template {name} failed:\n{done.stdout}{done.stderr}")
            cursor.execute(f"COMMENT ON DATABASE \"{name}\" IS '{COMPLETE}'")
            return name
        finally:
            cursor.execute("SELECT pg_advisory_unlock(%s)", [LOCK_KEY])
