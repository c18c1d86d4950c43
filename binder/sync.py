"""Cluster mode: keep the mirror in step with the API server by listing, then watching.

The mirror (``binder.models``) is what the admin, the API, the webhook's advisory
check and the catalog read, so in cluster mode it must follow the cluster closely.
Each mirrored kind runs the loop every Kubernetes controller runs (client-go's
reflector, kopf's watcher): **list** everything and replace that kind's rows with it,
then **watch** from the list's resourceVersion and apply its events (in batches: what
arrived while the last batch was being written goes in one transaction); on **410 Gone**
(the version was compacted away) list again; and list again every
``GPUPLANE_RELIST_SECONDS`` anyway, so an event lost in transit is repaired. Every
change queues a full pass (collapsed, ``binder.tasks``).

The sync keeps the mirror current, and the binder's passes decide from it: a pass
brings its in-memory state current from the change feed the mirror's writes leave
(``binder.runtime.state``), so what a pass sees is what this loop (and the binder's own
writes) committed. (The one thing a pass asks the API server for is a fresh read of the
VMIs raw-GPU pods name, for the usage records: ``binder.runtime.usage_records``.) The
kinds, and the order the first list goes in, are the rows of ``binder.kube.kinds.KINDS``.

Because a pass decides from what this loop commits, two rules matter (``binder.mirror.write``): rows of
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
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from django.db import close_old_connections, connection
from django.db.models import F
from django.utils import timezone
from kubernetes.client import ApiException

from binder import apiserver, models
from binder.errors import describe, is_transient
from binder.kube import client as kube_client
from binder.kube import kinds as kube_kinds
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
#: Kinds in the order the first list goes: namespaces before what lives in them (the table's order).
SYNC_ORDER = tuple(k.kind for k in kube_kinds.KINDS)


def add_finalizers(kind: str, objects: Sequence[Mapping[str, Any]]) -> None:
    """Put gpuplane's finalizer on each GPU or GPUClass of ``objects`` that lacks it.

    Each write carries its object's resourceVersion: on a conflict the object changed and
    its next event brings it back here. The writes go out several at once
    (``kube_client.each_in_flight``), and the objects they returned are mirrored at once in
    one transaction (only their versions moved): the binder's next status write then has
    the current version as its precondition instead of meeting a 409 until the event
    arrives.

    A refused write is classified by ``binder.errors`` like every other API call: a
    transient one waits for the object's next event; a permanent one (403 from RBAC
    without ``patch``, 422) is logged as an error and counted on the kind's
    ``SyncStatus`` (``errors``, ``last_error``), and the list or watch goes on. Raising it
    would fail the whole list on every retry, so one object's refusal would stop the
    kind being mirrored at all.
    """
    if kind not in RELEASED_BY_BINDER:
        return
    wanted = [(obj, finalizers) for obj in objects if (finalizers := kube_client.with_finalizer(obj)) is not None]
    if not wanted:
        return
    api = apiserver.api()

    def write(item: tuple[Mapping[str, Any], list[str]]) -> dict[str, Any]:
        obj, finalizers = item
        meta = obj.get("metadata") or {}
        return api.set_finalizers(
            kind, str(meta.get("namespace") or ""), str(meta["name"]), finalizers, str(meta.get("resourceVersion"))
        )

    stored = []
    for (obj, _), outcome in zip(wanted, kube_client.each_in_flight(write, wanted), strict=True):
        if not isinstance(outcome, Exception):
            stored.append(outcome)
            continue
        name = "/".join(part for part in object_key(kind, obj) if part)
        if is_transient(outcome):
            log.info("sync: finalizer on %s %s left for its next event: %s", kind, name, describe(outcome))
            continue
        log.error("sync: finalizer on %s %s refused (%s, permanent)", kind, name, describe(outcome))
        record_status(kind, last_error=f"finalizer on {name}: {describe(outcome)}"[:500], add={"errors": 1})
    if stored:
        # Not waited for where a pass holds the row: the finalizer's watch event brings it anyway.
        mirror_objects(kind, stored, queue=False, defer_held=True)


# -- status ---------------------------------------------------------------------------------


def record_status(kind: str, *, add: Mapping[str, int] | None = None, **values: Any) -> None:
    """Set ``values`` and add ``add`` to the counters of ``kind``'s ``SyncStatus`` row."""
    increments = {name: F(name) + n for name, n in (add or {}).items()}
    rows = models.SyncStatus.objects.filter(kind=kind)
    if not rows.update(**values, **increments, updated=timezone.now()):  # one query per event once the row exists
        models.SyncStatus.objects.get_or_create(kind=kind)
        rows.update(**values, **increments, updated=timezone.now())


# -- the loop -------------------------------------------------------------------------------


#: The most watch events mirrored in one transaction.
WATCH_BATCH = 500
#: A watch event as the stream's reader received it: type, object, ``time.monotonic()``.
Event = tuple[str, Mapping[str, Any], float]


class WatchStream:
    """One watch's events, read on a thread of their own into a bounded queue.

    The reader only parses (no database); :meth:`batches` hands the consumer everything
    that has arrived, so the consumer's transactions grow with the backlog instead of the
    backlog growing behind one transaction per event. The queue is bounded: a consumer
    that falls far behind slows the reader, and the API server buffers the rest (or ends
    the watch, which is then resumed from the last version applied). The reader's
    failure (410 Gone, a broken stream) reaches the consumer after the events read before
    it, so they are applied first.
    """

    _END = "END"

    def __init__(self, kind: str, events: Iterator[tuple[str, dict[str, Any]]]) -> None:
        self._queue: queue.Queue[tuple[str, Any, float]] = queue.Queue(maxsize=WATCH_BATCH * 4)
        self._closed = threading.Event()
        threading.Thread(target=self._read, args=(events,), name=f"sync-{kind}-watch", daemon=True).start()

    def _put(self, item: tuple[str, Any, float]) -> None:
        while not self._closed.is_set():
            with contextlib.suppress(queue.Full):
                self._queue.put(item, timeout=0.5)
                return

    def _read(self, events: Iterator[tuple[str, dict[str, Any]]]) -> None:
        failure: BaseException | None = None
        try:
            for event_type, obj in events:
                self._put((event_type, obj, time.monotonic()))
                if self._closed.is_set():
                    return  # the consumer left; the stream ends at the watch's own timeout
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            failure = exc
        self._put((self._END, failure, time.monotonic()))

    def batches(self, stop: threading.Event) -> Iterator[list[Event]]:
        """Batches of the events received, each at most :data:`WATCH_BATCH`, until the
        watch ends (or raises) or ``stop`` is set (checked every half second while idle)."""
        while not stop.is_set():
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            batch: list[Event] = []
            while True:
                if item[0] == self._END:
                    if batch:
                        yield batch
                    if item[1] is not None:
                        raise item[1]
                    return
                batch.append(item)
                if len(batch) >= WATCH_BATCH:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            yield batch

    @property
    def backlog(self) -> int:
        """Events received and not yet handed to the consumer."""
        return self._queue.qsize()

    def close(self) -> None:
        """Stop taking events: the reader drops what still comes and ends with the watch."""
        self._closed.set()


#: What to do when the cluster does not serve a kind's API, by API group.
INSTALL_HINTS = {
    "kubevirt.io": "install KubeVirt",
    "gpuplane.io": "install gpuplane's CRDs (charts/gpuplane/crds, or deploy/base/crds)",
}


class MissingApi(RuntimeError):
    """The cluster does not serve a kind gpuplane mirrors (HTTP 404 on its list): the message
    names the API and what to install."""

    def __init__(self, kind: str) -> None:
        resource = kube_client.RESOURCES[kind]
        hint = INSTALL_HINTS.get(resource.group, "is this cluster's API complete?")
        super().__init__(f"{resource.api_version} {resource.plural} is not served (HTTP 404): {hint}")
        self.kind = kind


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
        #: An optional kind the API server does not serve (its last list answered 404).
        self.absent = False
        # Events whose rows a pass held when they came (see mirror_objects' defer_held),
        # newest per object, and the ones being applied now; guarded by ``_held``.
        self._deferred: dict[tuple[str, str], Mapping[str, Any]] = {}
        self._applying: set[tuple[str, str]] = set()
        self._held = threading.Condition()

    def relist(self, progress: Callable[[int], None] | None = None) -> Applied:
        try:
            listing = apiserver.api().list(self.kind)
        except ApiException as exc:
            if exc.status == 404:
                raise MissingApi(self.kind) from None
            raise
        if not listing.served and not self.absent:
            # An optional kind (binder.kube.kinds.Kind.optional) the cluster does not serve.
            log.warning("sync: the API server does not serve %s (no CRD?): none mirrored; listing again later",
                        self.kind)  # fmt: skip
        self.absent = not listing.served
        applied = mirror_list(self.kind, listing.items, progress, list_version=listing.resource_version)
        add_finalizers(self.kind, listing.items)
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
        """Watch from the current version until ``deadline``, ``stop``, or a 410.

        The stream is read on a thread of its own (:class:`WatchStream`) while this one
        mirrors: the events that arrive while a batch is being written wait in line and go
        into the next batch, one transaction and one ``SyncStatus`` update for all of them
        (:meth:`apply_events`). A quiet cluster gets each event on its own, at once; a busy
        one (thousands of GPUs created, a pass's status writes coming back) gets batches as
        large as the backlog, up to :data:`WATCH_BATCH`. A kind the API server does not serve
        (``absent``) is not watched: it is listed again at the deadline."""
        if self.absent:
            self.stop.wait(max(0.0, deadline - time.monotonic()))
            return
        while not self.stop.is_set() and time.monotonic() < deadline:
            timeout = max(1, min(self.watch_seconds, int(deadline - time.monotonic()) + 1))
            stream = WatchStream(self.kind, apiserver.api().watch(self.kind, self.resource_version, timeout))
            try:
                for batch in stream.batches(self.stop):
                    self.apply_events(batch)
                    if self.stop.is_set():
                        break
            finally:
                stream.close()
        self.apply_deferred()

    def apply_events(self, events: Sequence[Event]) -> None:
        """A batch of watch events into the mirror, in order, and its progress recorded.

        Between deletions, each object's latest event stands for its earlier ones (the row
        ends as the latest says either way), and all of them are written by one
        :meth:`apply`. A deletion is applied on its own, after what came before it. Then
        the finalizers the batch's GPUs and classes lack are written, the resourceVersion
        moves to the batch's last event, and ``SyncStatus`` counts the batch: its events,
        the lag from receiving the first of them to the commit."""
        version = self.resource_version
        latest: dict[tuple[str, str], Mapping[str, Any]] = {}
        finalize: dict[tuple[str, str], Mapping[str, Any]] = {}
        count = invalid = stale = 0
        last_invalid = ""

        def add(applied: Applied) -> None:
            nonlocal invalid, stale, last_invalid
            invalid += applied.invalid
            stale += applied.stale
            last_invalid = applied.last_invalid or last_invalid

        for event_type, obj, _ in events:
            if event_type == "ERROR":
                add(self.apply(list(latest.values())))
                raise kube_client.Gone(str(obj))
            version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
            if event_type == "BOOKMARK":
                continue
            count += 1
            key = object_key(self.kind, obj)
            if event_type == "DELETED":
                add(self.apply(list(latest.values())))
                latest.clear()
                finalize.pop(key, None)
                add(self.delete(obj))
            else:
                latest[key] = finalize[key] = obj
        add(self.apply(list(latest.values())))
        add_finalizers(self.kind, list(finalize.values()))
        self.resource_version = version
        if not count:
            return
        record_status(
            self.kind,
            resource_version=version,
            last_event_at=timezone.now(),
            lag_seconds=time.monotonic() - events[0][2],
            add={"events": count, "invalid": invalid, "stale": stale},
            **({"last_invalid": last_invalid} if last_invalid else {}),
        )

    def apply(self, objects: Sequence[Mapping[str, Any]]) -> Applied:
        """Added or modified objects into the mirror in one transaction, never waiting for a
        pass: an object whose row a pass holds (most often the echo of that pass's own
        status write, which the pass mirrors itself) is put aside for
        :meth:`apply_deferred`, and so is every later event of that object until then, so
        each object's events still land in order."""
        if not objects:
            return Applied()
        now: list[Mapping[str, Any]] = []
        with self._held:
            for obj in objects:
                key = object_key(self.kind, obj)
                if key in self._deferred or key in self._applying:
                    self._deferred[key] = obj
                else:
                    now.append(obj)
        applied = mirror_objects(self.kind, now, defer_held=True)
        if applied.deferred:
            with self._held:
                for obj in applied.deferred:
                    self._deferred[object_key(self.kind, obj)] = obj
        return applied

    def delete(self, obj: Mapping[str, Any]) -> Applied:
        """A deletion: it waits for its object's deferred event, then always applies."""
        key = object_key(self.kind, obj)
        with self._held:
            self._deferred.pop(key, None)
            while key in self._applying:
                self._held.wait(1)
        return mirror_event(self.kind, "DELETED", obj)

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


def list_all(
    stop: threading.Event,
    *,
    relist_seconds: float,
    watch_seconds: int,
    progress_for: Callable[[str], Callable[[int], None] | None] | None = None,
) -> tuple[dict[str, KindSync], dict[str, Applied]]:
    """List every kind once, in :data:`SYNC_ORDER`; the runners (each at its list's
    resourceVersion, for :func:`run_forever` to watch from) and what each list changed.

    ``progress_for(kind)`` may return a callback told of each object mirrored.
    """
    runners = {
        kind: KindSync(kind, stop, relist_seconds=relist_seconds, watch_seconds=watch_seconds) for kind in SYNC_ORDER
    }
    applied = {
        kind: runner.relist(None if progress_for is None else progress_for(kind)) for kind, runner in runners.items()
    }
    return runners, applied


def sync_once(progress_for: Callable[[str], Callable[[int], None] | None] | None = None) -> dict[str, Applied]:
    """List every kind once, with no runner kept to watch on (tests, and a list on demand)."""
    return list_all(threading.Event(), relist_seconds=0, watch_seconds=1, progress_for=progress_for)[1]


def run_forever(
    stop: threading.Event,
    *,
    relist_seconds: float,
    watch_seconds: int,
    runners: Mapping[str, KindSync] | None = None,
) -> list[threading.Thread]:
    """Start one syncing thread per kind; they run until ``stop`` is set. ``runners``
    (from :func:`list_all`) watch from their first list's version instead of listing
    again: at 100k GPUs a second list costs as much as the first."""
    threads = []
    for kind in SYNC_ORDER:
        runner = (runners or {}).get(kind) or KindSync(
            kind, stop, relist_seconds=relist_seconds, watch_seconds=watch_seconds
        )
        thread = threading.Thread(target=runner.run, name=f"sync-{kind}", daemon=True)
        thread.start()
        threads.append(thread)
    return threads
