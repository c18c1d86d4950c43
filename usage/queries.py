"""Read-side of usage: GPU-hours in a window (in SQL) and a tenant's current usage.

GPU-hours are summed by the database (units × overlap of each record with the window),
so a tenant with a year of records costs one aggregate query, not a Python loop over
rows. Current usage comes from the engine's one ledger over the tenant's slice of the
mirror, with pods' raw usage decided by the shared launcher reader on VMIs read fresh,
so it always agrees with what the binder enforces.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db.models import Expression, ExpressionWrapper, F, FloatField, Func, Q, QuerySet, Sum, Value
from django.db.models.functions import Coalesce, Greatest, Least

from binder import models as binder_models
from binder.engine import Limits, build_ledger, effective_limits, tenant_usage
from binder.engine.limits import is_raw_key, remaining
from binder.mirror.read import engine_settings, read_rows
from binder.models import SubjectKind
from binder.runtime.usage_records import fresh_vmis
from usage.models import UsageRecord

SECONDS_PER_HOUR = 3600.0


class Seconds(Func):
    """``later − earlier`` in seconds, as a float, in SQL (PostgreSQL and SQLite)."""

    output_field = FloatField()
    arity = 2

    def as_postgresql(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        return self.as_sql(compiler, connection, template="EXTRACT(EPOCH FROM (%(expressions)s))", arg_joiner=" - ")

    def as_sqlite(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        return self.as_sql(
            compiler,
            connection,
            template="((julianday(%(expressions)s)) * 86400.0)",
            arg_joiner=") - julianday(",
        )


def held_until(now: datetime) -> Expression:
    """A record's end, or ``now`` while it is open."""
    return Coalesce(F("end"), Value(now))


def in_window(queryset: QuerySet[UsageRecord], start: datetime, end: datetime, now: datetime) -> QuerySet[UsageRecord]:
    """Records that overlap ``[start, end)`` (open records run until ``now``)."""
    return queryset.filter(start__lt=end).filter(Q(end__isnull=True, start__lt=now) | Q(end__gt=start))


def with_window_seconds(
    queryset: QuerySet[UsageRecord], start: datetime, end: datetime, now: datetime
) -> QuerySet[UsageRecord]:
    """Annotate ``unit_seconds``: units × seconds of the record inside the window."""
    upper = min(end, now)
    overlap = Seconds(Least(held_until(now), Value(upper)), Greatest(F("start"), Value(start)))
    return in_window(queryset, start, upper, now).annotate(
        unit_seconds=ExpressionWrapper(F("units") * overlap, output_field=FloatField())
    )


def with_record_hours(queryset: QuerySet[UsageRecord], now: datetime) -> QuerySet[UsageRecord]:
    """Annotate ``gpu_hours``: units × hours of the whole record (until ``now`` if open)."""
    hours = F("units") * Seconds(held_until(now), F("start")) / Value(SECONDS_PER_HOUR)
    return queryset.annotate(gpu_hours=ExpressionWrapper(hours, output_field=FloatField()))


@dataclass(frozen=True, slots=True)
class GpuHours:
    """GPU-hours of one tenant in a window.

    ``per_key`` counts the way budgets count usage: a class key sums its
    devices' records; a raw key sums its pods' raw records plus the records of devices
    whose class takes that resource. ``total`` counts every record once, so every GPU
    once: a launcher pod's raw record holds only units its VMI's devices do not.
    """

    per_key: dict[str, float] = field(default_factory=dict)
    total: float = 0.0
    devices: float = 0.0
    pods: float = 0.0
    #: The share of the above held by borrowed sets (lending), in total and per key.
    borrowed: float = 0.0
    borrowed_per_key: dict[str, float] = field(default_factory=dict)


def gpu_hours(namespace: str, start: datetime, end: datetime, now: datetime) -> GpuHours:
    """GPU-hours per key of ``namespace`` in ``[start, end)``: two aggregate queries."""
    records = with_window_seconds(UsageRecord.objects.filter(namespace=namespace), start, end, now)
    by_key = records.order_by().values("subject_kind", "key", "borrowed").annotate(total=Sum("unit_seconds"))
    by_resource = (
        records.filter(subject_kind=SubjectKind.GPU)
        .order_by()
        .values("resource_name", "borrowed")
        .annotate(total=Sum("unit_seconds"))
    )
    per_key: dict[str, float] = defaultdict(float)
    lent: dict[str, float] = defaultdict(float)
    devices = pods = borrowed = 0.0
    for row in by_key:
        hours = max(0.0, float(row["total"] or 0.0)) / SECONDS_PER_HOUR
        per_key[row["key"]] += hours
        if row["borrowed"]:
            lent[row["key"]] += hours
            borrowed += hours
        if row["subject_kind"] == SubjectKind.GPU:
            devices += hours
        else:
            pods += hours
    for resource_row in by_resource:
        hours = max(0.0, float(resource_row["total"] or 0.0)) / SECONDS_PER_HOUR
        per_key[resource_row["resource_name"]] += hours
        if resource_row["borrowed"]:
            lent[resource_row["resource_name"]] += hours
    return GpuHours(
        per_key=dict(sorted(per_key.items())),
        total=devices + pods,
        devices=devices,
        pods=pods,
        borrowed=borrowed,
        borrowed_per_key=dict(sorted(lent.items())),
    )


@dataclass(frozen=True, slots=True)
class KeyUsage:
    """One budget key of a tenant now: usage, limit, what is left, GPU-hours in the window."""

    key: str
    kind: str
    used: int
    limit: int | None
    remaining: int | None
    gpu_hours: float
    borrowing: int | None = None
    borrowed: int = 0
    borrowed_gpu_hours: float = 0.0


def current_usage(namespace: str) -> tuple[dict[str, int], Limits]:
    """The tenant's usage per key now and its effective limits (see :func:`current_accounts`)."""
    used, limits, _ = current_accounts(namespace)
    return used, limits


def current_accounts(namespace: str) -> tuple[dict[str, int], Limits, dict[str, int]]:
    """The tenant's usage per key now and its effective limits.

    Reads only the tenant's devices, pods and budgets; the VMIs its GPU pods name are
    read fresh, and the engine's ledger and launcher rule do the counting.
    """
    scope = [namespace]
    classes = read_rows("GPUClass")
    devices = read_rows("GPU", scope)
    pods = read_rows("Pod", scope)
    budgets = read_rows("GPUBudget", scope)
    ledger = build_ledger(classes=classes, devices=devices, pods=pods, vmis=fresh_vmis(pods).values())
    lent = {k: v for k, v in sorted(ledger.borrowed.get(namespace, {}).items()) if v}
    return tenant_usage(ledger, namespace), effective_limits(budgets, engine_settings().default_budget), lent


def key_usage(namespace: str, hours: GpuHours) -> list[KeyUsage]:
    """Every key the tenant uses, is limited on, or held in the window, sorted."""
    used, limits, lent = current_accounts(namespace)
    keys = sorted(set(used) | set(limits.per_key) | set(hours.per_key))
    rows = []
    for key in keys:
        limit = limits.limit(key)
        usage = used.get(key, 0)
        rows.append(
            KeyUsage(
                key=key,
                kind="raw" if is_raw_key(key) else "class",
                used=usage,
                limit=limit,
                remaining=remaining(limit, usage),
                gpu_hours=round(hours.per_key.get(key, 0.0), 6),
                borrowing=limits.borrowing.get(key),
                borrowed=lent.get(key, 0),
                borrowed_gpu_hours=round(hours.borrowed_per_key.get(key, 0.0), 6),
            )
        )
    return rows


def namespace_known(namespace: str) -> bool:
    """A namespace the API can answer for: mirrored now, or with usage history."""
    return (
        binder_models.Namespace.objects.filter(name=namespace).exists()
        or UsageRecord.objects.filter(namespace=namespace).exists()
    )
