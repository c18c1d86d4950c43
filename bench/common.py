"""What every bench shares: the bench database (created if missing, never a forbidden one), Django
set-up, bulk loading with COPY, percentiles and peak memory, and the watch that follows a
collection of the API as an informer does."""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import os
import resource
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/gpuplane_bench"


FORBIDDEN_DATABASES = {"test", "postgres", "template0", "template1", "gpuplane"}


def database_name(url: str) -> str:
    return urlparse(url).path.lstrip("/")


def dedicated_name(url: str, example: str = DEFAULT_URL) -> str:
    """The database ``url`` names, refused if it is not a bench's own (one of
    :data:`FORBIDDEN_DATABASES`, or none)."""
    name = database_name(url)
    if not name or name in FORBIDDEN_DATABASES:
        raise SystemExit(f"refusing to use database {name!r}: give a dedicated one, e.g. {example}")
    return name


def admin_url(url: str) -> str:
    """The server of ``url``, at its ``postgres`` database (to create or drop others)."""
    return urlparse(url)._replace(path="/postgres").geturl()


def ensure_database(url: str) -> None:
    """Create the bench database if it does not exist (never touches any other one)."""
    import psycopg
    from psycopg import sql

    name = dedicated_name(url)
    with psycopg.connect(admin_url(url), autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone() is None:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def require_connections(url: str, need: int) -> int:
    """Stop with a clear message unless the PostgreSQL server of ``url`` has ``need``
    connections free (a bench's processes keep one per thread; the server is shared with other
    runs, and a bench that hits ``too many clients`` mid-run loses its last rounds). Returns the
    connections free."""
    import psycopg

    with psycopg.connect(admin_url(url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT current_setting('max_connections')::int"
            " - current_setting('superuser_reserved_connections')::int, count(*) FROM pg_stat_activity"
            " WHERE backend_type = 'client backend'"
        ).fetchone()
    assert row is not None
    usable, used = int(row[0]), int(row[1])
    free = usable - used
    if free < need:
        server = urlparse(url)
        raise SystemExit(
            f"PostgreSQL at {server.hostname}:{server.port or 5432} has {free} of {usable} "
            f"connections free ({used} in use); this bench needs about {need}: stop the other runs using it "
            "or raise max_connections"
        )
    return free


def vacuum_analyze(url: str) -> float:
    """``VACUUM ANALYZE`` the bench database; returns the seconds it took.

    Production PostgreSQL runs autovacuum (on by default), which keeps dead row versions
    and planner statistics in check between passes. The project's machine runs PostgreSQL
    with ``autovacuum = off`` (its CI configuration), so a bench that reruns passes on one
    database measures a heap and indexes bloated by every earlier run (seen: 2M dead device
    rows beside 1M live, a 100k-orders pass 15 % slower, a usage join planned as an
    external sort on statistics of an empty table). Benches call this before each measured
    step, untimed, standing for an autovacuum that kept up.
    """
    import psycopg

    clock = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
    return time.perf_counter() - clock


def drop_database(url: str) -> None:
    """Drop the bench database ``url`` names (never one of :data:`FORBIDDEN_DATABASES`),
    closing this process's connections first if Django is set up already."""
    import psycopg
    from django.conf import settings
    from django.db import connections
    from psycopg import sql

    name = dedicated_name(url)
    if settings.configured:
        connections.close_all()
    with psycopg.connect(admin_url(url), autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def setup_django(url: str, migrate: bool) -> None:
    os.environ["DATABASE_URL"] = url
    os.environ["GPUPLANE_AUTO_PASS"] = "false"  # noqa: S105 (not a password) the bench runs every pass itself
    os.environ.setdefault("GPUPLANE_LOG_LEVEL", "WARNING")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gpuplane.settings")
    import django

    django.setup()
    if migrate:
        from django.core.management import call_command

        call_command("migrate", verbosity=0, interactive=False)


def json_dump(value: Any) -> Any:
    return json.dumps(value) if isinstance(value, (dict, list)) else value


def model_defaults(model: Any, columns: Sequence[str]) -> tuple[list[str], list[Any]]:
    """The columns of ``model`` not in ``columns`` that need a value from the client (a
    default, or NOT NULL text), with those values: raw INSERT and COPY name every column,
    so a new column with a default must not break a bench."""
    extra = [
        f for f in model._meta.concrete_fields
        if not f.primary_key and f.attname not in columns and f.name not in columns
        and (f.has_default() or (not f.null and f.empty_strings_allowed))
    ]  # fmt: skip
    return [f.attname for f in extra], [f.get_default() for f in extra]


def load(model: Any, columns: Sequence[str], rows: Iterable[Sequence[Any]], loader: str, advance: Callable) -> int:
    """Insert ``rows`` (values in ``columns`` order) with COPY or ``bulk_create``."""
    from django.db import connection

    count = 0
    # Fields the generator does not name get their model default (COPY names every column).
    extra, defaults = model_defaults(model, columns)
    if extra:
        columns = [*columns, *extra]
        rows = ([*row, *defaults] for row in rows)
    if loader == "copy":
        table = connection.ops.quote_name(model._meta.db_table)
        cols = ", ".join(connection.ops.quote_name(c) for c in columns)
        with connection.cursor() as cursor, cursor.copy(f"COPY {table} ({cols}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row([json_dump(v) for v in row])
                count += 1
                if count % 5000 == 0:
                    advance(5000)
        advance(count % 5000)
        return count
    batch: list[Any] = []
    for row in rows:
        batch.append(model(**dict(zip(columns, row, strict=True))))
        if len(batch) == 5000:
            model.objects.bulk_create(batch, batch_size=5000)
            count += len(batch)
            advance(len(batch))
            batch = []
    if batch:
        model.objects.bulk_create(batch, batch_size=5000)
        count += len(batch)
        advance(len(batch))
    return count


class Packer:
    """Best-fit placement per resource: the node with the fewest free units that fits.

    The same policy as the binder ("fullest node with room"), so the generated cluster
    looks like one the binder packed, and no node is ever over-booked.
    """

    def __init__(self, nodes_by_class: dict[str, list[int]], gpus: int) -> None:
        self.gpus = gpus
        self.free: dict[int, int] = {}
        # buckets[class][free units] -> node indexes (a stack; deterministic)
        self.buckets: dict[str, list[list[int]]] = {}
        for cls, indexes in nodes_by_class.items():
            buckets: list[list[int]] = [[] for _ in range(gpus + 1)]
            buckets[gpus] = list(reversed(indexes))
            self.buckets[cls] = buckets
            for i in indexes:
                self.free[i] = gpus

    def take(self, cls: str, units: int) -> int | None:
        buckets = self.buckets[cls]
        for free in range(units, self.gpus + 1):
            if buckets[free]:
                node = buckets[free].pop()
                self.free[node] = free - units
                buckets[free - units].append(node)
                return node
        return None


def pct(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def _status_mib(field: str, pid: int | str) -> float | None:
    """One memory line of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``) in MiB; None if absent."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return None


def rss_mib(pid: int | str = "self") -> float:
    """A process's resident memory now (VmRSS), in MiB (this one by default): what a step
    holds after it ran."""
    return _status_mib("VmRSS", pid) or 0.0


def peak_rss_mib(pid: int | str = "self") -> float:
    """Peak RSS of a process image (this one by default): VmHWM, which exec resets (Linux keeps
    ru_maxrss of the parent across fork and exec, so a child spawned by a big parent would
    report the parent's)."""
    peak = _status_mib("VmHWM", pid)
    if peak is not None:
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 if pid == "self" else 0.0


def lock_held_elsewhere() -> bool:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database "
            "WHERE l.locktype = 'advisory' AND l.granted AND d.datname = current_database() "
            "AND l.pid <> pg_backend_pid()"
        )
        return cursor.fetchone()[0] > 0


def wait_idle(broker: Any, key_prefix: str, timeout: float = 180) -> float:
    """Until the worker has nothing queued or running (the collapse keys gone, the queue
    lists empty, the pass lock free, every bind request answered); seconds waited.
    SystemExit after ``timeout`` (``idle_after`` says what a finished run does then)."""
    from django.db.models import F

    from binder import models

    clock = time.monotonic()
    quiet = 0
    while time.monotonic() - clock < timeout:
        queued = 0
        for key in broker.scan_iter(match=key_prefix + "*"):
            kind = broker.type(key)
            if kind == b"list":
                queued += broker.llen(key)
            elif b"-pass-queued" in key or key.endswith((b"unacked", b"unacked_index")):
                queued += broker.zcard(key) if kind == b"zset" else broker.hlen(key) if kind == b"hash" else 1
        unanswered = models.GpuDevice.objects.exclude(bind_request="").exclude(answered_request=F("bind_request"))
        busy = queued or lock_held_elsewhere() or unanswered.exists()
        quiet = 0 if busy else quiet + 1
        if quiet >= 3:  # idle three times in a row, 0.5 s apart
            return time.monotonic() - clock
        time.sleep(0.5)
    raise SystemExit(f"the worker did not go idle within {timeout:.0f} s")


class Watch:
    """One collection of the API followed as an informer follows it, on a thread of its own:
    listed, then watched from the list's resourceVersion; when the apiserver ends the watch (it
    drops a watcher that falls behind a burst, and answers 410 Gone once the version is
    compacted away) it lists again (``relists`` counts them) and watches on.

    What the objects mean is the owner's: ``listed(items, now)`` is called with every object of
    each list, ``event(type, object, now)`` with each ADDED, MODIFIED or DELETED event (``now``:
    ``time.perf_counter()`` when it arrived), both while ``changed`` is held; ``changed`` is
    notified after each. A failure is kept in ``error`` (and notified) and ends the watch.
    ``plane`` is the test harness's control plane (``harness.controlplane.ControlPlane``).
    """

    def __init__(
        self,
        plane: Any,
        path: str,
        *,
        listed: Callable[[list[dict[str, Any]], float], None],
        event: Callable[[str, dict[str, Any], float], None],
        timeout_seconds: int,
        name: str,
    ) -> None:
        self.plane, self.path = plane, path
        self._listed, self._event = listed, event
        self.timeout_seconds = timeout_seconds
        self.changed = threading.Condition()
        self.error = ""
        self.closed = False
        self.relists = 0
        self.conn: http.client.HTTPSConnection | None = None
        version = self._list()
        self.thread = threading.Thread(target=self._follow, args=(version,), name=name, daemon=True)
        self.thread.start()

    def _list(self) -> str:
        listed = self.plane.request("GET", self.path)
        now = time.perf_counter()
        with self.changed:
            self._listed(listed["items"], now)
            self.changed.notify_all()
        return str(listed["metadata"]["resourceVersion"])

    def _follow(self, version: str) -> None:
        from harness.controlplane import ADMIN_USER

        host, port = urllib.parse.urlsplit(self.plane.url).netloc.rsplit(":", 1)
        sep = "&" if "?" in self.path else "?"
        headers = {"Authorization": f"Bearer {self.plane.token(ADMIN_USER)}"}
        while not self.closed:
            try:
                self.conn = http.client.HTTPSConnection(host, int(port), context=self.plane.ssl_context())
                query = f"watch=1&allowWatchBookmarks=true&timeoutSeconds={self.timeout_seconds}"
                query += f"&resourceVersion={version}"
                self.conn.request("GET", self.path + sep + query, headers=headers)
                response = self.conn.getresponse()
                if response.status != 200:
                    raise OSError(f"HTTP {response.status}: {response.read()[:300]!r}")
                while line := response.readline():
                    event = json.loads(line)
                    now = time.perf_counter()
                    kind, obj = event["type"], event["object"]
                    if kind == "ERROR":  # 410 Gone: the version was compacted away; list again
                        break
                    version = obj["metadata"].get("resourceVersion") or version
                    if kind == "BOOKMARK":
                        continue
                    with self.changed:
                        self._event(kind, obj, now)
                        self.changed.notify_all()
                if self.closed:
                    return
                self.relists += 1
                version = self._list()
            except Exception as exc:  # noqa: BLE001 - http.client fails in several ways once closed
                if self.closed:
                    return
                with self.changed:
                    self.error = f"{type(exc).__name__}: {exc}"
                    self.changed.notify_all()
                return
            finally:
                if self.conn is not None:
                    self.conn.close()

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError, AttributeError):
            if self.conn is not None and self.conn.sock is not None:
                self.conn.sock.shutdown(socket.SHUT_RDWR)
        self.thread.join(timeout=5)
