"""The mirror held in memory as engine records, brought current from the change feed.

The freshness rules of the binder and the webhook let a process keep the cluster in memory
between decisions when each decision first brings it up to date from a change feed that cannot miss a
change. :class:`MirrorState` is that copy, shared by the binder (``binder.runtime.state``
adds what a pass keeps) and the web processes' read model (``binder.runtime.readmodel``):
the engine records of every mirrored row by kind and row id, the device ids, the members
of each set, the :class:`~binder.engine.Ledger` of booked units, and the engine's
:class:`~binder.engine.fit.NodeCache`. :meth:`MirrorState.follow` applies only the
feed entries (``binder.runtime.feed``) not seen yet, re-reading just those rows.
Re-reading the *current* row makes applying an entry idempotent and order-free: an entry
applied twice, or late, leaves the same record.

When it cannot prove it is current (nothing in memory, a gap in the feed, a renamed
namespace) it reads everything again (:meth:`MirrorState.rebuild`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from binder import models
from binder.engine import Ledger
from binder.engine import types as e
from binder.engine.fit import NodeCache
from binder.kube import kinds as kube_kinds
from binder.mirror.read import KINDS, fetch_ids, read_rows
from binder.runtime.feed import FeedCursor, FeedGap, FeedRead, OwnWrites

log = logging.getLogger(__name__)

SetKey = tuple[str, str]
#: The engine kinds, in the order a rebuild reads them (``binder.kube.kinds``: all but namespaces).
ENGINE_KINDS = kube_kinds.ENGINE_KINDS


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
    vanished: set[str] = field(default_factory=set)
    """Kinds with entries for rows this state never held and the database no longer has:
    created and deleted between two catch-ups. Nothing of them is left to name, yet
    another worker's pass may have seen them meanwhile (and opened their usage records)."""
    reconcile_all: bool = False
    """Rows vanished while full passes this state did not run may have recorded usage
    for them (``binder.runtime.state.ClusterState.catch_up``): reconcile every open record."""

    @property
    def nothing_changed(self) -> bool:
        return self.view == "incremental" and not self.since_rebuild and not any(self.changed.values())

    def absorb(self, other: Catchup) -> None:
        """Add what ``other`` (an earlier answer pass's catch-up) found: full passes act on it."""
        for kind, keys in other.changed.items():
            self.changed[kind] |= keys
        self.dirty_sets |= other.dirty_sets
        self.vanished |= other.vanished
        self.since_rebuild = self.since_rebuild or other.since_rebuild or other.view == "rebuilt"


class MirrorState:
    """One process's copy of the mirror: engine records, device ids, set members, the ledger, the feed cursor."""

    def __init__(self, name: str) -> None:
        #: Who reads (the feed anchor entries carry it; the binder's FeedReader row is keyed by it).
        self.worker = name
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
        self.cursor = FeedCursor(anchor_name=self.worker)
        self._tuples: dict[str, tuple[Any, ...]] = {}
        self._ledger: Ledger | None = None
        #: Sorted set members while a catch-up brings sets current (see :meth:`set_members`).
        self._members_memo: dict[SetKey, tuple[e.Device, ...]] | None = None
        #: What the engine derives from nodes and classes, kept while none of them changes.
        self.node_cache = NodeCache()

    #: What a subclass keeps per state besides the records (copied by :meth:`adopt`).
    KEPT: tuple[str, ...] = ()

    def adopt(self, other: MirrorState) -> None:
        """Continue from ``other`` (a state just read from scratch: a verification's),
        keeping this reader's name and its pruning mark."""
        base = ("valid", "why_invalid", "records", "namespaces", "device_ids", "members", "_tuples", "_ledger")
        for name in (*base, "node_cache", *self.KEPT):
            setattr(self, name, getattr(other, name))
        self.cursor = dataclasses.replace(other.cursor, pruned=self.cursor.pruned, anchor_name=self.worker)

    # The cursor's fields, read by tests and the pass record.
    @property
    def position(self) -> int:
        return self.cursor.position

    @property
    def horizon(self) -> tuple[int, ...]:
        return self.cursor.horizon

    @property
    def mark(self) -> str:
        return self.cursor.mark

    @property
    def mark_at(self) -> int:
        return self.cursor.mark_at

    @property
    def pruned(self) -> int:
        return self.cursor.pruned

    def invalidate(self, why: str) -> None:
        """Forget everything: the next catch-up reads the whole mirror again."""
        if self.valid:
            log.info("mirror state of %s dropped: %s", self.worker, why)
        self._reset(why)

    # -- bringing the state current --------------------------------------------------------

    def follow(self, skip: OwnWrites | None = None) -> Catchup:
        """Apply the feed entries not yet seen (less ``skip``), or rebuild when the state
        cannot be proven current."""
        if not self.valid:
            return self.rebuild(self.why_invalid)
        try:
            feed = self.cursor.follow(skip)
        except FeedGap as gap:
            return self.rebuild(str(gap))
        catch = Catchup(view="incremental", entries=len(feed.entries))
        by_kind = feed.ids_by_kind()
        if by_kind.get("Namespace") and not self._apply_namespaces(by_kind.pop("Namespace"), catch):
            return self.rebuild("a namespace was renamed")
        for kind in ENGINE_KINDS:
            if by_kind.get(kind):
                self._apply(kind, by_kind[kind], catch)
        self.cursor.advance(feed)
        return catch

    def rebuild(self, reason: str) -> Catchup:
        """Read the whole mirror again (the feed's top first, then the rows: a change
        committed between the two is applied again by the next :meth:`follow`)."""
        self._reset(reason)
        feed = self.cursor.start()
        catch = Catchup(view="rebuilt", reason=reason)
        self.namespaces = dict(models.Namespace.objects.values_list("id", "name"))
        catch.rows_read += len(self.namespaces)
        for kind in ENGINE_KINDS:
            ids: dict[SetKey, int] = {}
            rows = read_rows(kind, ids=ids)
            catch.rows_read += len(rows)
            table = self.records[kind]
            for record in rows:
                table[ids[record_key(record)]] = record
            if kind == "GPU":
                self.device_ids = ids
                for record in rows:
                    self._index_device(record, +1)
                self._sets_changed(list(self.members))
        self._rebuilt(feed)
        log.info("mirror state of %s rebuilt (%s): %d rows", self.worker, reason, catch.rows_read)
        return catch

    def _rebuilt(self, feed: FeedRead) -> None:
        self.node_cache.prepare(self._tuple("Node"), self._tuple("GPUClass"))
        self.cursor.advance(feed)
        self.valid = True
        self.why_invalid = ""

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
        for row in fetch_ids(model, columns, ordered):
            namespace = self.namespaces.get(row[2], "") if namespaced else ""
            found[row[0]] = convert(namespace, row[1], *row[width:])
        catch.rows_read += len(found)
        table = self.records[kind]
        if kind == "GPU":
            self._apply_devices(ordered, found, catch)
            return
        changed = False
        sets: set[SetKey] = set()
        for object_id in ordered:
            old, new = table.get(object_id), found.get(object_id)
            if old == new:
                if old is None:
                    catch.vanished.add(kind)
                continue
            changed = True
            for record in (old, new):
                if record is not None:
                    catch.changed[kind].add(record_key(record))
                    catch.dirty_sets.update(sets_of(kind, record))
            if new is None:
                del table[object_id]
            else:
                table[object_id] = new
            self._replaced(kind, object_id, old, new, sets)
        if sets:
            self._bring_sets_current(sorted(sets))
        if changed:
            self._changed(kind, catch.changed[kind])

    def _apply_devices(self, ordered: list[int], found: dict[int, e.Device], catch: Catchup) -> None:
        """:meth:`_apply` for devices, the one kind read by the ten thousand (a pass after
        10k new orders re-reads 26k): the same bookkeeping with each record's keys taken
        once and no per-record dispatch, about half the time of the generic loop."""
        table = self.records["GPU"]
        changed_keys = catch.changed["GPU"]
        dirty = catch.dirty_sets
        device_ids = self.device_ids
        members = self.members
        sets: set[SetKey] = set()
        for object_id in ordered:
            old, new = table.get(object_id), found.get(object_id)
            if old == new:
                if old is None:
                    catch.vanished.add("GPU")
                continue
            if old is not None:
                key, set_key = (old.namespace, old.name), (old.namespace, old.vm_name)
                changed_keys.add(key)
                sets.add(set_key)
                if device_ids.get(key) == object_id:
                    del device_ids[key]
                held = members.get(set_key)
                if held is not None:
                    if held.get(old.name) == old:
                        del held[old.name]
                    if not held:
                        del members[set_key]
            if new is None:
                del table[object_id]
                continue
            key, set_key = (new.namespace, new.name), (new.namespace, new.vm_name)
            changed_keys.add(key)
            sets.add(set_key)
            table[object_id] = new
            device_ids[key] = object_id
            members[set_key][new.name] = new
        if sets:
            dirty |= sets
            self._bring_sets_current(sorted(sets))
            self._changed("GPU")

    def _changed(self, kind: str, keys: Iterable[SetKey] = ()) -> None:
        """Drop what a change of ``kind`` (the records ``keys``) makes stale (each is rebuilt
        from memory when next needed)."""
        self._tuples.pop(kind, None)
        if kind == "GPUClass":
            self.node_cache = NodeCache()
        if kind == "VirtualMachineInstance" and not self._owned_pods(keys):
            # The ledger reads a VMI only to tell whether a pod naming it as owner is its
            # launcher: with no such pod it is the same ledger. Every VM start is a new VMI
            # (its launcher pod comes after), and rebuilding the ledger for it cost the next
            # answer pass 0.6-0.9 s at 110k devices.
            return
        if kind not in ("GPU", "GPUBudget", "Node", "VirtualMachine"):
            self._ledger = None  # classes, pods, VMIs their pods name: the ledger is built again

    def _owned_pods(self, keys: Iterable[SetKey]) -> bool:
        """Whether a pod in this state names one of the VMIs ``keys`` as its owner."""
        wanted = set(keys)
        return bool(wanted) and any(
            pod.owner_vmi and (pod.namespace, pod.owner_vmi) in wanted for pod in self.records["Pod"].values()
        )

    def _replaced(self, kind: str, object_id: int, old: Any, new: Any, sets: set[SetKey]) -> None:
        """Keep the indexes of ``kind`` current for one record (``sets``: the sets touched)."""
        if kind == "GPU":
            self._replace_device(object_id, old, new)
            sets.update(d.set_key for d in (old, new) if d is not None)
        elif kind == "Node":
            self._node_replaced(old, new)
        elif kind == "Pod":
            self._pod_replaced(old, new)

    def _pod_replaced(self, old: e.Pod | None, new: e.Pod | None) -> None:
        """One pod changed (a subclass keeps its indexes of pods current here)."""

    def _node_replaced(self, old: e.Node | None, new: e.Node | None) -> None:
        """One node changed: the node cache and the ledger's free-units index move just
        that node (rebuilding either costs a sweep of every node, or of every device)."""
        self._tuples.pop("Node", None)  # the records already hold the change
        for name in sorted({n.name for n in (old, new) if n is not None}):
            node = new if new is not None and new.name == name else None
            self.node_cache.node_changed(name, node)
            if self._ledger is not None:
                self._ledger.set_node(name, node)

    def _replace_device(self, object_id: int, old: e.Device | None, new: e.Device | None) -> None:
        """Swap one device's record in the indexes; the caller then calls :meth:`_sets_changed`
        once for the sets touched (a pass binding 10k sets writes 26k devices)."""
        if (
            old is not None
            and new is not None
            and old.name == new.name
            and old.namespace == new.namespace
            and old.vm_name == new.vm_name
        ):
            # The common case (a pass placed the device): same key, same set, only the record moves.
            self.device_ids[(new.namespace, new.name)] = object_id
            self.members[(new.namespace, new.vm_name)][new.name] = new
            return
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
        """Bring what is kept per set current for ``keys`` (``ledger``: the booked units,
        unless the engine already moved them there)."""
        if ledger and self._ledger is not None:
            for key in keys:
                self._ledger.commit(key, self.set_members(key))

    # -- checkpoints (binder.runtime.checkpoint) -------------------------------------------

    def checkpoint_payload(self) -> dict[str, Any]:
        """What a checkpoint saves: the records and what is derived from them (the ledger
        and node cache too, so a start does not rebuild them), one pickle sharing the
        record objects; the cursor is saved beside it."""
        return {
            "records": self.records,
            "namespaces": self.namespaces,
            "device_ids": self.device_ids,
            "members": dict(self.members),
            "ledger": self._ledger,
            "node_cache": self.node_cache,
            "verified_age": time.monotonic() - self.verified_at,
        }

    def restore_checkpoint(
        self, payload: dict[str, Any], position: int, horizon: tuple[int, ...], mark: str, mark_at: int
    ) -> None:
        """Continue from a checkpoint's payload, standing at its feed position (the caller
        then follows the feed from there)."""
        self._reset("loaded from a checkpoint")
        self.records = payload["records"]
        self.namespaces = payload["namespaces"]
        self.device_ids = payload["device_ids"]
        self.members = defaultdict(dict, payload["members"])
        self._ledger = payload["ledger"]
        self.node_cache = payload["node_cache"]
        self.verified_at = time.monotonic() - float(payload["verified_age"])
        self.cursor = FeedCursor(position, horizon, mark, mark_at, anchor_name=self.worker)
        self.valid = True
        self.why_invalid = ""

    # -- what the engine reads -------------------------------------------------------------

    def set_members(self, key: SetKey) -> tuple[e.Device, ...]:
        """A set's devices in key order (as ``build_ledger`` stores them): one namespace,
        so in name order. While a catch-up brings sets current each set is sorted once
        (the settledness check and the ledger both ask; 10k new orders are 10k sets)."""
        memo = self._members_memo
        if memo is not None:
            found = memo.get(key)
            if found is None:
                found = memo[key] = self._sorted_members(key)
            return found
        return self._sorted_members(key)

    def _sorted_members(self, key: SetKey) -> tuple[e.Device, ...]:
        members = self.members.get(key)
        if not members:
            return ()
        return tuple([members[name] for name in sorted(members)])

    def _bring_sets_current(self, keys: list[SetKey]) -> None:
        """:meth:`_sets_changed` for a catch-up, with :meth:`set_members` sorting each set
        once (no member changes meanwhile)."""
        self._members_memo = {}
        try:
            self._sets_changed(keys)
        finally:
            self._members_memo = None

    def _tuple(self, kind: str) -> tuple[Any, ...]:
        cached = self._tuples.get(kind)
        if cached is None:
            cached = self._tuples[kind] = tuple(self.records[kind].values())
        return cached

    def cluster(self, now: datetime, settings: e.Settings, *, with_devices: bool = True) -> e.Cluster:
        """The whole state as one engine snapshot (no database read); ``with_devices=False``
        leaves the devices out (for an engine given :meth:`ledger`, which holds them)."""
        return e.Cluster(
            now=now,
            classes=self._tuple("GPUClass"),
            nodes=self._tuple("Node"),
            devices=self._tuple("GPU") if with_devices else (),
            budgets=self._tuple("GPUBudget"),
            vmis=self._tuple("VirtualMachineInstance"),
            pods=self._tuple("Pod"),
            settings=settings,
            virtual_machines=self._tuple("VirtualMachine"),
        )

    def ledger(self) -> Ledger:
        """The ledger of the whole state, built from memory when a node, class, pod or VMI
        changed, else kept current set by set."""
        if self._ledger is None:
            # What ``build_ledger`` builds, from the sets this state keeps already (its
            # sort of every device was a second at 1M devices, and its set keys a copy).
            self._ledger = Ledger(
                classes={c.name: c for c in self._tuple("GPUClass")},
                nodes={n.name: n for n in self._tuple("Node")},
                sets={key: self.set_members(key) for key in self.members},
                pods=self._tuple("Pod"),
                vmis={(v.namespace, v.name): v for v in self._tuple("VirtualMachineInstance")},
            )
        return self._ledger


def record_key(record: Any) -> SetKey:
    """(namespace, name) of any engine record; nodes and classes have no namespace."""
    return (getattr(record, "namespace", ""), record.name)


def sets_of(kind: str, record: Any) -> Iterable[SetKey]:
    """The sets a record belongs to: a device's, a VMI's own, a launcher-looking pod's owner."""
    if kind == "GPU":
        return (record.set_key,)
    if kind == "VirtualMachineInstance":
        return ((record.namespace, record.name),)
    if kind == "Pod" and record.owner_vmi:
        return ((record.namespace, record.owner_vmi),)
    return ()
