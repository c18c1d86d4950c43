"""Write usage records at the end of every full pass, never in an answer pass.

The binder owns the records (``binder.models.UsageRecord``); the usage app only reads them.

The engine (``binder.engine.usage``) says what is held after the pass and which open
records to close and which to open, and when; this module reads the open records, supplies
the fresh VMI reads the launcher rule needs for pods, and writes the plan in the pass's
transaction. A device's records change at its ``since`` (an answer pass may have bound it
well before this full pass runs), everything else at the pass's time. Because it runs
with the feature switch off too, a deleted device, a deleted class or a deleted namespace
always gets its records closed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connection, transaction

from binder import apiserver
from binder import models as binder_models
from binder.engine import types as e
from binder.engine.launcher import VmiLookup
from binder.engine.usage import (
    IDENTITY_SEPARATOR,
    OpenRecord,
    RecordRow,
    SubjectKind,
    Subjects,
    UsageHolding,
    UsagePlan,
    device_holdings,
    holding_of,
    holdings,
    identity,
    identity_text,
    pair_off,
    pod_holdings,
    reconcile_usage,
    requests_raw_gpu,
)
from binder.kube.objects import ObjectError, parse_object
from binder.mirror.convert import from_parsed
from binder.mirror.read import read_rows
from binder.models import UsageRecord

#: The columns that make up a record's holding, in :class:`UsageHolding` field order.
HOLDING_COLUMNS = (
    "namespace",
    "subject_kind",
    "subject",
    "subject_uid",
    "key",
    "resource_name",
    "units",
    "node",
    "phase",
    "vm_name",
    "borrowed",
)
_CHUNK = 5000
#: A record's :func:`binder.engine.usage.identity_text`, built by PostgreSQL from its row
#: (the same fields, as text, joined by the same separator: chr(31)).
IDENTITY_TEXT_SQL = "concat_ws(chr(31), " + ", ".join(f"{column}::text" for column in HOLDING_COLUMNS) + ")"
#: From this many VMIs to read fresh, :func:`fresh_vmis` reads the whole table instead.
_WHOLE_TABLE_FROM = 5000
#: From this many VMIs to read fresh in cluster mode, one LIST instead of a GET each.
_LIST_VMIS_FROM = 200
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class UsageWrite:
    """How many records a pass opened and closed."""

    opened: int = 0
    closed: int = 0


def fresh_vmis(pods: Iterable[e.Pod]) -> dict[tuple[str, str], e.Vmi]:
    """Read, fresh, only the VMIs named by the owner hints of pods requesting a raw GPU.

    Usage records and the tenant usage API read the VMI a pod's owner hint
    names at the time they need it, not from a snapshot taken earlier, and only for
    pods that request a raw GPU resource. In standalone mode the database is the
    cluster, so this is one query for all the named VMIs (in the caller's transaction).
    The launcher rule itself (``binder.engine.launcher``) then decides from activePods.
    """
    wanted = {(p.namespace, p.owner_vmi) for p in pods if p.owner_vmi and requests_raw_gpu(p)}
    found: dict[tuple[str, str], e.Vmi] = {}
    if wanted and apiserver.cluster_mode():
        return vmis_from_api_server(wanted)
    if wanted:
        # Past a few thousand names the filter is a statement of that many parameters (a
        # full reconciliation at 1M devices names 115k VMIs: seconds to build and send);
        # the whole table through the fast whole-table read costs less.
        queryset = (
            None
            if len(wanted) > _WHOLE_TABLE_FROM and connection.vendor == "postgresql"
            else binder_models.VirtualMachineInstance.objects.filter(
                namespace__name__in={ns for ns, _ in wanted}, name__in={name for _, name in wanted}
            )
        )
        for vmi in read_rows("VirtualMachineInstance", queryset=queryset):
            if (vmi.namespace, vmi.name) in wanted:
                found[(vmi.namespace, vmi.name)] = vmi
    return found


def vmis_from_api_server(wanted: Iterable[tuple[str, str]]) -> dict[tuple[str, str], e.Vmi]:
    """Cluster mode: GET each named VMI from the API server (a missing one is no launcher).

    Past :data:`_LIST_VMIS_FROM` names, one LIST of every VMI instead: a full
    reconciliation names the VMI of every launcher pod (115k at 1M devices), and a GET
    each is that many round trips to the API server in one pass.
    """
    api = apiserver.api()
    wanted = set(wanted)
    found: dict[tuple[str, str], e.Vmi] = {}
    named: list[dict[str, Any] | None]
    if len(wanted) > _LIST_VMIS_FROM:
        named = [obj for obj in api.list("VirtualMachineInstance").items if _key_of(obj) in wanted]
    else:
        named = [api.get("VirtualMachineInstance", namespace, name) for namespace, name in sorted(wanted)]
    for obj in named:
        if obj is None:
            continue
        namespace, name = _key_of(obj)
        try:
            parsed = parse_object(obj, where="from the API server")
        except ObjectError as exc:
            log.warning("VMI %s/%s does not parse, so it has no launcher: %s", namespace, name, exc)
            continue
        if parsed is not None:
            found[(namespace, name)] = from_parsed(parsed)
    return found


def _key_of(obj: dict[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return (str(meta.get("namespace") or ""), str(meta.get("name") or ""))


def lookup(vmis: dict[tuple[str, str], e.Vmi]) -> VmiLookup:
    """The VMI lookup the launcher rule takes, over VMIs already read."""

    def find_vmi(namespace: str, name: str) -> e.Vmi | None:
        return vmis.get((namespace, name))

    return find_vmi


def devices_after(cluster: e.Cluster, changed: Iterable[e.Device]) -> dict[tuple[str, str], e.Device]:
    """The devices as they stand once a pass's changes are written, by (namespace, name)."""
    current = {d.key: d for d in cluster.devices}
    current.update((d.key, d) for d in changed)
    return current


def open_record_rows() -> tuple[list[RecordRow], Callable[[UsageHolding], Hashable]]:
    """Every open record's id and a key of its holding, and the key to give holdings,
    for :func:`binder.engine.usage.pair_off`.

    On PostgreSQL the key is the holding's identity as one text, built by the database
    (:data:`IDENTITY_TEXT_SQL`), read 50,000 rows at a time from a server-side cursor: a
    full reconciliation at 1M devices reads a million records, and ten fresh strings a
    row, read and hashed, were most of what it cost (4.4 s of it; 2 s less this way).
    Elsewhere the key is the identity itself. No start: only the few records left over
    need it (:func:`open_records_by_id`).
    """
    if connection.vendor != "postgresql":
        rows = UsageRecord.objects.open().order_by().values_list("id", *HOLDING_COLUMNS)
        return [(row[0], row[1:]) for row in rows.iterator(chunk_size=10000)], identity
    found: list[RecordRow] = []
    # A server-side cursor lives in a transaction: the pass's, else one of its own.
    with transaction.atomic(savepoint=False), connection.cursor() as django_cursor:
        raw = django_cursor.cursor.connection.cursor(name="gpuplane_open_records", binary=True)
        try:
            raw.execute(
                f'SELECT id, {IDENTITY_TEXT_SQL} FROM {UsageRecord._meta.db_table} WHERE "end" IS NULL'  # noqa: S608 - constant SQL
            )
            while batch := raw.fetchmany(50_000):
                found.extend(batch)
        finally:
            raw.close()
    return found, identity_text


def open_records_by_id(ids: list[int]) -> list[OpenRecord]:
    """The open records ``ids``, whole (with their start)."""
    found: list[OpenRecord] = []
    for i in range(0, len(ids), _CHUNK):
        rows = (
            UsageRecord.objects.filter(id__in=ids[i : i + _CHUNK])
            .order_by()
            .values_list("id", *HOLDING_COLUMNS, "start")
        )
        found.extend(_open_record(row) for row in rows)
    return found


def _open_record(row: tuple[Any, ...]) -> OpenRecord:
    """A row of ``id``, the :data:`HOLDING_COLUMNS` and ``start`` as the engine's record."""
    start = row[-1]
    return OpenRecord(int(row[0]), holding_of(row[1:-1]), start if isinstance(start, datetime) else None)


def open_records_of(subjects: Subjects) -> list[OpenRecord]:
    """The open records of just ``subjects`` (by namespace, kind and name: ``usage_one_open_per_subject``).

    On PostgreSQL one statement joins the subjects as arrays (a pass that bound 10k sets
    across 1,000 tenants took 960 queries, 3.5 s, one per tenant and kind).
    """
    if connection.vendor == "postgresql":
        wanted = [
            (namespace, kind.value, name)
            for kind, pairs in ((SubjectKind.GPU, subjects.device_keys), (SubjectKind.POD, subjects.pod_keys))
            for namespace, name in pairs
        ]
        if not wanted:
            return []
        columns = ", ".join(f"r.{column}" for column in HOLDING_COLUMNS)
        with connection.cursor() as cursor:
            # Each column of subjects as one string split by the server: psycopg dumps a
            # list parameter element by element in Python (a second for the 260k subjects
            # of 100k new orders). No name, kind or namespace holds the separator.
            cursor.execute(
                f"SELECT r.id, {columns}, r.start FROM {UsageRecord._meta.db_table} AS r"  # noqa: S608 - constant SQL
                " JOIN unnest(string_to_array(%s, chr(31)), string_to_array(%s, chr(31)),"
                " string_to_array(%s, chr(31))) AS v(ns, kind, subject)"
                " ON r.namespace = v.ns AND r.subject_kind = v.kind AND r.subject = v.subject"
                ' WHERE r."end" IS NULL',
                [IDENTITY_SEPARATOR.join(k[i] for k in wanted) for i in range(3)],
            )
            return [_open_record(row) for row in cursor.fetchall()]
    found: list[OpenRecord] = []
    for kind, keys in ((SubjectKind.GPU, subjects.device_keys), (SubjectKind.POD, subjects.pod_keys)):
        by_ns: dict[str, set[str]] = {}
        for namespace, name in keys:
            by_ns.setdefault(namespace, set()).add(name)
        for namespace, names in sorted(by_ns.items()):
            ordered = sorted(names)
            for i in range(0, len(ordered), _CHUNK):
                rows = (
                    UsageRecord.objects.open()
                    .filter(namespace=namespace, subject_kind=kind.value, subject__in=ordered[i : i + _CHUNK])
                    .order_by()
                    .values_list("id", *HOLDING_COLUMNS, "start")
                )
                found.extend(_open_record(row) for row in rows)
    return found


def subject_holdings(cluster: e.Cluster, subjects: Subjects) -> tuple[UsageHolding, ...]:
    """What ``subjects`` hold after the pass (pods' VMIs read fresh, as for a full reconciliation)."""
    classes = {c.name: c for c in cluster.classes}
    return holdings(subjects.devices, (), classes, lookup({})) + tuple(
        pod_holdings(subjects.pods, subjects.set_devices, classes, lookup(fresh_vmis(subjects.pods)))
    )


def record_usage(
    pass_id: int,
    now: datetime,
    cluster: e.Cluster,
    changed: Iterable[e.Device],
    subjects: Subjects | None = None,
) -> UsageWrite:
    """Close and open records so that exactly the current holdings are open.

    ``now`` is the pass's time: a device's records change at its ``since`` instead
    where the engine trusts it (``binder.engine.usage.change_time``). With ``subjects``
    (the worker knows what changed since its last pass) only their records are read and
    reconciled: the others cannot have changed. Without them, or when they ask for
    everything, every open record is compared.
    """
    if subjects is not None and not subjects.everything:
        if not subjects.device_keys and not subjects.pod_keys:
            return UsageWrite()
        found, since = open_records_of(subjects), {d.key: d.since for d in subjects.devices}
        plan = reconcile_usage(
            found, subject_holdings(cluster, subjects), now, recorded_until=recorded_until(pass_id), device_since=since
        )
    else:
        after = devices_after(cluster, changed)
        classes = {c.name: c for c in cluster.classes}
        # Unsorted: reconcile_usage sorts what it opens, and only the few left by pair_off.
        current = device_holdings(after.values(), classes) + pod_holdings(
            cluster.pods, after.values(), classes, lookup(fresh_vmis(cluster.pods))
        )
        rows, pairing_key = open_record_rows()
        left_ids, left = pair_off(rows, current, pairing_key)
        records = open_records_by_id(left_ids)
        since = {
            key: after[key].since
            for r in records
            if r.holding.subject_kind is SubjectKind.GPU and (key := (r.holding.namespace, r.holding.subject)) in after
        }
        plan = reconcile_usage(records, left, now, recorded_until=recorded_until(pass_id), device_since=since)
    if plan:
        write_plan(plan, pass_id, now)
    return UsageWrite(opened=len(plan.open), closed=len(plan.close))


def recorded_until(pass_id: int) -> datetime | None:
    """The time of the last full pass before ``pass_id``: records are exact up to then.

    Every full pass reconciles what changed since the one before it, so a device change
    dated before this was recorded by then; None when no full pass ran yet.
    """
    return (
        binder_models.PassRun.objects.filter(kind=binder_models.PassKind.FULL, pk__lt=pass_id)
        .order_by("-pk")
        .values_list("started", flat=True)
        .first()
    )


def write_plan(plan: UsagePlan, pass_id: int, now: datetime) -> None:
    """Close first (the one-open-record constraint), then open; at the plan's times, else ``now``.

    Closes go out one UPDATE per distinct end (a pass's closes share few instants: the
    passes that changed their devices).
    """
    by_end: dict[datetime, list[int]] = {}
    ends = [*plan.ends, *[None] * (len(plan.close) - len(plan.ends))]
    for record_id, end in zip(plan.close, ends, strict=True):
        by_end.setdefault(end or now, []).append(record_id)
    for end, ids in sorted(by_end.items()):
        for i in range(0, len(ids), _CHUNK):
            UsageRecord.objects.filter(id__in=ids[i : i + _CHUNK]).update(end=end, closed_by_pass=pass_id)
    if not plan.open:
        return
    if connection.vendor == "postgresql":
        with (
            connection.cursor() as cursor,
            cursor.cursor.copy(
                f"COPY {UsageRecord._meta.db_table} ({', '.join(HOLDING_COLUMNS)}, start, opened_by_pass) FROM STDIN"
            ) as copy,
        ):
            for h in plan.open:
                copy.write_row((*_holding_row(h), h.since or now, pass_id))
        return
    UsageRecord.objects.bulk_create(
        [
            UsageRecord(
                **dict(zip(HOLDING_COLUMNS, _holding_row(h), strict=True)), start=h.since or now, opened_by_pass=pass_id
            )
            for h in plan.open
        ],
        batch_size=1000,
    )


def _holding_row(h: UsageHolding) -> tuple[object, ...]:
    return (
        h.namespace,
        h.subject_kind.value,
        h.subject,
        h.subject_uid,
        h.key,
        h.resource_name,
        h.units,
        h.node,
        h.phase.value,
        h.vm_name,
        h.borrowed,
    )
