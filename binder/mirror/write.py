"""Writes to the mirror: the one place rows of mirrored objects are created, changed or removed.

A snapshot load, the cluster sync's lists and watch events and the binder's fresh reads
all end here, so every mirror write path goes through the same upsert (and, with the
change feed, the same record of what changed).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Value

from binder import models, queue
from binder.kube import client as kube_client
from binder.kube.objects import ObjectError, Parsed, parse_object, text_problem

log = logging.getLogger(__name__)

NAMESPACED = {"GPU", "GPUBudget", "VirtualMachineInstance", "Pod"}


@dataclass
class LoadReport:
    """What a load wrote (per kind) and what it skipped."""

    loaded: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    created_namespaces: list[str] = field(default_factory=list)

    def summary(self) -> str:
        parts = [f"{n} {kind}" for kind, n in sorted(self.loaded.items())]
        text = "loaded " + (", ".join(parts) if parts else "nothing")
        if self.created_namespaces:
            text += f"; created namespaces not in the file: {', '.join(self.created_namespaces)}"
        if self.skipped:
            text += "; skipped kinds gpuplane does not mirror: " + ", ".join(
                f"{n} {kind}" for kind, n in sorted(self.skipped.items())
            )
        return text


def clear_mirror() -> None:
    """Delete every mirrored object; pass history and decisions are kept."""
    for model in (models.GpuDevice, models.GpuBudget, models.Pod, models.VirtualMachineInstance):
        model.objects.all().delete()
    models.Namespace.objects.all().delete()
    models.Node.objects.all().delete()
    models.GpuClass.objects.all().delete()


def write_parsed(parsed: Sequence[Parsed], report: LoadReport | None = None) -> LoadReport:
    """Upsert objects already parsed (and checked) by ``binder.kube.objects``, in one transaction,
    creating the namespaces they name; what a load writes after parsing, and what the
    cluster sync writes."""
    report = report if report is not None else LoadReport()
    with transaction.atomic():
        by_kind: dict[str, list[Parsed]] = {}
        for item in parsed:
            by_kind.setdefault(item.kind, []).append(item)
        _upsert(models.Namespace, by_kind.get("Namespace", []), report)
        wanted = sorted({item.namespace for item in parsed if item.kind in NAMESPACED})
        existing = set(models.Namespace.objects.filter(name__in=wanted).values_list("name", flat=True))
        missing = [name for name in wanted if name not in existing]
        models.Namespace.objects.bulk_create([models.Namespace(name=name) for name in missing])
        report.created_namespaces = missing
        ns_ids = dict(models.Namespace.objects.filter(name__in=wanted).values_list("name", "id"))
        _upsert(models.Node, by_kind.get("Node", []), report)
        _upsert(models.GpuClass, by_kind.get("GPUClass", []), report)
        _upsert(models.GpuDevice, by_kind.get("GPU", []), report, ns_ids)
        _upsert(models.GpuBudget, by_kind.get("GPUBudget", []), report, ns_ids)
        _upsert(models.VirtualMachineInstance, by_kind.get("VirtualMachineInstance", []), report, ns_ids)
        _upsert(models.Pod, by_kind.get("Pod", []), report, ns_ids)
    return report


def _upsert(model: Any, items: list[Parsed], report: LoadReport, ns_ids: Mapping[str, int] | None = None) -> None:
    if not items:
        return
    rows = []
    for item in items:
        values = dict(item.values)
        if ns_ids is not None:
            values["namespace_id"] = ns_ids[item.namespace]
        rows.append(model(name=item.name, parse_error="", **values))  # it parses again: unmarked
    update_fields = [*items[0].values, "parse_error"]
    unique = ["namespace", "name"] if ns_ids is not None else ["name"]
    model.objects.bulk_create(
        rows, batch_size=1000, update_conflicts=True, unique_fields=unique, update_fields=update_fields
    )
    report.loaded[items[0].kind] += len(rows)


MODELS: dict[str, Any] = {
    "Namespace": models.Namespace,
    "Node": models.Node,
    "GPUClass": models.GpuClass,
    "GPU": models.GpuDevice,
    "GPUBudget": models.GpuBudget,
    "VirtualMachineInstance": models.VirtualMachineInstance,
    "Pod": models.Pod,
}
#: Kinds whose deletion waits on gpuplane's finalizer: while deleting they count as gone.
RELEASED_BY_BINDER = {"GPU", "GPUClass"}


@dataclass(frozen=True, slots=True)
class Applied:
    """What one list or event changed in the mirror."""

    upserted: int = 0
    deleted: int = 0
    invalid: int = 0
    #: the last refusal, "<object>: <field>: <why>" (for SyncStatus.last_invalid)
    last_invalid: str = ""

    @property
    def changed(self) -> bool:
        return bool(self.upserted or self.deleted)


def queue_full_pass() -> None:
    """Queue a full pass after commit, unless passes are driven by hand (tests)."""
    if settings.GPUPLANE_AUTO_PASS:
        queue.queue_full_pass()


def object_key(kind: str, obj: Mapping[str, Any]) -> tuple[str, str]:
    """``(namespace, name)`` of an API object (namespace "" for cluster-scoped kinds)."""
    meta = obj.get("metadata") or {}
    return (str(meta.get("namespace") or "") if kube_client.RESOURCES[kind].namespaced else "", str(meta.get("name")))


@dataclass(frozen=True, slots=True)
class Refused:
    """An object of the cluster that does not parse: its key (if storable) and why."""

    key: tuple[str, str] | None
    error: str


def kept(kind: str, obj: Mapping[str, Any]) -> tuple[Refused | None, Parsed | None]:
    """``(refused, parsed)``: why ``obj`` does not parse (None if it does), and the parsed
    object if the mirror keeps a row for it.

    A GPU or class being deleted counts as gone whether or not it parses: its units are
    released and its finalizer removed, so a broken object never holds up a deletion.
    """
    if kind in RELEASED_BY_BINDER and isinstance(obj.get("metadata"), Mapping) and kube_client.is_deleting(obj):
        return None, None
    try:
        parsed = parse_object(obj, where="from the API server")
    except ObjectError as exc:
        log.warning("sync: refusing an invalid %s (its mirror row, if any, keeps its last good state): %s", kind, exc)
        return Refused(storable_key(kind, obj), str(exc)), None
    if parsed is None:
        return None, None
    if kind == "Pod" and not parsed.values.get("gpu_requests"):
        return None, None
    return None, parsed


def storable_key(kind: str, obj: Mapping[str, Any]) -> tuple[str, str] | None:
    """The ``(namespace, name)`` of an object, if a mirror row could have it (else None:
    no row can hold a NUL or a name that is not text, and a query for one would fail)."""
    meta = obj.get("metadata")
    if not isinstance(meta, Mapping):
        return None
    name, namespace = meta.get("name"), meta.get("namespace") or ""
    if not isinstance(name, str) or not isinstance(namespace, str) or not name:
        return None
    if text_problem(name) or text_problem(namespace) or len(name) > 253 or len(namespace) > 63:
        return None
    return (namespace if kube_client.RESOURCES[kind].namespaced else "", name)


def mark_refused(kind: str, refused: Sequence[Refused]) -> None:
    """Mark the mirror rows of objects that stopped parsing: the row keeps its last good
    state (a GPU that stops parsing is not deleted, its units are not released while its
    VM runs) and says why, for staff (admin) and ``/metrics``."""
    for item in refused:
        if item.key is not None:
            _rows(kind, *item.key).update(parse_error=item.error[:2000])


def _rows(kind: str, namespace: str, name: str) -> Any:
    """The mirror's row of ``kind`` named ``namespace/name`` (a queryset of at most one)."""
    rows = MODELS[kind].objects.filter(name=name)
    return rows.filter(namespace__name=namespace) if kube_client.RESOURCES[kind].namespaced else rows


def _keys(kind: str) -> Any:
    """``(id, namespace, name)`` of every mirror row of ``kind`` ("" for cluster-scoped kinds)."""
    model = MODELS[kind]
    if kube_client.RESOURCES[kind].namespaced:
        return model.objects.values_list("id", "namespace__name", "name")
    return model.objects.values_list("id", Value(""), "name")


def mirror_list(
    kind: str,
    items: Iterable[Mapping[str, Any]],
    progress: Callable[[int], None] | None = None,
    *,
    queue: bool = True,
) -> Applied:
    """Make the mirror's rows of ``kind`` exactly the listed objects (one transaction).

    A change queues a full pass, unless ``queue`` is false (the pass's own fresh read).
    """
    keep: list[Parsed] = []
    refused: list[Refused] = []
    for obj in items:
        bad, parsed = kept(kind, obj)
        if bad is not None:
            refused.append(bad)
        if parsed is not None:
            keep.append(parsed)
        if progress is not None:
            progress(1)
    # An object that does not parse is still in the cluster: its row is not stale.
    wanted_keys = {(p.namespace, p.name) for p in keep} | {r.key for r in refused if r.key is not None}
    with transaction.atomic():
        write_parsed(keep)
        mark_refused(kind, refused)
        stale = [row_id for row_id, ns, name in _keys(kind) if (ns, name) not in wanted_keys]
        for start in range(0, len(stale), 1000):
            MODELS[kind].objects.filter(id__in=stale[start : start + 1000]).delete()
        applied = Applied(
            upserted=len(keep),
            deleted=len(stale),
            invalid=len(refused),
            last_invalid=refused[-1].error[:2000] if refused else "",
        )
        if applied.changed and queue:
            queue_full_pass()
    return applied


def mirror_event(kind: str, event_type: str, obj: Mapping[str, Any]) -> Applied:
    """Apply one watch event (ADDED, MODIFIED, DELETED) to the mirror."""
    refused, parsed = kept(kind, obj) if event_type != "DELETED" else (None, None)
    with transaction.atomic():
        if refused is not None:
            # Not a deletion: the row keeps its last good state, marked (no pass needed).
            mark_refused(kind, [refused])
            applied = Applied(invalid=1, last_invalid=refused.error[:2000])
        elif parsed is not None and unchanged(kind, parsed):
            applied = Applied()  # e.g. only metadata the mirror does not keep: no pass needed
        elif parsed is not None:
            write_parsed([parsed])
            applied = Applied(upserted=1)
        else:
            key = storable_key(kind, obj)
            deleted = _rows(kind, *key).delete()[0] if key is not None else 0
            applied = Applied(deleted=int(bool(deleted)))
        if applied.changed:
            queue_full_pass()
    return applied


def unchanged(kind: str, parsed: Parsed) -> bool:
    """True if the mirror's row already holds every field ``parsed`` would write."""
    row = _rows(kind, parsed.namespace, parsed.name).first()
    return (
        row is not None
        and not row.parse_error
        and all(getattr(row, field) == value for field, value in parsed.values.items())
    )
