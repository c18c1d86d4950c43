"""The usage record model: what tenants are billed from.

A model of the binder app (``binder.models`` imports it, so Django registers it with the
rest): written by the binder's full passes (``binder.runtime.usage_records``), read by the
usage app through its proxy model.
"""

from __future__ import annotations

from typing import Any, Self, TypeVar

from django.core.validators import MinValueValidator
from django.db import models

from binder.engine.usage import RecordPhase as EngineRecordPhase
from binder.engine.usage import SubjectKind as EngineSubjectKind
from binder.querysets import TenantQuerySet

# Usage records: written by the binder's full passes (``binder.runtime.usage_records``),
# read by the usage app (the tenant API, daily roll-ups, the admin) through its proxy.
#
# They are what tenants are billed from, so they are an append-only history: a record is
# opened by a full pass, closed by a later one, and never edited or deleted after it
# closes. That is enforced here (model and queryset refuse it) and, on PostgreSQL, by a
# trigger (usage migration 0002) that also stops raw SQL. Namespace and subject are copied
# as names, not linked, so records outlive the devices, pods and namespaces they describe.

#: The only columns a write may change on an open record: closing it.
CLOSING_FIELDS = frozenset({"end", "closed_by_pass"})


class ClosedRecordError(Exception):
    """A write tried to change or delete a usage record in a way the history forbids."""


class SubjectKind(models.TextChoices):
    GPU = EngineSubjectKind.GPU.value
    POD = EngineSubjectKind.POD.value


class RecordPhase(models.TextChoices):
    BOUND = EngineRecordPhase.BOUND.value
    LOST = EngineRecordPhase.LOST.value
    RAW = EngineRecordPhase.RAW.value


_R = TypeVar("_R", bound="UsageRecord")


class UsageRecordQuerySet(TenantQuerySet[_R]):
    """Records scoped per tenant (``for_tenant``, the mirror's one rule); bulk writes may only
    close open records, never delete. Generic so that the usage app's proxy reads its own type."""

    def open(self) -> Self:
        return self.filter(end__isnull=True)

    def update(self, **kwargs: Any) -> int:
        """Close open records (``end``, ``closed_by_pass``); closed rows are never matched."""
        extra = set(kwargs) - CLOSING_FIELDS
        if extra:
            raise ClosedRecordError(f"usage records are append-only: cannot update {', '.join(sorted(extra))}")
        if kwargs.get("end", ...) is None:
            raise ClosedRecordError("usage records are append-only: a closed record cannot be reopened")
        return super(UsageRecordQuerySet, self.filter(end__isnull=True)).update(**kwargs)

    def delete(self) -> tuple[int, dict[str, int]]:
        raise ClosedRecordError("usage records are never deleted")

    delete.queryset_only = True  # type: ignore[attr-defined]


class UsageRecord(models.Model):
    """Who held how many units of which key, where, from ``start`` until ``end``.

    A device (subject kind GPU) has one open record while Bound or Lost; a pod (kind
    Pod, phase Raw) one per resource while its raw usage is above zero. A
    change of node, phase or units closes the record and opens the next at the same
    instant. GPU-hours = units × hours.
    """

    NAMESPACE_LOOKUP = "namespace"

    namespace = models.CharField(max_length=63)
    subject_kind = models.CharField(max_length=8, choices=SubjectKind.choices)
    subject = models.CharField(max_length=253, help_text="GPU device name, or pod name")
    subject_uid = models.CharField(max_length=64, blank=True, help_text="pod uid (empty for devices)")
    vm_name = models.CharField(max_length=253, blank=True, help_text="the device's VM (empty for pods)")
    key = models.CharField(max_length=253, help_text="class name for devices, raw resource name for pods")
    resource_name = models.CharField(max_length=253)
    units = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    node = models.CharField(max_length=253, blank=True, help_text="empty while Lost")
    phase = models.CharField(max_length=8, choices=RecordPhase.choices)
    borrowed = models.BooleanField(default=False, help_text="held by a borrowed set (lending)")
    start = models.DateTimeField()
    end = models.DateTimeField(null=True, blank=True, help_text="empty while the record is open")
    opened_by_pass = models.BigIntegerField(null=True, blank=True, help_text="id of the full pass that opened it")
    closed_by_pass = models.BigIntegerField(null=True, blank=True, help_text="id of the full pass that closed it")

    objects = UsageRecordQuerySet["UsageRecord"].as_manager()

    class Meta:
        # The table keeps the name it had when the usage app owned the model (migration
        # binder/0016 moved only Django's state). The admin page and the permission
        # ``usage.view_usagerecord`` belong to usage's proxy (``usage.models.UsageRecord``),
        # so this model has none of its own.
        db_table = "usage_usagerecord"
        default_permissions = ()
        ordering = ["start", "id"]
        constraints = [
            models.CheckConstraint(condition=models.Q(units__gte=1), name="usage_units_positive"),
            models.CheckConstraint(
                condition=models.Q(end__isnull=True) | models.Q(end__gte=models.F("start")),
                name="usage_end_after_start",
            ),
            # At most one open record per subject and resource: a device is Bound or Lost once.
            models.UniqueConstraint(
                fields=["namespace", "subject_kind", "subject", "subject_uid", "resource_name"],
                condition=models.Q(end__isnull=True),
                name="usage_one_open_per_subject",
            ),
        ]
        # The open records (every pass's lookup of its subjects' records by namespace, kind
        # and subject, a full reconciliation's "end IS NULL", a tenant's open records) are
        # read through usage_one_open_per_subject (the constraint's partial index): a pass
        # that opens 26k records writes every index, so none is kept for them alone.
        indexes = [
            models.Index(fields=["namespace", "start"], name="usage_ns_start_idx"),
            models.Index(fields=["namespace", "key", "start"], name="usage_ns_key_idx"),
            # Windows: "ended after from" bounded by an index, so a query over 30 days
            # does not read a tenant's whole history (with usage_ns_start_idx and the open one).
            models.Index(fields=["namespace", "end"], name="usage_ns_end_idx"),
        ]

    def __str__(self) -> str:
        until = self.end.isoformat() if self.end else "now"
        return f"{self.namespace}/{self.subject} {self.units}×{self.key} {self.phase} {self.start.isoformat()}–{until}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        """New records may be saved; an existing one only while open, and only to close it."""
        if self.pk is not None and not kwargs.get("force_insert"):
            stored = type(self).objects.filter(pk=self.pk).values().first()
            if stored is not None:
                if stored["end"] is not None:
                    raise ClosedRecordError(f"usage record {self.pk} is closed and cannot be changed")
                changed = {f for f, v in stored.items() if f != "id" and getattr(self, f) != v}
                if changed - CLOSING_FIELDS:
                    raise ClosedRecordError(
                        f"usage record {self.pk}: only end and closed_by_pass may change, not "
                        + ", ".join(sorted(changed - CLOSING_FIELDS))
                    )
        super().save(*args, **kwargs)

    def delete(self, *args: Any, **kwargs: Any) -> tuple[int, dict[str, int]]:
        raise ClosedRecordError("usage records are never deleted")

    @property
    def is_open(self) -> bool:
        return self.end is None
