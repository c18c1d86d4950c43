"""Writes to the mirror: the one place rows of mirrored objects are created, changed or removed.

A snapshot load, the cluster sync's lists and watch events, and in cluster mode the
objects the binder's own writes returned (status PATCH responses, the single GET after a
409, the sync's finalizer PATCH responses) all end here, so every mirror write path goes
through the same upsert (and, with the change feed, the same record of what changed).

**Versions** (cluster mode). Rows of the kinds the binder writes
(:data:`VERSIONED`: GPU, GPUClass, GPUBudget) keep the ``resourceVersion`` of the object
they hold, and every writer that sets it writes the whole object at that version. A
watch event or a listed object *older* than its row is ignored: the binder has already
mirrored its own later write (its PATCH response), and applying the older object would
undo that booking in the mirror until the watch caught up, so the next pass could book
the same units twice. The watch delivers the binder's own writes late (the watch cache
trails etcd), and a relist's snapshot may predate a write committed while it was being
applied; neither may win over the row. The comparison takes resourceVersions as integers:
etcd's are (its revision), and Kubernetes 1.34 (KEP-5504, comparable resource versions)
makes "compare them as integers" the documented contract. A version that does not parse
as an integer (another storage, an empty version from an older row) cannot be ordered,
so the object is applied, as before versions were kept. Deletions are always applied:
a DELETED event carries the object's last version, and a GPU or class being deleted
never comes back (``deletionTimestamp`` cannot be removed), so no row is newer than it.
The check and the write happen under the row's lock (``SELECT ... FOR UPDATE``), so a
pass and the sync writing one row at once are ordered, and the older loses.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from django.db import transaction
from django.db.models import Value

from binder import models
from binder.kube import client as kube_client
from binder.kube import kinds as kube_kinds
from binder.kube.objects import ObjectError, Parsed, parse_object, text_problem
from binder.queue import queue_auto_full_pass

log = logging.getLogger(__name__)

#: Kinds whose rows keep the object's resourceVersion (the binder writes their status).
VERSIONED = kube_kinds.STATUS_WRITTEN

#: Fields whose change alone asks for no pass. The webhook's ``gpuplane.io/admitted`` stamp only
#: makes a set less movable for a while (SPEC §4 "Making room": a set admitted in the grace is not
#: movable); it never lets a pass place, move or release anything, so the pass such a change would
#: queue (one per Bound VMI start) would find nothing to do.
NO_PASS_FIELDS: Mapping[str, frozenset[str]] = {"GPU": frozenset({"admitted"})}

#: A field the row keeps when a mirrored object carries an older value or none. The webhook
#: stamps ``admitted`` on the row itself, in both modes (``binder.runtime.admissions``), never
#: through the API: an object from the watch, a relist or a pass's PATCH response carries no
#: stamp (or one an earlier release wrote as an annotation) and must not take the row's away.
ROW_KEPT: Mapping[str, str] = {"GPU": "admitted"}

ObjectKey = tuple[str, str]  # (namespace, name); "" for a cluster-scoped kind


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
    for kind in reversed(kube_kinds.KINDS):  # what lives in a namespace before the namespace
        MODELS[kind.kind].objects.all().delete()


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
        wanted = sorted({item.namespace for item in parsed if item.kind in kube_kinds.NAMESPACED})
        existing = set(models.Namespace.objects.filter(name__in=wanted).values_list("name", flat=True))
        missing = [name for name in wanted if name not in existing]
        models.Namespace.objects.bulk_create([models.Namespace(name=name) for name in missing])
        report.created_namespaces = missing
        ns_ids = dict(models.Namespace.objects.filter(name__in=wanted).values_list("name", "id"))
        for kind in kube_kinds.KINDS:
            if kind.kind != "Namespace":
                _upsert(MODELS[kind.kind], by_kind.get(kind.kind, []), report, ns_ids if kind.namespaced else None)
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


#: Each mirrored kind's model (``binder.kube.kinds``: one row per kind, the model named there).
MODELS: dict[str, Any] = {k.kind: getattr(models, k.model) for k in kube_kinds.KINDS}
#: Kinds whose deletion waits on gpuplane's finalizer: while deleting they count as gone.
RELEASED_BY_BINDER = kube_kinds.FINALIZED


@dataclass(frozen=True, slots=True)
class Applied:
    """What one list or event changed in the mirror."""

    upserted: int = 0
    deleted: int = 0
    invalid: int = 0
    #: objects older than their row, ignored (see the module docstring)
    stale: int = 0
    #: the last refusal, "<object>: <field>: <why>" (for SyncStatus.last_invalid)
    last_invalid: str = ""
    #: objects not applied because another transaction held their rows (``defer_held``)
    deferred: tuple[Mapping[str, Any], ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.upserted or self.deleted)


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
    list_version: str = "",
) -> Applied:
    """Make the mirror's rows of ``kind`` exactly the listed objects (one transaction).

    Versioned rows (:data:`VERSIONED`) already at the listed object's version are not
    written again (every writer that sets a version writes the object at it), and rows
    newer than the listed object keep what they hold: the list was taken before a write
    the row has. A row missing from the list is deleted unless it is newer than the list
    itself (``list_version``). A change queues a full pass, unless ``queue`` is false.
    """
    keep: list[Parsed] = []
    refused: list[Refused] = []
    releasing: list[Mapping[str, Any]] = []
    for obj in items:
        bad, parsed = kept(kind, obj)
        if bad is not None:
            refused.append(bad)
        if parsed is not None:
            keep.append(_versioned(kind, parsed, obj))
        elif bad is None and held_by_us(kind, obj):
            releasing.append(obj)
        if progress is not None:
            progress(1)
    # An object that does not parse is still in the cluster: its row is not stale.
    wanted_keys = {(p.namespace, p.name) for p in keep} | {r.key for r in refused if r.key is not None}
    with transaction.atomic():
        stale_objects = 0
        if kind in VERSIONED:
            stored = {(ns, name): version for _, ns, name, version in _versions(kind)}
            # A row at the listed version already holds that object: nothing to write or lock.
            keep = [p for p in keep if not _at(stored, p)]
            rows = _locked_versions(kind, [(p.namespace, p.name) for p in keep])
            fresh = [p for p in keep if not older(p.values["resource_version"], rows.get((p.namespace, p.name), ""))]
            stale_objects = len(keep) - len(fresh)
            keep = _with_row_kept(kind, fresh)
        write_parsed(keep)
        mark_refused(kind, refused)
        missing = {(row_id, ns, name) for row_id, ns, name, _ in _versions(kind) if (ns, name) not in wanted_keys}
        # Locked and checked again: a row a pass wrote after the list was taken stays.
        now = _locked_versions(kind, [(ns, name) for _, ns, name in missing]) if kind in VERSIONED else {}
        stale = sorted(row_id for row_id, ns, name in missing if not older(list_version, now.get((ns, name), "")))
        for start in range(0, len(stale), 1000):
            MODELS[kind].objects.filter(id__in=stale[start : start + 1000]).delete()
        if kind in RELEASED_BY_BINDER:
            _note_releases(kind, releasing, replace=True)
        applied = Applied(
            upserted=len(keep),
            deleted=len(stale),
            invalid=len(refused),
            stale=stale_objects,
            last_invalid=refused[-1].error[:2000] if refused else "",
        )
        if applied.changed and queue:
            queue_auto_full_pass()
    return applied


def mirror_event(kind: str, event_type: str, obj: Mapping[str, Any]) -> Applied:
    """Apply one watch event (ADDED, MODIFIED, DELETED) to the mirror."""
    if event_type == "DELETED":
        # Always applied, whatever the row's version: the event carries the last one.
        key = storable_key(kind, obj)
        with transaction.atomic():
            deleted = _rows(kind, *key).delete()[0] if key is not None else 0
            if key is not None and kind in RELEASED_BY_BINDER:
                models.FinalizerRelease.objects.filter(kind=kind, namespace=key[0], name=key[1]).delete()
            applied = Applied(deleted=int(bool(deleted)))
            if applied.changed:
                queue_auto_full_pass()
        return applied
    return mirror_objects(kind, [obj])


def mirror_objects(
    kind: str, objects: Sequence[Mapping[str, Any]], *, queue: bool = True, defer_held: bool = False
) -> Applied:
    """Apply objects as the API server returned them (watch events, PATCH responses, GETs).

    An object older than its row is ignored (see the module docstring); one that only
    moved the version (a finalizer added, the binder's own write coming back as an
    event) updates the row's version and queues no pass.

    ``defer_held``: an object whose row another transaction holds (a pass writing its
    status, most often the very write this object echoes) is not waited for but handed
    back in ``Applied.deferred``, for the caller to apply later; the sync's watch then never
    stalls behind a pass.
    """
    with transaction.atomic():
        keys = [key for key in (storable_key(kind, obj) for obj in objects) if key is not None]
        busy: set[tuple[str, str]] | None = set() if defer_held and kind in VERSIONED else None
        rows = _locked_versions(kind, keys, busy=busy) if kind in VERSIONED else {}
        deferred: tuple[Mapping[str, Any], ...] = ()
        if busy:
            deferred = tuple(obj for obj in objects if storable_key(kind, obj) in busy)
            objects = [obj for obj in objects if storable_key(kind, obj) not in busy]
            keys = [key for key in keys if key not in busy]
        noted = _noted_releases(kind, keys) if kind in RELEASED_BY_BINDER else {}
        deleted = invalid = stale = 0
        last_invalid = ""
        writing: list[Parsed] = []
        releasing: list[Mapping[str, Any]] = []
        released: list[tuple[str, str]] = []
        for obj in objects:
            key = storable_key(kind, obj)
            version = resource_version(obj)
            if key is not None and (older(version, rows.get(key, "")) or older(version, noted.get(key, ""))):
                stale += 1
                continue
            refused, parsed = kept(kind, obj)
            if refused is not None:
                # Not a deletion: the row keeps its last good state, marked (no pass needed).
                mark_refused(kind, [refused])
                invalid += 1
                last_invalid = refused.error[:2000]
            elif parsed is not None:
                writing.append(_versioned(kind, parsed, obj))
            elif key is not None:
                deleted += int(bool(_rows(kind, *key).delete()[0]))
                if held_by_us(kind, obj):
                    releasing.append(obj)
                else:
                    released.append(key)  # gone, or its finalizer went: no note left
        writing, same, quiet = _against_rows(kind, writing)
        writing = [p for p in writing if (p.namespace, p.name) not in same or _moved(kind, p, rows)]
        write_parsed(writing)
        if releasing:
            _note_releases(kind, releasing)
        for ns, name in released:
            models.FinalizerRelease.objects.filter(kind=kind, namespace=ns, name=name).delete()
        applied = Applied(
            upserted=len(writing),
            deleted=deleted,
            invalid=invalid,
            stale=stale,
            last_invalid=last_invalid,
            deferred=deferred,
        )
        # Only the version moved (a finalizer added, the binder's own write), or a field no pass
        # acts on: nothing to queue a pass for.
        if queue and (deleted or any((p.namespace, p.name) not in quiet for p in writing)):
            queue_auto_full_pass()
    return applied


def _moved(kind: str, parsed: Parsed, rows: Mapping[tuple[str, str], str]) -> bool:
    return kind in VERSIONED and rows.get((parsed.namespace, parsed.name)) != parsed.values["resource_version"]


def _against_rows(kind: str, items: Sequence[Parsed]) -> tuple[list[Parsed], set[ObjectKey], set[ObjectKey]]:
    """``items`` with the fields the rows keep (:data:`ROW_KEPT`) put back where the object
    carries less; the keys whose rows already hold every field they would write (but the
    version); and the keys whose rows differ at most in :data:`NO_PASS_FIELDS` (a superset)."""
    if not items:
        return [], set(), set()
    by_key = {(p.namespace, p.name): p for p in items}
    fields = [f for f in items[0].values if f != "resource_version"]
    no_pass = NO_PASS_FIELDS.get(kind, frozenset())
    kept_field = ROW_KEPT.get(kind)
    model = MODELS[kind]
    rows = model.objects.filter(name__in={name for _, name in by_key}, parse_error="")
    namespace: Any = "namespace__name" if kube_client.RESOURCES[kind].namespaced else Value("")
    same, quiet = set(), set()
    for ns, name, *values in rows.values_list(namespace, "name", *fields):
        parsed = by_key.get((ns, name))
        if parsed is None:
            continue
        row = dict(zip(fields, values, strict=True))
        if kept_field is not None:
            parsed = by_key[(ns, name)] = _kept_from_row(parsed, kept_field, row[kept_field])
        differ = {f for f in fields if parsed.values[f] != row[f]}
        if not differ:
            same.add((ns, name))
        if differ <= no_pass:
            quiet.add((ns, name))
    return [by_key[(p.namespace, p.name)] for p in items], same, quiet


def _kept_from_row(parsed: Parsed, kept_field: str, stored: Any) -> Parsed:
    """``parsed`` with the row's value ``stored`` of its :data:`ROW_KEPT` field where the object
    carries an older value or none."""
    if stored is None:
        return parsed
    carried = parsed.values[kept_field]
    if carried is not None and carried >= stored:
        return parsed
    return dataclasses.replace(parsed, values={**parsed.values, kept_field: stored})


def _with_row_kept(kind: str, items: list[Parsed]) -> list[Parsed]:
    """``items`` with the :data:`ROW_KEPT` field of their rows put back (a relist's objects):
    read from the rows that hold one, which are few (the first members of admitted sets)."""
    kept_field = ROW_KEPT.get(kind)
    if kept_field is None or not items:
        return items
    held = MODELS[kind].objects.exclude(**{f"{kept_field}__isnull": True})
    stored = {(ns, name): value for ns, name, value in held.values_list("namespace__name", "name", kept_field)}
    return [_kept_from_row(p, kept_field, stored.get((p.namespace, p.name))) for p in items]


def forget_object(kind: str, namespace: str, name: str) -> int:
    """Delete the row of an object the API server says is gone (a GET answered 404)."""
    return int(_rows(kind, namespace, name).delete()[0])


def resource_version(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata")
    version = meta.get("resourceVersion") if isinstance(meta, Mapping) else None
    return version if isinstance(version, str) and len(version) <= 64 else ""


def older(incoming: str, stored: str) -> bool:
    """Whether ``incoming`` is provably older than ``stored`` (integers; else False: apply)."""
    try:
        return int(incoming) < int(stored)
    except ValueError:
        return False


def held_by_us(kind: str, obj: Mapping[str, Any]) -> bool:
    """A GPU or class being deleted that waits on gpuplane's finalizer."""
    meta = obj.get("metadata")
    return (
        kind in RELEASED_BY_BINDER
        and isinstance(meta, Mapping)
        and kube_client.is_deleting(obj)
        and kube_client.FINALIZER in (meta.get("finalizers") or [])
    )


def _versioned(kind: str, parsed: Parsed, obj: Mapping[str, Any]) -> Parsed:
    if kind not in VERSIONED:
        return parsed
    return dataclasses.replace(parsed, values={**parsed.values, "resource_version": resource_version(obj)})


def _at(stored: Mapping[tuple[str, str], str], parsed: Parsed) -> bool:
    version = parsed.values["resource_version"]
    return bool(version) and stored.get((parsed.namespace, parsed.name)) == version


def _versions(kind: str, names: Iterable[str] | None = None, queryset: Any = None) -> Any:
    """``(id, namespace, name, resourceVersion)`` of the rows of ``kind`` ("" unversioned),
    of ``names`` only if given."""
    version: Any = "resource_version" if kind in VERSIONED else Value("")
    rows = queryset if queryset is not None else MODELS[kind].objects.order_by()
    if names is not None:
        rows = rows.filter(name__in=list(names))
    if kube_client.RESOURCES[kind].namespaced:
        return rows.values_list("id", "namespace__name", "name", version)
    return rows.values_list("id", Value(""), "name", version)


def _locked_versions(
    kind: str, keys: Iterable[tuple[str, str]], *, busy: set[tuple[str, str]] | None = None
) -> dict[tuple[str, str], str]:
    """Lock the rows of ``keys`` and return their versions: a concurrent writer of the same
    row (the pass, the sync, the webhook) waits, then sees this write's version. Rows are
    locked in id order, as every writer here locks them, so two writers cannot deadlock.

    Given a ``busy`` set, rows another transaction holds are not waited for: their keys are
    added to it instead (a plain read finds the rows first, so a held row is told apart
    from a missing one)."""
    wanted = set(keys)
    if not wanted:
        return {}
    names = sorted({name for _, name in wanted})
    present = {
        row_id: (ns, name)
        for start in range(0, len(names), 1000)
        for row_id, ns, name, _ in _versions(kind, names[start : start + 1000])
        if (ns, name) in wanted
    }
    ids = sorted(present)
    found: dict[tuple[str, str], str] = {}
    for start in range(0, len(ids), 1000):
        locking = MODELS[kind].objects.select_for_update(of=("self",), skip_locked=busy is not None)
        rows = locking.filter(id__in=ids[start : start + 1000])
        for _, ns, name, version in _versions(kind, queryset=rows.order_by("id")):
            found[(ns, name)] = version
    if busy is not None:
        busy.update(key for key in present.values() if key not in found)
    return found


def _noted_releases(kind: str, keys: Iterable[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """The noted versions of deleting objects among ``keys``: the row is gone, the note is
    the newest version the mirror knows (a late older event must not bring the row back)."""
    wanted = set(keys)
    if not wanted:
        return {}
    rows = models.FinalizerRelease.objects.filter(kind=kind, name__in={name for _, name in wanted})
    return {
        (ns, name): version
        for ns, name, version in rows.values_list("namespace", "name", "resource_version")
        if (ns, name) in wanted
    }


def _note_releases(kind: str, objects: Sequence[Mapping[str, Any]], *, replace: bool = False) -> None:
    """Note deleting objects that wait on our finalizer (``replace``: these are all of them)."""
    notes = []
    for obj in objects:
        key = storable_key(kind, obj)
        if key is None:
            continue
        meta = obj.get("metadata") or {}
        notes.append(
            models.FinalizerRelease(
                kind=kind,
                namespace=key[0],
                name=key[1],
                uid=str(meta.get("uid") or "")[:64],
                resource_version=resource_version(obj),
                finalizers=[str(f) for f in meta.get("finalizers") or []],
            )
        )
    if replace:
        current = {(n.namespace, n.name) for n in notes}
        obsolete = [
            note_id
            for note_id, ns, name in models.FinalizerRelease.objects.filter(kind=kind).values_list(
                "id", "namespace", "name"
            )
            if (ns, name) not in current
        ]
        models.FinalizerRelease.objects.filter(id__in=obsolete).delete()
    models.FinalizerRelease.objects.bulk_create(
        notes,
        update_conflicts=True,
        unique_fields=["kind", "namespace", "name"],
        update_fields=["uid", "resource_version", "finalizers", "noted"],
    )


def unchanged(kind: str, parsed: Parsed, ignore: Sequence[str] = ()) -> bool:
    """True if the mirror's row already holds every field ``parsed`` would write (but ``ignore``)."""
    row = _rows(kind, parsed.namespace, parsed.name).first()
    return (
        row is not None
        and not row.parse_error
        and all(getattr(row, field) == value for field, value in parsed.values.items() if field not in ignore)
    )
