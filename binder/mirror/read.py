"""Translate mirror rows (and freshly parsed objects) into the engine's dataclasses.

Passes, ``dump_state``, the catalog and the admin all need the cluster as the engine
sees it. Rows and parsed Kubernetes objects carry the same field names (the model's),
so one converter per kind serves both, and every consumer gets the same view (and the
same launcher rule, which lives in the engine).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime
from typing import Any

import orjson
from django.conf import settings
from django.db import connection, transaction
from django.db.models import QuerySet
from psycopg import adapters
from psycopg.adapt import Buffer, Loader
from psycopg.postgres import types as pg_types
from psycopg.pq import Format

from binder import models
from binder.engine import types as e
from binder.kube import kinds as kube_kinds
from binder.mirror.convert import CONVERTERS

Values = Mapping[str, Any]
_TIMESTAMPTZ_LOADER = adapters.get_loader(pg_types["timestamptz"].oid, Format.TEXT)


class _JsonbLoader(Loader):
    """jsonb (text format) through orjson: psycopg's loader goes through ``json.loads``
    with its encoding sniffing, 10 µs a value, and a whole read at 1M devices loads 2.7M
    values (20 s of a 90 s cold start)."""

    def load(self, data: Buffer) -> Any:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:  # beyond orjson (integers over 64 bits): the standard library
            return json.loads(bytes(data))


def engine_settings() -> e.Settings:
    return e.Settings(
        enabled=settings.GPUPLANE_ENABLED,
        node_grace_seconds=settings.GPUPLANE_NODE_GRACE_SECONDS,
        default_budget=e.DefaultBudget(settings.GPUPLANE_DEFAULT_BUDGET),
        moves_per_pass=settings.GPUPLANE_MOVES_PER_PASS,
        move_grace_seconds=settings.GPUPLANE_MOVE_GRACE_SECONDS,
    )


#: kind -> (model, converter, the model fields the converter takes after namespace and name)
KINDS: dict[str, tuple[type[Any], Callable[..., Any], tuple[str, ...]]] = {
    k.kind: (getattr(models, k.model), *CONVERTERS[k.kind]) for k in kube_kinds.KINDS if k.converter
}


def _fetch(model: type[Any], columns: tuple[str, ...], queryset: QuerySet | None) -> Iterable[tuple[Any, ...]]:  # type: ignore[type-arg]
    """Rows as tuples. On PostgreSQL a whole table is read through psycopg's own C loaders
    (Django wraps the timestamp and JSON loaders in Python: twice the time at 100k rows),
    :data:`_BATCH` rows at a time from a server-side cursor: a million device rows fetched
    at once held the raw result and every row tuple beside the records built from them
    (half a gigabyte more at the peak of a start)."""
    if queryset is None and connection.vendor == "postgresql":
        return _fetch_batches(model, columns)
    queryset = queryset if queryset is not None else model.objects.all()
    return queryset.order_by().values_list(*columns).iterator(chunk_size=10000)


_BATCH = 50_000


def _select(model: type[Any], columns: tuple[str, ...]) -> str:
    """``SELECT columns FROM`` the model's table (names from the model, quoted)."""
    return f"SELECT {', '.join(connection.ops.quote_name(c) for c in columns)} FROM {model._meta.db_table}"  # noqa: S608 - names from the model


def _with_c_loaders(raw: Any) -> Any:
    """``raw`` (a psycopg cursor) loading timestamps and jsonb with the fast loaders above."""
    raw.adapters.register_loader("timestamptz", _TIMESTAMPTZ_LOADER)
    raw.adapters.register_loader("jsonb", _JsonbLoader)
    return raw


def _fetch_batches(model: type[Any], columns: tuple[str, ...]) -> Iterator[tuple[Any, ...]]:
    # A server-side cursor lives in a transaction: the caller's (a pass's), else one of its own.
    with transaction.atomic(savepoint=False), connection.cursor() as cursor:
        raw = _with_c_loaders(cursor.cursor.connection.cursor(name=f"gpuplane_read_{model._meta.db_table}"))
        try:
            raw.execute(_select(model, columns))
            while rows := raw.fetchmany(_BATCH):
                yield from rows
        finally:
            raw.close()


def fetch_ids(model: type[Any], columns: tuple[str, ...], ids: list[int]) -> Iterator[tuple[Any, ...]]:
    """The rows ``ids`` of ``model`` as tuples of ``columns`` (a catch-up re-reading what
    the feed named). On PostgreSQL one ``id = ANY(array)`` query per 50k ids through the C
    loaders: the ORM's ``id IN (...)`` of 5,000 parameters is parsed again by psycopg for
    every chunk (seconds for the 260k devices 100k new orders write) and its loaders are
    Python."""
    if connection.vendor != "postgresql":
        for i in range(0, len(ids), _IN_CHUNK):
            yield from model.objects.filter(id__in=ids[i : i + _IN_CHUNK]).order_by().values_list(*columns)
        return
    sql = _select(model, columns) + " WHERE id = ANY(%s::bigint[])"
    with connection.cursor() as cursor:
        raw = _with_c_loaders(cursor.cursor)
        for i in range(0, len(ids), _BATCH):
            # The ids as one array literal: psycopg's list dumper is Python, a value at a time.
            raw.execute(sql, ["{" + ",".join(map(str, ids[i : i + _BATCH])) + "}"])
            yield from raw.fetchall()


_IN_CHUNK = 5000


def read_rows(
    kind: str,
    namespaces: Iterable[str] | None = None,
    queryset: QuerySet | None = None,  # type: ignore[type-arg]
    ids: dict[tuple[str, str], int] | None = None,
) -> list[Any]:
    """Engine records of every mirrored ``kind`` (optionally of some namespaces only), in
    no particular order. With ``ids``, row ids are collected into it by (namespace, name)."""
    model, convert, fields = KINDS[kind]
    namespaced = hasattr(model, "NAMESPACE_LOOKUP")
    # A scoped read (the webhook reads one namespace per call) needs only the names of its
    # namespaces, and its few rows in one fetch: reading all namespace names and opening a
    # server-side cursor per kind was a third of a webhook call's time at 1,000 tenants.
    scope = list(namespaces) if namespaces is not None and queryset is None else None
    columns = (*fields, "name", "id", *(("namespace_id",) if namespaced else ()))
    names = dict(models.Namespace.objects.for_tenant(scope).values_list("id", "name")) if namespaced else {}
    width = len(fields)
    records = []
    if scope is None:
        rows = _fetch(model, columns, queryset)
    else:
        rows = model.objects.for_tenant(scope).order_by().values_list(*columns)
    for row in rows:
        namespace = names.get(row[width + 2], "") if namespaced else ""
        records.append(convert(namespace, row[width], *row[:width]))
        if ids is not None:
            ids[(namespace, row[width])] = row[width + 1]
    return records


def read_cluster(now: datetime) -> tuple[e.Cluster, dict[tuple[str, str], int]]:
    """The whole mirror as one engine snapshot (read inside the caller's transaction)."""
    ids: dict[tuple[str, str], int] = {}
    cluster = e.Cluster(
        now=now,
        classes=tuple(read_rows("GPUClass")),
        nodes=tuple(read_rows("Node")),
        devices=tuple(read_rows("GPU", ids=ids)),
        budgets=tuple(read_rows("GPUBudget")),
        vmis=tuple(read_rows("VirtualMachineInstance")),
        pods=tuple(read_rows("Pod")),
        settings=engine_settings(),
        virtual_machines=tuple(read_rows("VirtualMachine")),
    )
    return cluster, ids
