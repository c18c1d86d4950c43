"""Cluster mode: keep the mirror in step with the API server by listing, then watching.

The mirror (``binder.models``) is what the admin, the API, the webhook's advisory
check and the catalog read, so in cluster mode it must follow the cluster closely.
Each mirrored kind runs the loop every Kubernetes controller runs (client-go's
reflector, kopf's watcher): **list** everything and replace that kind's rows with it,
then **watch** from the list's resourceVersion and apply each event; on **410 Gone**
(the version was compacted away) list again; and list again every
``GPUPLANE_RELIST_SECONDS`` anyway, so an event lost in transit is repaired. Every
change queues a full pass (collapsed, ``binder.tasks``).

The sync keeps the mirror current; the binder's passes do not list anything. A pass
brings its in-memory state current from the change feed the mirror's writes leave
(``binder.runtime.state``), so what a pass sees is what this loop (and the binder's own
writes) committed. That makes two rules matter here (``binder.mirror.write``): rows of
GPUs, classes and budgets keep the object's resourceVersion, and a watch event or a
listed object **older than its row is ignored** (counted, ``SyncStatus.stale``). The
binder mirrors the object each of its status writes returned, so its row is often
ahead of the watch: applying the binder's own write when it arrives late, or a relist
taken before it, would undo a booking in the mirror and let the next pass book the same
units again. Deletions always apply.

What is kept: GPU and GPUClass objects that are being deleted count as gone (their
units are released by the next pass); one that still carries gpuplane's finalizer is
noted (``FinalizerRelease``) in the same transaction that drops its row, and the full
pass that sees the row gone removes the finalizer after its commit. Pods only
while they request a GPU resource. An object that does not parse (a NUL in a
field, a bind request over 128 characters, ...) is refused at the parser, logged with the
object and field, counted (``SyncStatus.invalid``, ``last_invalid``) and never stops the
others; if the mirror had a row for it, the row keeps its last good state and is marked
(``parse_error``): an object that stops parsing is not deleted.

Progress and health go to ``SyncStatus`` (one row per kind: version, counts, lag from
receiving an event to its row being committed, relists, 410s, last error), which
``/metrics`` exports.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from django.db import close_old_connections, connection
from django.db.models import F
from django.utils import timezone

from binder import apiserver, models
from binder.errors import describe, is_transient
from binder.kube import client as kube_client
from binder.mirror.write import (
    RELEASED_BY_BINDER,
    Applied,
    mirror_event,
    mirror_list,
    mirror_objects,
    object_key,
)

log = logging.getLogger(__name__)

#: How often a kind's events put aside (their rows held by a pass) are applied.
DEFERRED_RETRY_SECONDS = 0.2
#: Kinds in the order the first list goes: namespaces before what lives in them.
SYNC_ORDER = ("Namespace", "Node", "GPUClass", "GPUBudget", "VirtualMachineInstance", "Pod", "GPU")


def add_finalizer(kind: str, obj: Mapping[str, Any]) -> None:
    """Put gpuplane's finalizer on a GPU or GPUClass that lacks it.

    Written with the object's resourceVersion: on a conflict the object changed and
    its next event brings it back here. The object the write returned is mirrored at
    once (only its version moved): the binder's next status write then has the current
    version as its precondition instead of meeting a 409 until the event arrives.

    A refused write is classified by ``binder.errors`` like every other API call: a
    transient one waits for the object's next event; a permanent one (403 from RBAC
    without ``patch``, 422) is logged as an error and counted on the kind's
    ``SyncStatus`` (``errors``, ``last_error``), and the list or watch goes on. Raising it
    would fail the whole list on every retry, so one object's refusal would stop the
    kind being mirrored at all.
    """
    finalizers = kube_client.with_finalizer(obj)
    if finalizers is None or kind not in RELEASED_BY_BINDER:
        return
    meta = obj.get("metadata") or {}
    name = f"{meta['namespace']}/{meta['name']}" if meta.get("namespace") else str(meta.get("name"))
    try:
        stored = apiserver.api().set_finalizers(
            kind, str(meta.get("namespace") or ""), str(meta["name"]), finalizers, str(meta.get("resourceVersion"))
        )
    except Exception as exc:  # noqa: BLE001 - classified by binder.errors; one object never stops the sync
        if is_transient(exc):
            log.info("sync: finalizer on %s %s left for its next event: %s", kind, name, describe(exc))
            return
        log.error("sync: finalizer on %s %s refused (%s, permanent)", kind, name, describe(exc))
        record_status(kind, last_error=f"finalizer on {name}: {describe(exc)}"[:500], add={"errors": 1})
        return
    # Not waited for when a pass holds the row: the finalizer's watch event brings it anyway.
    mirror_objects(kind, [stored], queue=False, defer_held=True)


# -- status ---------------------------------------------------------------------------------


def record_status(kind: str, *, add: Mapping[str, int] | None = None, **values: Any) -> None:
    """Set ``values`` and add ``add`` to the counters of ``kind``'s ``SyncStatus`` row."""
    increments = {name: F(name) + n for name, n in (add or {}).items()}
    rows = models.SyncStatus.objects.filter(kind=kind)
    if not rows.update(**values, **increments, updated=timezone.now()):  # one query per event once the row exists
        models.SyncStatus.objects.get_or_create(kind=kind)
        rows.update(**values, **increments, updated=timezone.now())


# -- the loop -------------------------------------------------------------------------------


class KindSync:
    """List, then watch one kind until ``stop`` is set (one thread per kind)."""

    def __init__(
        self,
        kind: str,
        stop: threading.Event,
        *,
        relist_seconds: float,
        watch_seconds: int,
        backoff: float = 1.0,
    ) -> None:
        self.kind = kind
        self.stop = stop
        self.relist_seconds = relist_seconds
        self.watch_seconds = watch_seconds
        self.backoff = backoff
        self.resource_version = ""
        # Events whose rows a pass held when they came (see mirror_objects' defer_held),
        # newest per object, and the ones being applied now; guarded by ``_held``.
        self._deferred: dict[tuple[str, str], Mapping[str, Any]] = {}
        self._applying: set[tuple[str, str]] = set()
        self._held = threading.Condition()

    def relist(self, progress: Callable[[int], None] | None = None) -> Applied:
        listing = apiserver.api().list(self.kind)
        applied = mirror_list(self.kind, listing.items, progress, list_version=listing.resource_version)
        for obj in listing.items:
            add_finalizer(self.kind, obj)
        self.resource_version = listing.resource_version
        record_status(
            self.kind,
            resource_version=listing.resource_version,
            listed=len(listing.items),
            listed_at=timezone.now(),
            add={"relists": 1, "invalid": applied.invalid, "stale": applied.stale},
            **({"last_invalid": applied.last_invalid} if applied.last_invalid else {}),
        )
        log.info(
            "sync: listed %d %s at version %s (%d kept, %d rows removed, %d invalid)",
            len(listing.items),
            self.kind,
            listing.resource_version,
            applied.upserted,
            applied.deleted,
            applied.invalid,
        )
        return applied

    def watch_until(self, deadline: float) -> None:
        """Watch from the current version until ``deadline``, ``stop``, or a 410."""
        while not self.stop.is_set() and time.monotonic() < deadline:
            timeout = max(1, min(self.watch_seconds, int(deadline - time.monotonic()) + 1))
            for event_type, obj in apiserver.api().watch(self.kind, self.resource_version, timeout):
                received = time.monotonic()
                version = str((obj.get("metadata") or {}).get("resourceVersion") or self.resource_version)
                if event_type == "BOOKMARK":
                    self.resource_version = version
                    continue
                if event_type == "ERROR":
                    raise kube_client.Gone(str(obj))
                applied = self.apply(event_type, obj)
                if event_type != "DELETED":
                    add_finalizer(self.kind, obj)
                self.resource_version = version
                lag = time.monotonic() - received
                record_status(
                    self.kind,
                    resource_version=version,
                    last_event_at=timezone.now(),
                    lag_seconds=lag,
                    add={"events": 1, "invalid": applied.invalid, "stale": applied.stale},
                    **({"last_invalid": applied.last_invalid} if applied.last_invalid else {}),
                )
                if self.stop.is_set():
                    break
        self.apply_deferred()

    def apply(self, event_type: str, obj: Mapping[str, Any]) -> Applied:
        """One watch event into the mirror, never waiting for a pass: an object whose row a
        pass holds (most often the echo of that pass's own status write, which the pass
        mirrors itself) is put aside for :meth:`apply_deferred`, and so is every later
        event of that object until then, so each object's events still land in order. A
        deletion waits for its object's deferred event, then always applies."""
        key = object_key(self.kind, obj)
        if event_type == "DELETED":
            with self._held:
                self._deferred.pop(key, None)
                while key in self._applying:
                    self._held.wait(1)
            return mirror_event(self.kind, event_type, obj)
        with self._held:
            if key in self._deferred or key in self._applying:
                self._deferred[key] = obj
                return Applied()
        applied = mirror_objects(self.kind, [obj], defer_held=True)
        if applied.deferred:
            with self._held:
                self._deferred[key] = obj
        return applied

    def apply_deferred(self) -> None:
        """Apply the events put aside, waiting for the rows this time (the retry thread
        calls it every ``DEFERRED_RETRY_SECONDS``; a watch that ends calls it too)."""
        with self._held:
            batch, self._deferred = self._deferred, {}
            self._applying.update(batch)
        try:
            if batch:
                mirror_objects(self.kind, list(batch.values()))
        except BaseException:
            # Not applied: back in line for the next try, behind any newer event of the object.
            with self._held:
                for key, obj in batch.items():
                    self._deferred.setdefault(key, obj)
            raise
        finally:
            with self._held:
                self._applying.difference_update(batch)
                self._held.notify_all()

    def _retry_deferred(self) -> None:
        while not self.stop.wait(DEFERRED_RETRY_SECONDS):
            try:
                self.apply_deferred()
            except Exception as exc:  # noqa: BLE001 - kept for the next try (apply_deferred)
                log.warning("sync: %s events put aside not applied yet: %s", self.kind, describe(exc))
                close_old_connections()
        connection.close()

    def run(self) -> None:
        """List when there is no version to watch from (start, 410, error) or a relist is
        due, else watch; until ``stop``."""
        threading.Thread(target=self._retry_deferred, name=f"sync-{self.kind}-deferred", daemon=True).start()
        failures = 0
        relist_due = time.monotonic() if not self.resource_version else time.monotonic() + self.relist_seconds
        while not self.stop.is_set():
            try:
                if not self.resource_version or time.monotonic() >= relist_due:
                    self.relist()
                    relist_due = time.monotonic() + self.relist_seconds
                self.watch_until(relist_due)
                failures = 0
            except kube_client.Gone as exc:
                log.info("sync: %s watch expired (%s): listing again", self.kind, exc)
                self.resource_version = ""
                record_status(self.kind, add={"gone": 1})
            except Exception as exc:  # noqa: BLE001 - classified by binder.errors; the loop lists again
                failures += 1
                self.resource_version = ""
                transient = is_transient(exc)
                delay = min(60.0, self.backoff * 2**failures)
                log.log(
                    logging.WARNING if transient else logging.ERROR,
                    "sync: %s failed (%s, %s); listing again in %.0f s",
                    self.kind,
                    describe(exc),
                    "transient" if transient else "permanent",
                    delay,
                )
                with contextlib.suppress(Exception):  # the database may be the failure; the log has it
                    record_status(self.kind, last_error=describe(exc)[:500], add={"errors": 1})
                close_old_connections()
                self.stop.wait(delay)
        connection.close()


def sync_once(progress_for: Callable[[str], Callable[[int], None] | None] | None = None) -> dict[str, Applied]:
    """List every kind once, in :data:`SYNC_ORDER` (``sync_cluster --once``, tests).

    ``progress_for(kind)`` may return a callback told of each object mirrored.
    """
    stop = threading.Event()
    return {
        kind: KindSync(kind, stop, relist_seconds=0, watch_seconds=1).relist(
            progress_for(kind) if progress_for is not None else None
        )
        for kind in SYNC_ORDER
    }


def run_forever(stop: threading.Event, *, relist_seconds: float, watch_seconds: int) -> list[threading.Thread]:
    """Start one syncing thread per kind; they run until ``stop`` is set."""
    threads = []
    for kind in SYNC_ORDER:
        runner = KindSync(kind, stop, relist_seconds=relist_seconds, watch_seconds=watch_seconds)
        thread = threading.Thread(target=runner.run, name=f"sync-{kind}", daemon=True)
        thread.start()
        threads.append(thread)
    return threads
