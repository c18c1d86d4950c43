"""The worker's cluster, kept in memory between passes and brought current from the change feed.

SPEC §4 (Freshness): a pass must decide from a view holding every change committed before
it took the cluster-wide turn, but it need not re-read the whole mirror to get there. This
module keeps the engine records of every mirrored row (by kind and row id), the device
ids the pass writes by, and the engine's :class:`~binder.engine.Ledger`, and at the start
of each pass, inside the pass lock, applies only the feed entries (``binder_change``,
written by triggers in the writers' own transactions) it has not seen, re-reading just
those rows. Re-reading the *current* row makes applying an entry idempotent and order-free:
an entry applied twice, or late, leaves the same record.

**Which entries a reader must (re-)read.** Positions come from a sequence when the writer
inserts, not when it commits, so a reader that saw position P may later see a smaller
position commit. The rule (PostgreSQL): a read takes, in the same statement (one
snapshot), the highest position ``P`` and the snapshot's in-progress transaction ids
``XIP`` (``pg_snapshot_xip``). Any transaction that can still commit a position below
``P`` held its transaction id before ``P`` was taken (it wrote its mirrored row, then the
trigger took the position) and had not committed when the reader's snapshot was taken
(else its entry would have been visible), so its id is in ``XIP``. The next read
therefore asks for ``position > P OR xid IN XIP``: it catches every late commit and
re-reads nothing else; nothing older can appear. (A transaction that had no id yet at
the read takes positions above ``P``.) SQLite runs one writer at a time, so positions commit in order
and ``position > P`` suffices. ``tests/test_feed.py`` proves the late commit with two
connections.

**When the state is thrown away and everything read again** (``rebuild``): a new process
(nothing in memory); the feed was truncated (a ``T`` entry) or went backwards (its highest
position is below ours); a namespace was renamed; the previous pass in this process
failed or rolled back; or this worker's row in ``FeedReader`` is gone or not at its
position (it was not seen for ``GPUPLANE_FEED_RETENTION_SECONDS``, so pruning stopped
keeping its entries).

**Workers taking turns** (two binder replicas on one queue) follow each other's passes
through the feed like any other writer's changes: a pass's writes leave entries like
everyone's. That needs pruning never to delete an entry a live worker has not applied,
so each worker records its position and horizon (``FeedReader``) in its pass and a pass
prunes only below the lowest live position, keeping every live horizon's transactions.

The engine stays pure: this module hands it an ordinary :class:`~binder.engine.Cluster`
(and, for an answer pass, just the requested sets plus the ledger of everything).
"""

from __future__ import annotations

import bisect
import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings as django_settings
from django.db import connection
from django.db.models.functions import Now

from binder import models
from binder.engine import Ledger, PassResult, build_ledger
from binder.engine import types as e
from binder.engine.placement import NodeCache, is_settled
from binder.engine.usage import Subjects
from binder.mirror.read import KINDS, read_rows

log = logging.getLogger(__name__)

SetKey = tuple[str, str]
#: The class status and budget usage a committed full pass wrote (see ``passes.write_result``).
StatusWritten = tuple[dict[str, e.ClassStatus], dict[tuple[str, str], Any]]
#: The engine kinds, in the order a rebuild reads them.
ENGINE_KINDS = ("GPUClass", "Node", "GPU", "GPUBudget", "VirtualMachineInstance", "Pod")
_CHUNK = 5000


@dataclass(frozen=True, slots=True)
class OwnWrites:
    """The feed entries a pass's own status writes produced: this worker's state already
    holds what they would re-read (see :meth:`ClusterState.passed`), so the next catch-up
    skips them instead of re-reading every row the pass wrote (26k after 10k new orders)."""

    xid: int | None
    """The pass's transaction id (PostgreSQL); None on SQLite, which runs one writer at a time."""
    after: int
    upto: int
    """The entries are those of ``xid`` at positions in (after, upto]: nothing else of the
    pass's transaction is written between the two reads (:func:`own_feed_position`)."""

    def covers(self, position: int, xid: int | None) -> bool:
        return self.after < position <= self.upto and xid == self.xid


def own_feed_position() -> tuple[int | None, int]:
    """(This transaction's id on PostgreSQL, the highest feed position it has written.)

    On SQLite the writer holds the database's write lock from its first write (the pass
    has written its PassRun by then), so every position taken meanwhile is its own.
    """
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT x.id, coalesce((SELECT max(position) FROM binder_change WHERE xid = x.id), 0)"
                " FROM (SELECT pg_current_xact_id()::text::bigint AS id) AS x"
            )
            xid, top = cursor.fetchone()
            return int(xid), int(top)
        cursor.execute("SELECT coalesce(max(position), 0) FROM binder_change")
        return None, int(cursor.fetchone()[0])


@dataclass(frozen=True, slots=True)
class FeedRead:
    """One read of the change feed."""

    top: int
    top_mark: str
    mark: str
    """The token of the entry at the reader's position ("" when there is none)."""
    xip: tuple[int, ...]
    entries: list[tuple[int, str, int | None, str]]


@dataclass(slots=True)
class Catchup:
    """What bringing the state current found."""

    view: str
    """``rebuilt`` (everything read again) or ``incremental`` (feed entries applied)."""
    reason: str = ""
    """Why the state was rebuilt."""
    rows_read: int = 0
    entries: int = 0
    changed: dict[str, set[SetKey]] = field(default_factory=lambda: defaultdict(set))
    """kind -> (namespace, name) of records that differ from the state before (deleted ones too)."""
    dirty_sets: set[SetKey] = field(default_factory=set)
    """Sets whose members, pods or VMI changed."""
    since_rebuild: bool = False
    """An answer pass since the last full pass rebuilt the state: reconcile all usage."""

    @property
    def nothing_changed(self) -> bool:
        return self.view == "incremental" and not self.since_rebuild and not any(self.changed.values())

    def absorb(self, other: Catchup) -> None:
        """Add what ``other`` (an earlier answer pass's catch-up) found: full passes act on it."""
        for kind, keys in other.changed.items():
            self.changed[kind] |= keys
        self.dirty_sets |= other.dirty_sets
        self.since_rebuild = self.since_rebuild or other.since_rebuild or other.view != "incremental"


class ClusterState:
    """One worker's view of the mirror: engine records, the device ids, the ledger, the feed cursor."""

    def __init__(self) -> None:
        self.worker = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self.lock = threading.RLock()
        self._reset("new process")

    def _reset(self, why: str) -> None:
        self.valid = False
        self.why_invalid = why
        #: When this state was last read from scratch (verification counts from it).
        self.verified_at = time.monotonic()
        self.records: dict[str, dict[int, Any]] = {kind: {} for kind in ENGINE_KINDS}
        self.namespaces: dict[int, str] = {}
        self.device_ids: dict[SetKey, int] = {}
        self.members: dict[SetKey, dict[str, e.Device]] = defaultdict(dict)
        self.wanting: set[SetKey] = set()
        self.position = 0
        #: PostgreSQL: the transactions in progress at the last feed read (see the module doc).
        self.horizon: tuple[int, ...] = ()
        #: The random token of the feed entry at ``position``: a reset feed has another there (or none).
        self.mark = ""
        #: The position of that entry: ``position``, or an anchor above it (see :meth:`_anchor`).
        self.mark_at = 0
        #: The token this worker's last pass recorded in its ``FeedReader`` row.
        self.reader_token = ""
        #: Feed entries below this position were deleted by :meth:`prune`.
        self.pruned = 0
        self._tuples: dict[str, tuple[Any, ...]] = {}
        self._ledger: Ledger | None = None
        self._deadlines: list[datetime] | None = None
        #: What the engine derives from nodes and classes, kept while none of them changes.
        self.node_cache = NodeCache()
        #: Sets a full pass may act on (not ``is_settled``); None: to be worked out again
        #: for every set (after a node or class changed).
        self._unsettled: set[SetKey] | None = None
        #: The classes by name (settledness reads them; the nodes by name are the node cache's).
        self._classes: dict[str, e.GpuClass] | None = None
        #: What answer passes found and wrote since the last full pass.
        self.pending = Catchup(view="incremental")
        #: What the last full pass computed, for the "nothing changed" rule.
        self.last_full: tuple[datetime, e.Settings, PassResult] | None = None
        #: The class and budget status as this state's last full pass wrote it.
        self.status_written: StatusWritten | None = None
        #: The feed entries of the last pass's own writes, skipped by the next catch-up.
        self.own_writes: OwnWrites | None = None

    def invalidate(self, why: str) -> None:
        """Forget everything: the next pass reads the whole mirror again."""
        if self.valid:
            log.info("cluster state of %s dropped: %s", self.worker, why)
        self._reset(why)

    # -- bringing the state current (inside the pass's transaction and lock) -------------

    def catch_up(self, kind: str = models.PassKind.FULL) -> Catchup:
        """Apply the feed entries not yet seen, or rebuild when the state cannot be proven current.

        Answer passes neither write usage records nor run the full rules, so what their
        catch-ups found (and what they wrote) is kept for the next full pass.
        """
        catch = self._catch_up()
        self.record_reader()
        if kind == models.PassKind.FULL:
            if catch.view == "incremental":
                catch.absorb(self.pending)
            self.pending = Catchup(view="incremental")
        else:
            self.pending.absorb(catch)
        return catch

    def _catch_up(self) -> Catchup:
        reason = self._not_provable()
        if reason:
            return self.rebuild(reason)
        feed = self._read_feed(self.position, self.horizon, self.mark_at, self.own_writes)
        self.own_writes = None
        top, entries = feed.top, feed.entries
        if top < self.position:
            return self.rebuild(f"the change feed went backwards (position {top} < {self.position})")
        if feed.mark != self.mark:
            # The entry at our mark is gone or another: the feed was reset (its sequence
            # restarted) or pruned past us, so entries we never saw may be missing.
            return self.rebuild(f"the change feed's entry at position {self.mark_at} is gone or changed")
        if any(op == models.ChangeOp.TRUNCATE for _, _, _, op in entries):
            return self.rebuild("a mirrored table or the change feed was truncated")
        catch = Catchup(view="incremental", entries=len(entries))
        by_kind: dict[str, set[int]] = defaultdict(set)
        for _, kind, object_id, _ in entries:
            if object_id is not None:
                by_kind[kind].add(object_id)
        if by_kind.get("Namespace") and not self._apply_namespaces(by_kind.pop("Namespace"), catch):
            return self.rebuild("a namespace was renamed")
        for kind in ENGINE_KINDS:
            if by_kind.get(kind):
                self._apply(kind, by_kind[kind], catch)
        self.position, self.horizon = top, feed.xip
        self._remember_mark(feed)
        return catch

    def _not_provable(self) -> str:
        if not self.valid:
            return self.why_invalid
        recorded = models.FeedReader.objects.filter(worker=self.worker).values_list("position", "token").first()
        if recorded is None:
            return (
                "this worker's place in the change feed is no longer recorded (not seen for "
                "GPUPLANE_FEED_RETENTION_SECONDS): entries it needs may have been pruned"
            )
        if recorded != (self.position, self.reader_token):
            return "this worker's last pass is not the one recorded (it was rolled back)"
        return ""

    def record_reader(self) -> None:
        """Record this worker's feed position and horizon (in the pass's transaction), so
        no other worker's pruning deletes an entry it has not applied (``FeedReader``),
        with a new token: a pass rolled back after it committed in memory leaves the
        previous token, and the next catch-up rebuilds."""
        self.reader_token = uuid.uuid4().hex
        values = {"position": self.position, "horizon": list(self.horizon), "token": self.reader_token}
        if not models.FeedReader.objects.filter(worker=self.worker).update(**values, updated=Now()):
            models.FeedReader.objects.create(worker=self.worker, **values)

    def rebuild(self, reason: str) -> Catchup:
        """Read the whole mirror again (the feed cursor first, then the rows: see the module doc)."""
        self._reset(reason)
        feed = self._read_feed(None, (), 0)
        catch = Catchup(view="rebuilt", reason=reason)
        self.namespaces = dict(models.Namespace.objects.values_list("id", "name"))
        catch.rows_read += len(self.namespaces)
        for kind in ENGINE_KINDS:
            ids: dict[SetKey, int] = {}
            rows = read_rows(kind, ids=ids)
            catch.rows_read += len(rows)
            table = self.records[kind]
            for record in rows:
                table[ids[_key(record)]] = record
            if kind == "GPU":
                self.device_ids = ids
                for record in rows:
                    self._index_device(record, +1)
                self._sets_changed(list(self.members))
        self.position, self.horizon = feed.top, feed.xip
        self._remember_mark(feed)
        self.valid = True
        self.why_invalid = ""
        log.info("cluster state of %s rebuilt (%s): %d rows", self.worker, reason, catch.rows_read)
        return catch

    def _remember_mark(self, feed: FeedRead) -> None:
        """Keep the token of the newest entry; on an empty feed write an anchor entry to keep.

        Without an entry to check, a feed emptied and refilled below our position (or
        emptied of entries we never read) would look unchanged. The anchor's position may be
        above entries we have not read yet, so it is only the mark: reading goes on from
        ``position``.
        """
        if feed.top:
            self.mark, self.mark_at = feed.top_mark, feed.top
            return
        anchor = models.Change.objects.create(
            kind="*", op=models.ChangeOp.ANCHOR, name=self.worker[:253], token=uuid.uuid4().hex
        )
        self.mark, self.mark_at = anchor.token, anchor.position

    def _read_feed(
        self, position: int | None, horizon: tuple[int, ...], mark_at: int, skip: OwnWrites | None = None
    ) -> FeedRead:
        """The feed's top, the entries to apply (less ``skip``) and, on PostgreSQL, the
        transactions in progress: one statement, so one snapshot."""
        at = position if position is not None else -1
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                mark = "token"
                cursor.execute(
                    f"SELECT s.top, s.top_mark, s.mark, s.xip, c.position, c.kind, c.object_id, c.op, c.xid FROM"  # noqa: S608 - constant SQL
                    " (SELECT coalesce((SELECT max(position) FROM binder_change), 0) AS top,"
                    f" (SELECT {mark} FROM binder_change ORDER BY position DESC LIMIT 1) AS top_mark,"
                    f" (SELECT {mark} FROM binder_change WHERE position = %s) AS mark,"
                    " ARRAY(SELECT x::text::bigint FROM pg_snapshot_xip(pg_current_snapshot()) AS x) AS xip) AS s"
                    " LEFT JOIN binder_change AS c ON (c.position > %s OR c.xid = ANY(%s::bigint[])) AND %s"
                    " ORDER BY c.position",
                    [mark_at, at, list(horizon), position is not None],
                )
                rows = cursor.fetchall()
                first = rows[0]
                return FeedRead(
                    top=int(first[0]),
                    top_mark=first[1] or "",
                    mark=first[2] or "",
                    xip=tuple(int(x) for x in first[3]),
                    entries=[
                        (r[4], r[5], r[6], r[7])
                        for r in rows
                        if r[4] is not None and not (skip is not None and skip.covers(r[4], r[8]))
                    ],
                )
            mark = "token"
            cursor.execute(
                f"SELECT coalesce((SELECT max(position) FROM binder_change), 0),"  # noqa: S608 - constant SQL
                f" (SELECT {mark} FROM binder_change ORDER BY position DESC LIMIT 1),"
                f" (SELECT {mark} FROM binder_change WHERE position = %s)",
                [mark_at],
            )
            top, top_mark, found = cursor.fetchone()
            entries: list[tuple[int, str, int | None, str]] = []
            if position is not None:
                cursor.execute(
                    "SELECT position, kind, object_id, op FROM binder_change WHERE position > %s ORDER BY position",
                    [position],
                )
                entries = [tuple(r) for r in cursor.fetchall() if not (skip is not None and skip.covers(r[0], None))]
            return FeedRead(top=int(top), top_mark=top_mark or "", mark=found or "", xip=(), entries=entries)

    def _apply_namespaces(self, ids: set[int], catch: Catchup) -> bool:
        """New and deleted namespaces; False when one was renamed (its rows' keys all change)."""
        current = dict(models.Namespace.objects.filter(id__in=ids).values_list("id", "name"))
        catch.rows_read += len(current)
        for ns_id in ids:
            old, new = self.namespaces.get(ns_id), current.get(ns_id)
            if old is not None and new is not None and old != new:
                return False
            if new is None:
                self.namespaces.pop(ns_id, None)
            else:
                self.namespaces[ns_id] = new
        return True

    def _apply(self, kind: str, ids: set[int], catch: Catchup) -> None:
        """Re-read the rows ``ids`` of ``kind`` and replace (or drop) their records."""
        model, convert, fields = KINDS[kind]
        namespaced = hasattr(model, "NAMESPACE_LOOKUP")
        columns = ("id", "name", *(("namespace_id",) if namespaced else ()), *fields)
        width = 3 if namespaced else 2
        found: dict[int, Any] = {}
        ordered = sorted(ids)
        for i in range(0, len(ordered), _CHUNK):
            for row in model.objects.filter(id__in=ordered[i : i + _CHUNK]).order_by().values_list(*columns):
                namespace = self.namespaces.get(row[2], "") if namespaced else ""
                found[row[0]] = convert(namespace, row[1], *row[width:])
        catch.rows_read += len(found)
        table = self.records[kind]
        changed = False
        sets: set[SetKey] = set()
        for object_id in ordered:
            old, new = table.get(object_id), found.get(object_id)
            if old == new:
                continue
            changed = True
            for record in (old, new):
                if record is not None:
                    catch.changed[kind].add(_key(record))
                    catch.dirty_sets.update(_sets_of(kind, record))
            if new is None:
                del table[object_id]
            else:
                table[object_id] = new
            if kind == "GPU":
                self._replace_device(object_id, old, new)
                sets.update(d.set_key for d in (old, new) if d is not None)
        if sets:
            self._sets_changed(sorted(sets))
        if changed:
            self._changed(kind)

    def _changed(self, kind: str) -> None:
        """Drop what a change of ``kind`` makes stale (each is rebuilt from memory when next needed)."""
        self._tuples.pop(kind, None)
        if kind == "Node":
            self._deadlines = None
        if kind in ("GPUClass", "GPUBudget"):
            self.status_written = None  # a recreated row starts from the model's default
        if kind in ("Node", "GPUClass"):
            self.node_cache = NodeCache()
            self._unsettled = None
            self._classes = None
        if kind not in ("GPU", "GPUBudget"):
            self._ledger = None  # nodes, classes, pods, VMIs: the ledger is built again

    def _replace_device(self, object_id: int, old: e.Device | None, new: e.Device | None) -> None:
        """Swap one device's record in the indexes; the caller then calls :meth:`_sets_changed`
        once for the sets touched (a pass binding 10k sets writes 26k devices)."""
        if old is not None:
            if self.device_ids.get(old.key) == object_id:
                del self.device_ids[old.key]
            self._index_device(old, -1)
        if new is not None:
            self.device_ids[new.key] = object_id
            self._index_device(new, +1)

    def _index_device(self, device: e.Device, sign: int) -> None:
        key = device.set_key
        members = self.members[key]
        if sign > 0:
            members[device.name] = device
        elif members.get(device.name) == device:
            del members[device.name]
        if not members:
            self.members.pop(key, None)

    def _sets_changed(self, keys: Iterable[SetKey], *, ledger: bool = True) -> None:
        """Bring what is kept per set current for ``keys``: who waits for an answer, who is
        settled, and (``ledger``, unless the engine already moved them there) the ledger."""
        for key in keys:
            members = self.members.get(key, {})
            if any(d.wants_answer for d in members.values()):
                self.wanting.add(key)
            else:
                self.wanting.discard(key)
            if self._unsettled is not None:
                if self._settled(key):
                    self._unsettled.discard(key)
                else:
                    self._unsettled.add(key)
            if ledger and self._ledger is not None:
                self._ledger.commit(key, self.set_members(key))

    def _settled(self, key: SetKey) -> bool:
        if self._classes is None:
            self._classes = {c.name: c for c in self.records["GPUClass"].values()}
        nodes, _ = self.node_cache.index(self._tuple("Node"))
        return is_settled(self.set_members(key), nodes, self._classes)

    def scope(self, catch: Catchup) -> set[SetKey]:
        """The sets a full pass must visit: every set that is not settled, plus what changed.

        Kept set by set as devices change; worked out again for every set only after a
        node or a class changed (settledness reads nothing else).
        """
        if self._unsettled is None:
            self._unsettled = {key for key in self.members if not self._settled(key)}
        return self._unsettled | (catch.dirty_sets & self.members.keys())

    # -- what the engine reads -------------------------------------------------------------

    def set_members(self, key: SetKey) -> tuple[e.Device, ...]:
        """A set's devices in key order (as ``build_ledger`` stores them)."""
        return tuple(sorted(self.members.get(key, {}).values(), key=lambda d: d.key))

    def _tuple(self, kind: str) -> tuple[Any, ...]:
        cached = self._tuples.get(kind)
        if cached is None:
            cached = self._tuples[kind] = tuple(self.records[kind].values())
        return cached

    def cluster(self, now: datetime, settings: e.Settings) -> e.Cluster:
        """The whole state as one engine snapshot (no database read)."""
        return e.Cluster(
            now=now,
            classes=self._tuple("GPUClass"),
            nodes=self._tuple("Node"),
            devices=self._tuple("GPU"),
            budgets=self._tuple("GPUBudget"),
            vmis=self._tuple("VirtualMachineInstance"),
            pods=self._tuple("Pod"),
            settings=settings,
        )

    def requested(self, now: datetime, settings: e.Settings) -> e.Cluster:
        """What an answer pass reads (SPEC §4): the requested sets whole, their tenants'
        budgets, every node and class; booked units and usage come from :meth:`ledger`."""
        keys = sorted(self.wanting)
        namespaces = {ns for ns, _ in keys}
        return e.Cluster(
            now=now,
            classes=self._tuple("GPUClass"),
            nodes=self._tuple("Node"),
            devices=tuple(d for key in keys for d in self.set_members(key)),
            budgets=tuple(b for b in self._tuple("GPUBudget") if b.namespace in namespaces),
            settings=settings,
        )

    def ledger(self) -> Ledger:
        """The ledger of the whole state, built from memory when a node, class, pod or VMI
        changed, else kept current set by set. A pass that uses it changes it in place:
        after commit that is the new state; after a failure the state is dropped."""
        if self._ledger is None:
            self._ledger = build_ledger(
                classes=self._tuple("GPUClass"),
                nodes=self._tuple("Node"),
                devices=self._tuple("GPU"),
                pods=self._tuple("Pod"),
                vmis=self._tuple("VirtualMachineInstance"),
            )
        return self._ledger

    def unchanged_since_last_full_pass(self, catch: Catchup, now: datetime, settings: e.Settings) -> PassResult | None:
        """The result of a full pass when it provably equals "change nothing", else None.

        The engine is a function of the records, the settings and the clock. If the last
        full pass changed no device (so its input is still the state), nothing changed
        since, the settings are the same and no NotReady node crossed its grace deadline
        between the two clocks (the only rule that reads the clock, from an index of
        deadlines), the engine would decide exactly nothing again: no sweep needed.
        """
        if self.last_full is None or not catch.nothing_changed:
            return None
        then, then_settings, result = self.last_full
        if result.devices or result.answered or then_settings != settings or now < then:
            return None
        deadlines = self.deadlines(settings.node_grace_seconds)
        i = bisect.bisect_left(deadlines, then)
        if i < len(deadlines) and deadlines[i] < now:
            return None
        counts = {o.value: 0 for o in e.Outcome}
        counts[e.Outcome.REFUSED.value] = result.counts.get(e.Outcome.REFUSED.value, 0)
        return PassResult(devices=(), changes=(), counts=counts)

    def deadlines(self, grace_seconds: int) -> list[datetime]:
        """When each NotReady node passes its grace period, sorted (rebuilt when a node changes)."""
        if self._deadlines is None:
            grace = timedelta(seconds=grace_seconds)
            self._deadlines = sorted(
                n.ready_since + grace for n in self.records["Node"].values() if not n.ready and n.ready_since
            )
        return self._deadlines

    def prune(self) -> int:
        """Delete the feed entries every live worker has applied (in the pass's transaction).

        Readers not seen for ``GPUPLANE_FEED_RETENTION_SECONDS`` are forgotten (they read
        everything again when they return). Kept: entries at or above the lowest position
        of the others (each one's mark among them: a mark is at or above its position) and
        those of transactions in any reader's horizon (they may still commit below it, see
        the module doc), so a worker that follows another's passes through the feed loses
        nothing it needs.
        """
        retention = timedelta(seconds=django_settings.GPUPLANE_FEED_RETENTION_SECONDS)
        models.FeedReader.objects.filter(updated__lt=Now() - retention).exclude(worker=self.worker).delete()
        readers = list(models.FeedReader.objects.values_list("position", "horizon"))
        floor = min([self.position, *(position for position, _ in readers)])
        if floor <= self.pruned:
            return 0
        keep = sorted({*self.horizon, *(int(x) for _, horizon in readers for x in horizon)})
        deleted, _ = (
            models.Change.objects.filter(position__lt=floor).exclude(xid__in=keep).delete()
        )
        self.pruned = floor
        return deleted

    # -- after the pass ----------------------------------------------------------------------

    def passed(
        self,
        run: models.PassRun,
        kind: str,
        now: datetime,
        settings: e.Settings,
        result: PassResult,
        ledger_used: bool,
        own_writes: OwnWrites | None = None,
    ) -> None:
        """The pass committed: its own writes become part of the state (so the next
        catch-up may skip their feed entries, ``own_writes``)."""
        self.own_writes = own_writes
        # When the engine ran on this state's ledger it already moved the sets there;
        # otherwise the ledger (if built) is moved set by set.
        sets: set[SetKey] = set()
        for device in result.devices:
            object_id = self.device_ids.get(device.key)
            if object_id is None:
                continue
            old = self.records["GPU"].get(object_id)
            self.records["GPU"][object_id] = device
            self._replace_device(object_id, old, device)
            sets.add(device.set_key)
        self._sets_changed(sorted(sets), ledger=not ledger_used)
        if result.devices:
            self._tuples.pop("GPU", None)
        if kind == models.PassKind.FULL:
            self.last_full = (now, settings, result)
            classes, budgets = self.status_written or ({}, {})
            self.status_written = ({**classes, **result.class_status}, {**budgets, **result.budget_used})
        elif result.devices:
            self.last_full = None
            self.pending.changed["GPU"] |= {d.key for d in result.devices}
            self.pending.dirty_sets |= {d.set_key for d in result.devices}

    # -- cluster mode: status writes the API server refused -----------------------------------

    def refused_writes(self) -> None:
        """Some of the pass's status writes did not land (``binder.runtime.cluster``).

        The engine moved the ledger in place for every decision, landed or not, and the
        "nothing changed since a pass that changed nothing" rule would take the narrowed
        result for a quiet pass; both are dropped, so the next pass builds the ledger
        from the records again and runs the engine, retrying what did not land.
        """
        self._ledger = None
        self.last_full = None

    def adopt(self, other: ClusterState) -> None:
        """Continue from ``other`` (a verification's rebuilt state), keeping this worker's name."""
        for name in (
            "valid",
            "why_invalid",
            "records",
            "namespaces",
            "device_ids",
            "members",
            "wanting",
            "position",
            "horizon",
            "mark",
            "mark_at",
            "_tuples",
            "_ledger",
            "_deadlines",
            "node_cache",
            "_unsettled",
            "_classes",
        ):
            setattr(self, name, getattr(other, name))
        self.last_full = None
        self.status_written = None
        self.record_reader()

    def usage_subjects(self, catch: Catchup, result: PassResult) -> Subjects:
        """The usage-record subjects this pass must reconcile (SPEC §7), before :meth:`passed`:
        devices the pass wrote or the feed changed, pods the feed changed, and the pods of
        every set whose devices or VMI changed (a launcher's raw usage is its requests minus
        what its set holds). A rebuilt state, or a class change, reconciles everything."""
        if catch.view != "incremental" or catch.since_rebuild or catch.changed.get("GPUClass"):
            return Subjects(everything=True)
        written = {d.key: d for d in result.devices}
        device_keys = set(catch.changed.get("GPU", ())) | set(written)
        sets = set(catch.dirty_sets) | {d.set_key for d in result.devices}
        pod_keys = set(catch.changed.get("Pod", ()))
        if sets:
            pod_keys |= {(p.namespace, p.name) for p in self._tuple("Pod") if (p.namespace, p.owner_vmi) in sets}
        if not device_keys and not pod_keys:
            return Subjects()
        devices = []
        for key in sorted(device_keys):
            device = written.get(key)
            if device is None and key in self.device_ids:
                device = self.records["GPU"].get(self.device_ids[key])
            if device is not None:
                devices.append(device)
        pods = tuple(p for p in self._tuple("Pod") if (p.namespace, p.name) in pod_keys)
        owners = {(p.namespace, p.owner_vmi) for p in pods if p.owner_vmi}
        set_devices = tuple(written.get(d.key, d) for key in sorted(owners) for d in self.set_members(key))
        return Subjects(
            device_keys=frozenset(device_keys),
            pod_keys=frozenset(pod_keys),
            devices=tuple(devices),
            pods=pods,
            set_devices=set_devices,
        )


def _key(record: Any) -> SetKey:
    """(namespace, name) of any engine record; nodes and classes have no namespace."""
    return (getattr(record, "namespace", ""), record.name)


def _sets_of(kind: str, record: Any) -> Iterable[SetKey]:
    if kind == "GPU":
        return (record.set_key,)
    if kind == "VirtualMachineInstance":
        return ((record.namespace, record.name),)
    if kind == "Pod" and record.owner_vmi:
        return ((record.namespace, record.owner_vmi),)
    return ()


def compare_records(mine: ClusterState, fresh: ClusterState) -> list[str]:
    """Every record that differs between two states, as ``kind ns/name: ours != fresh``."""
    out: list[str] = []
    for kind in ENGINE_KINDS:
        ours = {_key(r): r for r in mine.records[kind].values()}
        theirs = {_key(r): r for r in fresh.records[kind].values()}
        out.extend(
            f"{kind} {key[0]}/{key[1]}: state {ours.get(key)!r} != database {theirs.get(key)!r}"
            for key in sorted(set(ours) | set(theirs))
            if ours.get(key) != theirs.get(key)
        )
    return out


def compare_results(mine: PassResult, fresh: PassResult) -> list[str]:
    """Every difference between two pass results (devices, changes, answers, counts; class
    and budget status when both computed them)."""
    ours = {d.key: d for d in mine.devices}
    theirs = {d.key: d for d in fresh.devices}
    out = [
        f"device {key[0]}/{key[1]}: incremental {ours.get(key)!r} != from scratch {theirs.get(key)!r}"
        for key in sorted(set(ours) | set(theirs))
        if ours.get(key) != theirs.get(key)
    ]
    if Counter(mine.changes) != Counter(fresh.changes):
        out.append(f"decisions: incremental {mine.changes!r} != from scratch {fresh.changes!r}")
    if sorted(mine.answered) != sorted(fresh.answered):
        out.append(f"answers: incremental {mine.answered!r} != from scratch {fresh.answered!r}")
    if dict(mine.counts) != dict(fresh.counts):
        out.append(f"counts: incremental {dict(mine.counts)!r} != from scratch {dict(fresh.counts)!r}")
    for name in ("class_status", "budget_used"):
        a, b = getattr(mine, name), getattr(fresh, name)
        if a and b and dict(a) != dict(b):
            out.append(f"{name}: incremental {dict(a)!r} != from scratch {dict(b)!r}")
    return out


#: The state of this process's pass worker.
STATE = ClusterState()
