"""The binder's side of cluster mode: fresh reads, status writes, finalizer release.

In cluster mode the API server, not the database, is the truth about placement, so a
pass (``binder.runtime.passes.run_pass``) does three things around the pure engine:

1. **Read fresh** (SPEC §4): at the start of every pass, inside its lock, list GPU,
   GPUClass and GPUBudget objects from the API server and bring the mirror's rows in
   line, so units the last pass booked are never booked twice even if the sync's
   watch is behind. Objects being deleted count as gone: their units are released.
2. **Write status** of each changed device through the ``status`` subresource, with
   the resourceVersion the pass read as a precondition. A 409 (someone changed the
   object) or any other failure leaves that device as it is in the cluster; only the
   writes that succeeded reach the mirror, the decision log and the usage records.
   The next pass reads the half-written set fresh and restores it (SPEC §4 step 1).
   Class and budget status go the same way.
3. **Release finalizers** (SPEC §6) once the pass that released a deleted device's
   units has committed its usage records: of deleted GPUs, and of deleted GPUClasses
   (whose devices the same pass released). This runs with ``GPUPLANE_ENABLED=false``
   too, so turning GPUs off never hangs a namespace or class deletion.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from binder import apiserver
from binder.engine import PassResult
from binder.engine import types as e
from binder.errors import describe, is_transient
from binder.kube import client as kube_client
from binder.mirror.write import mirror_list, object_key

log = logging.getLogger(__name__)


@dataclass
class FreshRead:
    """What a pass read from the API server: versions to write against, objects to release."""

    #: (kind, namespace, name) -> the resourceVersion and the status the pass read.
    versions: dict[tuple[str, str, str], str] = field(default_factory=dict)
    statuses: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)
    deleting: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


def read_fresh() -> FreshRead:
    """List GPUs, classes and budgets from the API server and mirror them (in the pass's transaction)."""
    api = apiserver.api()
    fresh = FreshRead()
    for kind in ("GPUClass", "GPUBudget", "GPU"):
        listing = api.list(kind)
        mirror_list(kind, listing.items, queue=False)
        for obj in listing.items:
            key = (kind, *object_key(kind, obj))
            fresh.versions[key] = str((obj.get("metadata") or {}).get("resourceVersion") or "")
            fresh.statuses[key] = dict(obj.get("status") or {})
            if kind in ("GPU", "GPUClass") and kube_client.is_deleting(obj):
                fresh.deleting.append((kind, obj))
    return fresh


def device_status(device: e.Device) -> dict[str, Any]:
    """A device's ``status`` as the CRD spells it (SPEC §1)."""
    return {
        "phase": device.phase.value,
        "node": device.node or None,
        "since": device.since.isoformat().replace("+00:00", "Z") if device.since else None,
        "reason": device.reason,
        "answeredRequest": device.answered_request or None,
        "answer": device.answer or None,
    }


def write_status(result: PassResult, fresh: FreshRead) -> tuple[PassResult, int]:
    """Write each changed device's status; return the result narrowed to what was written.

    Devices the API server refused (409, 5xx, gone) drop out of ``devices``,
    ``changes`` and ``answered``: the mirror, the decision log and the usage records
    then describe the cluster as it is, and the next pass starts from there.
    """
    api = apiserver.api()
    written: list[e.Device] = []
    failed = 0
    for device in result.devices:
        version = fresh.versions.get(("GPU", *device.key))
        if version is None:
            continue  # not in the cluster any more
        try:
            api.patch_status("GPU", device.namespace, device.name, device_status(device), version)
        except Exception as exc:  # noqa: BLE001 - one object's refused write never stops the pass
            failed += 1
            level = logging.INFO if is_transient(exc) else logging.ERROR
            log.log(level, "status of GPU %s/%s left for the next pass: %s", device.namespace, device.name,
                    describe(exc))  # fmt: skip
            continue
        written.append(device)
    keys = {d.key for d in written}
    narrowed = dataclasses.replace(
        result,
        devices=tuple(written),
        changes=tuple(c for c in result.changes if (c.namespace, c.name) in keys),
        answered=tuple(k for k in result.answered if k in keys),
    )
    failed += _write_class_and_budget_status(api, result, fresh)
    return narrowed, failed


def _write_class_and_budget_status(api: kube_client.KubeApi, result: PassResult, fresh: FreshRead) -> int:
    failed = 0
    wanted: list[tuple[str, str, str, dict[str, Any]]] = [
        ("GPUClass", "", name, {"allocatable": status.allocatable, "bound": status.bound, "lost": status.lost})
        for name, status in result.class_status.items()
    ]
    wanted += [("GPUBudget", ns, name, {"used": dict(used)}) for (ns, name), used in result.budget_used.items()]
    for kind, ns, name, body in wanted:
        version = fresh.versions.get((kind, ns, name))
        current = fresh.statuses.get((kind, ns, name), {})
        if version is None or all(current.get(k) == v for k, v in body.items()):
            continue  # gone, or unchanged: no write, no event, no pass it would trigger
        try:
            api.patch_status(kind, ns, name, body, version)
        except Exception as exc:  # noqa: BLE001 - one object's refused write never stops the pass
            failed += 1
            log.info("status of %s %s left for the next pass: %s", kind, name, describe(exc))
    return failed


def release_finalizers(fresh: FreshRead) -> int:
    """Remove gpuplane's finalizer from the deleted GPUs and classes this pass released."""
    api = apiserver.api()
    released = 0
    for kind, obj in fresh.deleting:
        ns, name = object_key(kind, obj)
        meta = obj.get("metadata") or {}
        if kube_client.FINALIZER not in (meta.get("finalizers") or []):
            continue
        try:
            api.set_finalizers(kind, ns, name, kube_client.without_finalizer(obj), str(meta.get("resourceVersion")))
        except Exception as exc:  # noqa: BLE001 - one object's refused write never stops the pass
            log.info("finalizer of %s %s left for the next pass: %s", kind, name, describe(exc))
            continue
        released += 1
    return released
