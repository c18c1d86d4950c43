"""The binder's side of cluster mode: status writes, their versions, finalizer release.

In cluster mode the API server is the truth about placement; the mirror follows it
through the sync (``binder.sync``: list, then watch), and a pass decides, as in
standalone mode, from the worker's in-memory state brought current from the change feed
(``binder.runtime.state``). No pass lists anything. Around the pure engine a pass does:

1. **Write status** of each changed device through the ``status`` subresource, with the
   resourceVersion of the row the pass decided from as the precondition. The row is
   locked for the rest of the pass (``FOR UPDATE SKIP LOCKED``) and must still be the
   record the pass decided from; a row the sync is writing right now, or has changed
   since the pass's catch-up, is left for the next pass, which sees the change in the
   feed. Each write that lands returns the object as stored; that object (its new
   resourceVersion with it) is mirrored **in the pass's transaction**, with the status
   the pass wrote. So the row is never older than the binder's own last write, whether
   the watch brings that write late, out of order or never (the sync ignores events
   older than the row, ``binder.mirror.write``): the next pass sees its own bookings and
   cannot book the same units twice. A **409** (someone else changed the object) makes
   the pass GET that one object and mirror it, so the next pass decides from the object
   as it is; any other failure leaves the object as it was. Only the writes that landed
   reach the mirror, the decision log and the usage records; the next pass restores a
   half-written set. Class and budget status go the same way, compared
   with what their rows hold.
2. **Release finalizers** once the full pass that released a deleted object's
   units has committed its usage records. The sync notes each GPU and GPUClass it sees
   being deleted with gpuplane's finalizer (``FinalizerRelease``) in the transaction that
   drops its row; a full pass reads the notes before its catch-up (:func:`releases_due`),
   so every note it reads belongs to a row deletion its catch-up applies, and removes the
   finalizers after its commit. This runs with ``GPUPLANE_ENABLED=false`` too, so turning
   GPUs off never hangs a namespace or class deletion.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django.db import transaction
from kubernetes.client import ApiException

from binder import apiserver, models
from binder.engine import PassResult
from binder.engine import types as e
from binder.errors import describe, is_transient
from binder.kube import client as kube_client
from binder.mirror.write import forget_object, mirror_objects
from binder.runtime import admissions
from binder.runtime.state import ClusterState

log = logging.getLogger(__name__)


def device_status(device: e.Device) -> dict[str, Any]:
    """A device's ``status`` as the CRD spells it."""
    return {
        "phase": device.phase.value,
        "node": device.node or None,
        "since": device.since.isoformat().replace("+00:00", "Z") if device.since else None,
        "reason": device.reason,
        "answeredRequest": device.answered_request or None,
        "answer": device.answer or None,
        "className": device.class_name if device.held else None,
        # Lending: absent (null removes them in a merge patch) unless borrowed or marked.
        "borrowed": True if device.borrowed else None,
        "reclaimFor": device.reclaim_for or None,
    }


def _conflict(exc: BaseException) -> bool:
    return isinstance(exc, ApiException) and exc.status == 409


@dataclass
class _Writes:
    """What a pass's status writes returned: objects to mirror, objects to GET again."""

    stored: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    refetch: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    failed: int = 0

    def patch_many[T](self, kind: str, writes: Sequence[tuple[T, str, str, Mapping[str, Any], str]]) -> list[T]:
        """Status writes of ``(item, namespace, name, status, version)``, several in flight at
        once (``kube_client.each_in_flight``), so a pass binding thousands of devices holds
        its row locks that much shorter; the items whose write landed, in order."""
        api = apiserver.api()

        def call(write: tuple[T, str, str, Mapping[str, Any], str]) -> dict[str, Any] | None:
            _, namespace, name, status, version = write
            return api.patch_status(kind, namespace, name, status, version) if version else None

        outcomes = kube_client.each_in_flight(call, writes)
        return [w[0] for w, o in zip(writes, outcomes, strict=True) if self._landed(kind, w[1], w[2], o)]

    def _landed(self, kind: str, namespace: str, name: str, outcome: dict[str, Any] | BaseException | None) -> bool:
        if outcome is None:
            # A row without a version (written before versions were kept) has no
            # precondition to write against: read the object, write next pass.
            self.failed += 1
            self.refetch.append((namespace, name))
            return False
        if isinstance(outcome, BaseException):
            self.failed += 1
            if _conflict(outcome):
                self.refetch.append((namespace, name))
            level = logging.INFO if is_transient(outcome) else logging.ERROR
            log.log(level, "status of %s %s/%s left for the next pass: %s", kind, namespace, name, describe(outcome))
            return False
        self.stored.append(outcome)
        if kube_client.is_deleting(outcome):
            # Being deleted: mirroring it drops the row (its units are released by the
            # next pass), so the pass must not count it as written.
            self.failed += 1
            return False
        return True

    def mirror(self, kind: str) -> None:
        """Mirror what the writes returned, then the single GET of each conflicting object."""
        if self.stored:  # most passes write no class or budget: no transaction for nothing
            mirror_objects(kind, self.stored, queue=False)
        api = apiserver.api()
        for namespace, name in self.refetch:
            try:
                current = api.get(kind, namespace, name)
            except Exception as exc:  # noqa: BLE001 - the next pass writes against the row it has
                log.info("%s %s/%s not read again after a conflict: %s", kind, namespace, name, describe(exc))
                continue
            if current is None:
                forget_object(kind, namespace, name)
            else:
                mirror_objects(kind, [current], queue=False)


def write_status(result: PassResult, state: ClusterState) -> tuple[PassResult, int]:
    """Write each changed device's status; return the result narrowed to what was written.

    Devices left out (refused, conflicting, changed since the pass read them) drop out
    of ``devices``, ``changes`` and ``answered``, and classes and budgets whose status did
    not land out of ``class_status`` and ``budget_used``: the mirror, the decision log and
    the usage records then describe the cluster as it is, and the next pass starts from
    there. A set the pass moves or releases has its first member written first (guarded by
    an unchanged write where the pass does not change it) and the rest only if that landed
    (``binder.runtime.admissions``); a set for which a move of its room plan did not land is
    not written either. Runs inside the pass's transaction.
    """
    writes = _Writes()
    decided = state.records["GPU"]
    moving = admissions.moving_sets(result, state)
    changing = {d.key for d in result.devices}
    guards = [(key[0], first) for key, first in moving.items() if (key[0], first) not in changing]
    object_ids = [state.device_ids[k] for k in (*changing, *guards) if k in state.device_ids]
    current = admissions.locked_devices(object_ids, state, skip_locked=True)
    stale: set[tuple[str, str]] = set()  # moving sets whose first member cannot be written

    def against_row(device: e.Device) -> str | None:
        """The version to write against, or None when the row is not the one decided from."""
        object_id = state.device_ids.get(device.key)
        if object_id is None:
            return None
        row = current.get(object_id)
        if row is None or row[1] != decided.get(object_id):
            # Being written by the sync right now, or changed since the catch-up (the webhook
            # admitted a VMI, a label changed): the next pass decides from the newer row.
            return None
        return row[0]

    Write = tuple[e.Device, str, str, Mapping[str, Any], str]
    first: list[Write] = []
    rest: list[Write] = []
    for device in result.devices:
        if device.key not in state.device_ids:
            continue  # not in the mirror any more
        leads = moving.get(device.set_key) == device.name
        version = against_row(device)
        if version is None:
            writes.failed += 1
            if leads:
                stale.add(device.set_key)
            continue
        (first if leads else rest).append((device, device.namespace, device.name, device_status(device), version))
    guarded: list[Write] = []
    for key in guards:
        object_id = state.device_ids.get(key)
        record = decided.get(object_id) if object_id is not None else None
        version = against_row(record) if record is not None else None
        if record is None or version is None:
            stale |= {s for s, name in moving.items() if (s[0], name) == key}
            continue
        guarded.append((record, record.namespace, record.name, device_status(record), version))
    lead_writes = [*first, *guarded]
    landed = _write_first_members(writes, lead_writes, result, set(moving), stale)
    stale |= {w[0].set_key for w in lead_writes if w[0].set_key not in landed}
    written = [w[0] for w in first if w[0].set_key in landed]
    # Making room: a set for which a move of its plan did not land has no room; it waits. So does
    # a set placed where a set that stays still holds its units.
    held_back = admissions.waiting_on(result, state, stale, later=False, written={d.set_key for d in written})
    written += writes.patch_many("GPU", [w for w in rest if w[0].set_key not in stale | held_back])
    for namespace, vm in sorted(stale):
        log.info("set %s/%s stays where it is this pass: its first member changed (a VMI admitted to it?)",
                 namespace, vm)  # fmt: skip
    writes.mirror("GPU")
    keys = {d.key for d in written}
    classes, budgets, failed = _write_class_and_budget_status(result)
    narrowed = dataclasses.replace(
        result,
        devices=tuple(written),
        changes=tuple(c for c in result.changes if (c.namespace, c.name) in keys),
        answered=tuple(k for k in result.answered if k in keys),
        class_status=classes,
        budget_used=budgets,
    )
    return narrowed, writes.failed + failed


def _write_first_members(
    writes: _Writes,
    leads: Sequence[tuple[e.Device, str, str, Mapping[str, Any], str]],
    result: PassResult,
    moving: set[tuple[str, str]],
    stale: set[tuple[str, str]],
) -> set[tuple[str, str]]:
    """Write the first members of the moving sets; the sets whose write landed. Making room's
    moves go in each plan's order, one at a time: a taken set whose write does not land stays,
    and so do the sets taken after it (added to ``stale``; SPEC §4 "Making room"). Every other
    first member goes out at once."""
    in_plan = {key for taken in result.room_plans.values() for key in taken}
    landed = {d.set_key for d in writes.patch_many("GPU", [w for w in leads if w[0].set_key not in in_plan])}
    by_set = {w[0].set_key: w for w in leads if w[0].set_key in in_plan}
    for _, taken in sorted(result.room_plans.items()):
        for index, key in enumerate(taken):
            if key in landed or key not in moving:
                continue
            if key not in stale and key in by_set and writes.patch_many("GPU", [by_set[key]]):
                landed.add(key)
                continue
            stale.add(key)
            stale.update(k for k in taken[index + 1 :] if k not in landed)
            break
    return landed


def _write_class_and_budget_status(
    result: PassResult,
) -> tuple[dict[str, e.ClassStatus], dict[tuple[str, str], Mapping[str, int]], int]:
    """Write the status of classes and budgets whose rows hold another; return the
    statuses the mirror may record (written or already there) and the failures. A pass
    binding sets for many tenants changes many budgets: they go out several at once, as
    the devices' statuses do."""
    class_writes, budget_writes = _Writes(), _Writes()
    classes = _write_classes(result, class_writes)
    budgets = _write_budgets(result, budget_writes)
    class_writes.mirror("GPUClass")
    budget_writes.mirror("GPUBudget")
    return classes, budgets, class_writes.failed + budget_writes.failed


def _write_classes(result: PassResult, writes: _Writes) -> dict[str, e.ClassStatus]:
    rows = (
        models.GpuClass.objects.select_for_update(skip_locked=True)
        .filter(name__in=list(result.class_status))
        .values_list("name", "resource_version", "status_allocatable", "status_bound", "status_lost")
    )
    current = {name: (version, (a, b, lost)) for name, version, a, b, lost in rows}
    classes: dict[str, e.ClassStatus] = {}
    todo: list[tuple[tuple[str, e.ClassStatus], str, str, Mapping[str, Any], str]] = []
    for name, status in result.class_status.items():
        row = current.get(name)
        if row is None:
            continue  # gone, or being written by the sync: the next pass computes it again
        if row[1] == (status.allocatable, status.bound, status.lost):
            classes[name] = status  # unchanged: no write, no event, no pass it would trigger
        else:
            body = {"allocatable": status.allocatable, "bound": status.bound, "lost": status.lost}
            todo.append(((name, status), "", name, body, row[0]))
    classes.update(writes.patch_many("GPUClass", todo))
    return classes


def _write_budgets(result: PassResult, writes: _Writes) -> dict[tuple[str, str], Mapping[str, int]]:
    wanted = result.budget_used
    budgets: dict[tuple[str, str], Mapping[str, int]] = {}
    if not wanted:
        return budgets
    rows = (
        models.GpuBudget.objects.select_for_update(skip_locked=True, of=("self",))
        .filter(name__in={name for _, name in wanted}, namespace__name__in={ns for ns, _ in wanted})
        .values_list("namespace__name", "name", "resource_version", "used")
    )
    held = {(ns, name): (version, used) for ns, name, version, used in rows}
    todo: list[tuple[tuple[tuple[str, str], Mapping[str, int]], str, str, Mapping[str, Any], str]] = []
    for key, used in wanted.items():
        budget = held.get(key)
        if budget is None:
            continue
        if budget[1] == dict(used):
            budgets[key] = used
            continue
        body: dict[str, Any] = {"used": dict(used)}
        if key in result.budget_borrowed:
            body["borrowed"] = dict(result.budget_borrowed[key]) or None
        todo.append(((key, used), key[0], key[1], body, budget[0]))
    budgets.update(writes.patch_many("GPUBudget", todo))
    return budgets


# -- finalizers ---------------------------------------------------------------------


def releases_due() -> list[models.FinalizerRelease]:
    """The deleting objects that wait on gpuplane's finalizer, as the sync noted them.

    Read inside the pass's transaction *before* its catch-up: a note is committed with
    the deletion of its object's row, so every note read here belongs to a deletion the
    catch-up that follows applies, and the pass releases (and closes the records of)
    what it removes the finalizer of.
    """
    return list(models.FinalizerRelease.objects.order_by("kind", "namespace", "name"))


def release_finalizers(notes: Sequence[models.FinalizerRelease]) -> int:
    """Remove gpuplane's finalizer from the noted objects (after the pass's commit).

    Written against the noted version; on a 409 (another finalizer went, a label
    changed) the object is read once and, if it is still that object (same uid), still
    being deleted and still ours to release, written against its current version. A
    note is dropped once its finalizer is gone or its object is; a failure keeps it for
    the next full pass.
    """
    api = apiserver.api()
    released = 0
    for note in notes:
        finalizers = [f for f in note.finalizers if f != kube_client.FINALIZER]
        try:
            try:
                api.set_finalizers(note.kind, note.namespace, note.name, finalizers, note.resource_version)
            except ApiException as exc:
                if exc.status != 409:
                    raise
                current = api.get(note.kind, note.namespace, note.name)
                if current is None or not _still_ours(note, current):
                    _forget(note)
                    continue
                api.set_finalizers(
                    note.kind,
                    note.namespace,
                    note.name,
                    kube_client.without_finalizer(current),
                    str(current["metadata"].get("resourceVersion") or ""),
                )
        except Exception as exc:  # noqa: BLE001 - one object's refused write never stops the pass
            if isinstance(exc, ApiException) and exc.status == 404:
                _forget(note)  # gone already
                continue
            log.info("finalizer of %s %s/%s left for the next pass: %s", note.kind, note.namespace, note.name,
                     describe(exc))  # fmt: skip
            continue
        _forget(note)
        released += 1
    return released


def _still_ours(note: models.FinalizerRelease, current: Mapping[str, Any]) -> bool:
    meta = current.get("metadata") or {}
    return (
        (not note.uid or meta.get("uid") == note.uid)
        and kube_client.is_deleting(current)
        and kube_client.FINALIZER in (meta.get("finalizers") or [])
    )


def _forget(note: models.FinalizerRelease) -> None:
    """Drop a note, unless the sync noted a newer version of the object meanwhile."""
    with transaction.atomic():
        models.FinalizerRelease.objects.filter(pk=note.pk, resource_version=note.resource_version).delete()
