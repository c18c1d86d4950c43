"""The cluster-wide pass lock: one pass at a time, whatever runs it.

The single Celery queue already orders passes, but several worker processes, a
management command or a second replica could still start one at the same moment.
Two overlapping passes could book the same free units twice, so every pass holds
this lock for its whole transaction: a PostgreSQL transaction-level advisory lock
(released by commit or rollback, even if the worker is killed), or on SQLite an
exclusive file lock next to the database.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

from django.conf import settings
from django.db import connection, transaction

#: Arbitrary 64-bit key, "gpuplane" in ASCII; the same in every process.
ADVISORY_KEY = 0x6770_7570_6C61_6E65 - (1 << 63)


@contextlib.contextmanager
def pass_lock() -> Iterator[None]:
    """Hold the cluster-wide pass lock; must run inside ``transaction.atomic()``."""
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("pass_lock() must be taken inside transaction.atomic()")
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [ADVISORY_KEY])
        yield
        return
    path = Path(settings.DATABASES["default"]["NAME"]).with_suffix(".pass.lock")
    if str(settings.DATABASES["default"]["NAME"]).startswith(":memory:") or "mode=memory" in str(
        settings.DATABASES["default"]["NAME"]
    ):
        path = Path(settings.VAR_DIR) / "memory-db.pass.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
