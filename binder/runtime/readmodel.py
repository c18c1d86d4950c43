"""The read model: one web process's copy of the mirror, for the webhook, the catalog and the board.

A web process must decide from a view that holds every change committed before the call
arrived. Reading the namespace's slice of the mirror from the database on every call
proves that, but costs a dozen milliseconds of CPU per call at 10k nodes. Instead each
web process keeps the whole mirror in memory (:class:`ReadModel`, a
:class:`~binder.runtime.mirror_state.MirrorState` like the binder's), built once, and
brings it current from the change feed before each decision (:meth:`ReadModel.current`).

**Freshness, per call, with a single flight.** A call is fresh when it decides after a
feed read that *began after the call arrived*: that read's snapshot holds every commit
before the arrival. Concurrent calls share reads: a call that arrives while a follow is
running waits for the next follow to start and finish (the running one may have taken
its snapshot before the call arrived, so it proves nothing for it); one follow then
serves every call that arrived before it began. Normally that read returns no entries:
one round trip, shared, per burst of calls. A follow that fails (the database went
away) serves no one: each waiting call then tries its own.

**Rebuilds** follow the feed's rules (``binder.runtime.feed``): a gap, a reset, a
truncate or a renamed namespace reads everything again. A follow that raised part way
drops the model, so the next call rebuilds rather than trust a half-applied change.

**The admission stamp.** A Bound VMI's admission writes ``admitted`` on its set's first
member (``binder.runtime.admissions``): one device row change per call, in the namespace the
call decides about. Dropping that namespace's slice for it made the next call rebuild the slice
and the webhook's device index (``webhooks.binding.mirror_view``) on nearly every call. No web
decision reads the stamp (it is the binder's input: the move grace), so a slice holds its
devices without it (:func:`unstamped`) and a change of the stamp alone leaves the slice as it
is, which is then still exact. The model's records keep the stamp as the database has it
(verification compares them, and snapshots give them to the engine).

**Pruning.** The binder deletes feed entries every live reader has applied; readers are
the rows of ``FeedReader``. The model keeps one row per process (``readmodel:<host>:<pid>:…``),
written when built and then at most every :data:`READER_EVERY_SECONDS` (never once per
call: that would be a write per decision). The recorded position and horizon lag the
real ones, which only keeps a few more entries: they come from one read, so every
transaction that can still commit below the recorded position is in the recorded
horizon (see ``binder.runtime.feed``). Without a row the binder would prune past the model after
each full pass and every call after it would rebuild. A process that stops being seen for
``GPUPLANE_FEED_RETENTION_SECONDS`` loses its row; its next follow finds its mark gone and
rebuilds, as the binder does.

**Verification** every ``GPUPLANE_VERIFY_SECONDS`` (the binder's setting): a background
thread reads everything again into a second model, brings both to the feed's current
position and compares them record by record (``binder.runtime.verify``). Differences are
logged and counted (``gpuplane_readmodel_verify_mismatches``), and the process continues
from the fresh model.

What a decision reads from the model is immutable (engine records are frozen
dataclasses, the views tuples), so a call decides outside the model's lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import operator
import os
import socket
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import Any

from django.conf import settings as django_settings
from django.db import connection
from django.db.models.functions import Now

from binder import models
from binder.engine import Ledger, Node, ledger_for
from binder.engine import types as e
from binder.kube import kinds as kube_kinds
from binder.mirror.read import engine_settings
from binder.runtime.feed import OwnWrites
from binder.runtime.flight import SingleFlight
from binder.runtime.mirror_state import ENGINE_KINDS, Catchup, MirrorState, SetKey
from binder.runtime.verify import compare_records

log = logging.getLogger(__name__)

#: The kinds whose records belong to a namespace (the per-namespace index keeps them).
NAMESPACED = tuple(k for k in ENGINE_KINDS if k in kube_kinds.NAMESPACED)
#: How often at most the process's ``FeedReader`` row is written (well below the retention).
READER_EVERY_SECONDS = 30.0


@dataclasses.dataclass(frozen=True, slots=True)
class Slice:
    """One namespace's records, read from the model, for a decision or a page."""

    namespace: str
    devices: tuple[e.Device, ...]
    """The namespace's devices by name, without the admission stamp (:func:`unstamped`)."""
    budgets: tuple[e.Budget, ...]
    pods: tuple[e.Pod, ...]
    vmis: tuple[e.Vmi, ...]
    classes: tuple[e.GpuClass, ...]
    nodes: tuple[e.Node, ...]
    """The nodes the namespace's devices are on (those the mirror holds)."""


@dataclasses.dataclass(slots=True)
class Counters:
    """What this process's model did since it started (``/metrics`` shows them)."""

    follows: int = 0
    rebuilds: int = 0
    verifications: int = 0
    mismatches: int = 0
    failures: int = 0
    build_seconds: float = 0.0


class ReadModel(MirrorState):
    """The mirror in one web process's memory, with a per-namespace index and a single-flight follow."""

    KEPT = ("_by_namespace", "_slices")

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name or f"readmodel:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}")
        self._flight: SingleFlight[None] = SingleFlight()
        self._reader_written = -READER_EVERY_SECONDS
        self._verifier: threading.Thread | None = None
        #: Set once the model has been built (``/readyz``).
        self.built = threading.Event()
        self.counters = Counters()
        #: Moves whenever a record changes or everything was read again (pages cache by it).
        self.generation = 0

    def _reset(self, why: str) -> None:
        super()._reset(why)
        #: namespace -> kind -> row id -> record (the namespaced kinds only).
        self._by_namespace: dict[str, dict[str, dict[int, Any]]] = defaultdict(lambda: defaultdict(dict))
        #: Each namespace's slice, kept until one of its records, a class or a node changes.
        self._slices: dict[str, Slice] = {}

    # -- keeping the index current --------------------------------------------------------------

    def follow(self, skip: OwnWrites | None = None) -> Catchup:
        catch = super().follow(skip)
        if catch.view == "incremental" and any(catch.changed.values()):
            self.generation += 1
        return catch

    def rebuild(self, reason: str) -> Catchup:
        clock = time.perf_counter()
        self.generation += 1
        catch = super().rebuild(reason)
        for kind in NAMESPACED:
            for object_id, record in self.records[kind].items():
                self._by_namespace[record.namespace][kind][object_id] = record
        self.counters.rebuilds += 1
        self.counters.build_seconds = time.perf_counter() - clock
        _settle_garbage_collector()
        return catch

    def _apply(self, kind: str, ids: set[int], catch: Catchup) -> None:
        table = self.records[kind]
        before = {object_id: table.get(object_id) for object_id in ids}
        # A node change moves just that node in the kept ledger (``MirrorState._node_replaced``).
        super()._apply(kind, ids, catch)
        if kind not in NAMESPACED:
            return
        for object_id, old in before.items():
            new = table.get(object_id)
            if old is new:
                continue
            if old is not None:
                self._by_namespace[old.namespace][kind].pop(object_id, None)
            if new is not None:
                self._by_namespace[new.namespace][kind][object_id] = new
            if kind == "GPU" and stamp_only(old, new):
                continue  # the slice holds the device without its stamp: it is the same
            for record in (old, new):
                if record is not None:
                    self._slices.pop(record.namespace, None)

    def _changed(self, kind: str, keys: Iterable[SetKey] = ()) -> None:
        super()._changed(kind, keys)
        if kind in ("Node", "GPUClass"):
            self._slices.clear()  # every slice holds the classes and its devices' nodes

    # -- freshness --------------------------------------------------------------------------------

    def current(self) -> None:
        """Return once a follow that began after this call arrived has finished (single flight).

        Raises what that follow raised when this call ran it itself (a database error);
        a follow another call ran and that failed proves nothing, so this call then runs
        its own.
        """
        self._flight.run(lambda: self._follow_now)

    def _follow_now(self) -> None:
        with self.lock:
            try:
                if not self.valid:
                    self._register()
                self.follow()
            except BaseException:
                self.counters.failures += 1
                log.warning("read model %s: a follow failed; it is read again on next use", self.worker, exc_info=True)
                self.invalidate("a follow of the change feed failed part way")
                raise
            self.counters.follows += 1
            self.built.set()
            now = time.monotonic()
            if now - self._reader_written >= min(READER_EVERY_SECONDS, _retention() / 4):
                self._record_reader()
                self._reader_written = now
        self._maybe_verify()

    def _register(self) -> None:
        """Before a build: hold every entry (position 0) until the build's own position
        and horizon are recorded, right after it. The recorded pair must come from one
        read of the feed: a late commit below it is kept only because its transaction is
        in that read's horizon."""
        self._write_reader(0, ())
        self._reader_written = -math.inf

    def _record_reader(self) -> None:
        self._write_reader(self.position, self.horizon)

    def _write_reader(self, position: int, horizon: Iterable[int]) -> None:
        values = {"position": position, "horizon": list(horizon), "token": "read-model"}
        if not models.FeedReader.objects.filter(worker=self.worker).update(**values, updated=Now()):
            models.FeedReader.objects.create(worker=self.worker, **values)

    # -- verification ----------------------------------------------------------------------------

    def _maybe_verify(self) -> None:
        every = django_settings.GPUPLANE_VERIFY_SECONDS
        if time.monotonic() - self.verified_at < every:
            return
        if self._verifier is not None and self._verifier.is_alive():
            return
        self.verified_at = time.monotonic()  # one verification at a time, then every ``every``
        self._verifier = threading.Thread(target=self._verify_in_thread, name="gpuplane-readmodel-verify", daemon=True)
        self._verifier.start()

    def _verify_in_thread(self) -> None:
        try:
            self.verify()
        except Exception:
            log.exception("read model verification of %s failed", self.worker)
        finally:
            connection.close()

    def verify(self) -> list[str]:
        """Read everything again into a fresh model, compare, log and count, and continue from it.

        The fresh model is read without the lock (seconds at 100k devices), then both are
        brought to the feed's present under the lock. A row written between the two
        follows' reads can make them differ for a moment, so differences are checked
        again after one more follow of both: what remains is a real difference.
        """
        fresh = ReadModel(f"{self.worker}:verify")
        fresh.rebuild("verification")
        with self.lock:
            self.follow()
            fresh.follow()
            problems = compare_records(self, fresh)
            if problems:
                self.follow()
                fresh.follow()
                problems = compare_records(self, fresh)
            for problem in problems:
                log.error("read model verification: %s", problem)
            if problems:
                log.error("read model verification found %d differences; continuing from the fresh read", len(problems))
            self.counters.verifications += 1
            self.counters.mismatches += len(problems)
            self.adopt(fresh)
        return problems

    def adopt(self, other: MirrorState) -> None:
        super().adopt(other)
        self.verified_at = time.monotonic()
        self.generation += 1
        _settle_garbage_collector()

    # -- what the web reads -----------------------------------------------------------------------

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Hold the model's lock over a model that is built.

        Called after :meth:`current`: a follow another call ran since may have failed
        and dropped the model, and an empty model must never answer; it is then brought
        current again (rebuilt) first. The result is at least as fresh as the caller's
        own :meth:`current`."""
        while True:
            self.lock.acquire()
            if self.valid:
                break
            self.lock.release()
            self.current()
        try:
            yield
        finally:
            self.lock.release()

    def slice(self, namespace: str) -> Slice:
        """The records of ``namespace`` (call :meth:`current` first).

        A slice already made is returned without the lock: a follow holds the lock while it
        reads rows from the database, and every call deciding meanwhile would wait for it.
        A kept slice is at least as fresh as the caller's own follow: that follow dropped
        every slice whose records it changed before it finished (a change of the admission
        stamp alone changes no slice: :func:`unstamped`), and a follow running now
        (which may not have dropped it yet) began after it. Slices are immutable; reading
        one dict entry is atomic."""
        found = self._slices.get(namespace) if self.valid else None
        if found is not None:
            return found
        with self.reading():
            found = self._slices.get(namespace)
            if found is not None:
                return found
            by_kind = self._by_namespace.get(namespace) or {}
            devices = tuple(sorted(map(unstamped, by_kind.get("GPU", {}).values()), key=lambda d: d.name))
            nodes_by_name, _ = self.node_cache.index(self._tuple("Node"))
            on = sorted({d.node for d in devices if d.node})
            found = Slice(
                namespace=namespace,
                devices=devices,
                budgets=tuple(by_kind.get("GPUBudget", {}).values()),
                pods=tuple(by_kind.get("Pod", {}).values()),
                vmis=tuple(by_kind.get("VirtualMachineInstance", {}).values()),
                classes=self._tuple("GPUClass"),
                nodes=tuple(nodes_by_name[n] for n in on if n in nodes_by_name),
            )
            self._slices[namespace] = found
            return found

    def nodes(self, names: Iterable[str]) -> tuple[Node, ...]:
        """The model's nodes of ``names`` (missing ones left out).

        Without the lock when the model's node index is built (as :meth:`slice` reads a kept
        slice: each node record is immutable, and the index only moves forward)."""
        kept = self.node_cache.nodes if self.valid else None
        if kept is not None:
            return tuple(kept[n] for n in sorted(set(names)) if n in kept)
        with self.reading():
            by_name, _ = self.node_cache.index(self._tuple("Node"))
            return tuple(by_name[n] for n in sorted(set(names)) if n in by_name)

    def snapshot(self, now: datetime, options: e.Settings | None = None) -> Snapshot:
        """The whole model as one engine snapshot, the device ids and a ledger of its own
        (safe to keep and read without the lock: later follows move none of them).

        The ledger is a copy of the one the model keeps current (linear in nodes and sets,
        where building one reads every device: 1.6 s at 100k). When the model has none
        (a node, class, pod or VMI changed since) it is built from the snapshot outside
        the lock, so calls deciding meanwhile do not wait, and kept by the model if
        nothing changed in between.
        """
        with self.reading():
            cluster = self.cluster(now, options or engine_settings())
            ids = dict(self.device_ids)
            generation = self.generation
            ledger = self._ledger.copy() if self._ledger is not None else None
        if ledger is None:
            ledger = ledger_for(cluster)
            with self.lock:
                if self.valid and self._ledger is None and self.generation == generation:
                    self._ledger = ledger.copy()
        return Snapshot(cluster, ids, ledger, generation)


@dataclasses.dataclass(frozen=True, slots=True)
class Snapshot:
    """The model at one moment, as the engine reads it."""

    cluster: e.Cluster
    ids: dict[tuple[str, str], int]
    """(namespace, name) of each device -> its row id."""
    ledger: Ledger
    generation: int


_FIELDS = tuple(f.name for f in dataclasses.fields(e.Device))
_STAMP_AT = _FIELDS.index("admitted")
#: Every field of a device record but the admission stamp, in order, read at once (in C): a
#: follow compares each device it re-reads this way (after Bound admissions most of them are
#: stamps), 1 µs a pair, and :func:`unstamped` copies a record in 2; ``dataclasses.replace``
#: took 13 µs a record.
_BUT_STAMP = operator.attrgetter(*_FIELDS[:_STAMP_AT], *_FIELDS[_STAMP_AT + 1 :])


def unstamped(device: e.Device) -> e.Device:
    """``device`` as a slice holds it: without the admission stamp (``admitted``), which only
    the binder reads, so that a stamp-only change leaves the slice exact."""
    if device.admitted is None:
        return device
    values: tuple[Any, ...] = _BUT_STAMP(device)
    fields = (*values[:_STAMP_AT], None, *values[_STAMP_AT:])
    return e.Device(*fields)


def stamp_only(old: e.Device | None, new: e.Device | None) -> bool:
    """Whether ``old`` became ``new`` by a change of the admission stamp alone."""
    return old is not None and new is not None and old.admitted != new.admitted and _BUT_STAMP(old) == _BUT_STAMP(new)


def _settle_garbage_collector() -> None:
    """Collect once, then exempt every object alive now (the model's records among them)
    from Python's cyclic garbage collector.

    The model is hundreds of thousands of long-lived objects. Left to the collector, each
    full collection walks all of them: 130 ms at 100k devices, with every thread of the
    process stopped, whenever the objects that survived since the last one reach a quarter
    of them (a few thousand calls' cached slices). Frozen, they are still freed by
    reference counting when the model lets go of them; only cycles among them would stay,
    and records hold none.
    """
    gc.collect()
    gc.freeze()


def _retention() -> float:
    return float(django_settings.GPUPLANE_FEED_RETENTION_SECONDS)


#: This process's model.
MODEL = ReadModel()


def read_model() -> ReadModel:
    """This process's model, current: every change committed before the call is in it."""
    MODEL.current()
    return MODEL


def build_in_background() -> threading.Thread:
    """Build the model now, in a thread, so the first calls find it ready (``/readyz``)."""

    def build() -> None:
        try:
            MODEL.current()
            log.info(
                "read model built: %d devices, %d nodes in %.2f s",
                len(MODEL.records["GPU"]),
                len(MODEL.records["Node"]),
                MODEL.counters.build_seconds,
            )
        except Exception:
            log.exception("read model: building at start failed; the first call builds it")
        finally:
            connection.close()

    thread = threading.Thread(target=build, name="gpuplane-readmodel-build", daemon=True)
    thread.start()
    return thread
