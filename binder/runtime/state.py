"""The binder worker's cluster: the in-memory mirror plus what its passes keep between them.

Freshness: a pass decides from a view holding every change committed before it
took the cluster-wide turn, without re-reading the whole mirror. The records, the ledger
and the feed cursor are :class:`~binder.runtime.mirror_state.MirrorState` (shared with the
web processes' read model); the feed's rules are in ``binder.runtime.feed``. This module
adds what only a pass needs: which sets wait for an answer or are not settled (a full
pass's scope), the result of the last full pass (the "nothing changed" rule), the status
it wrote, the feed entries of its own writes (skipped by the next catch-up), and the
worker's ``FeedReader`` row.

**When the state is thrown away and everything read again** (``rebuild``): a new process
(nothing in memory); the feed was truncated or reset, or went backwards; a namespace was
renamed; the previous pass in this process failed or rolled back; or this worker's row in
``FeedReader`` is gone or not at its position (it was not seen for
``GPUPLANE_FEED_RETENTION_SECONDS``, so pruning stopped keeping its entries).

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
import uuid
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings as django_settings
from django.db.models.functions import Now

from binder import models
from binder.engine import PassResult
from binder.engine import types as e
from binder.engine.fit import is_settled
from binder.engine.usage import Subjects
from binder.kube import kinds as kube_kinds
from binder.runtime.feed import OwnWrites, prune_feed
from binder.runtime.mirror_state import Catchup, MirrorState, SetKey

log = logging.getLogger(__name__)

#: The class status and budget usage a committed full pass wrote (see ``passes.write_result``).
StatusWritten = tuple[dict[str, e.ClassStatus], dict[tuple[str, str], Any]]


#: Brings a state that cannot prove itself current up to date some cheaper way than a
#: rebuild (``binder.runtime.checkpoint.load``), or returns None.
Loader = Callable[["ClusterState", str], Catchup | None]


#: The kinds whose rows usage records depend on (devices, pods, the VMIs and classes
#: that decide a launcher pod's raw usage).
RECORDED_KINDS = kube_kinds.RECORDED


class ClusterState(MirrorState):
    """One worker's view of the mirror, with what its passes keep between them."""

    KEPT = ("wanting", "_deadlines", "_deadline_grace", "_pods_by_key", "_pods_by_owner", "_unsettled", "_classes")

    def __init__(self) -> None:
        super().__init__(f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}")

    def _reset(self, why: str) -> None:
        super()._reset(why)
        self.wanting: set[SetKey] = set()
        #: The token this worker's last pass recorded in its ``FeedReader`` row.
        self.reader_token = ""
        self._deadlines: list[datetime] | None = None
        self._deadline_grace = 0
        #: Pods by key and by owner set (see :meth:`_pod_index`); None: built when first needed.
        self._pods_by_key: dict[SetKey, e.Pod] | None = None
        self._pods_by_owner: dict[SetKey, dict[SetKey, e.Pod]] | None = None
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
        #: GPUBudget ``status.borrowed`` as the last committed full pass wrote it (None: unknown).
        self.borrowed_written: dict[tuple[str, str], Any] | None = None
        #: The feed entries of the last pass's own writes, skipped by the next catch-up.
        self.own_writes: OwnWrites | None = None
        #: The id of this state's last full pass, which reconciled its usage records
        #: (None: none since the state was read or loaded).
        self.last_full_pass: int | None = None

    # -- bringing the state current (inside the pass's transaction and lock) -------------

    def catch_up(self, kind: str = models.PassKind.FULL, load: Loader | None = None) -> Catchup:
        """Apply the feed entries not yet seen, or rebuild when the state cannot be proven current.

        Answer passes neither write usage records nor run the full rules, so what their
        catch-ups found (and what they wrote) is kept for the next full pass.
        """
        reason = self._not_provable()
        if reason:
            catch = (load(self, reason) if load is not None else None) or self.rebuild(reason)
        else:
            skip, self.own_writes = self.own_writes, None
            catch = self.follow(skip)
        self.record_reader()
        if kind == models.PassKind.FULL:
            if catch.view != "rebuilt":
                if catch.view == "incremental":
                    catch.absorb(self.pending)
                catch.reconcile_all = bool(catch.vanished & RECORDED_KINDS) and self._recorded_elsewhere()
            self.pending = Catchup(view="incremental")
        else:
            self.pending.absorb(catch)
        return catch

    def _recorded_elsewhere(self) -> bool:
        """Whether full passes this state did not run (another worker's, or any before the
        checkpoint it was loaded from) may have written usage records since its own last one.

        Usage records are reconciled for the changed subjects only, which the feed names by
        row id. A device, pod or VMI created and deleted between two of this state's
        catch-ups is gone before it could be read (``Catchup.vanished``): nothing names it
        or its set. If another worker's full pass saw it meanwhile, that pass may have
        opened a record for it, or changed a launcher pod's raw usage through it, and only
        reconciling every open record puts that right.
        """
        if self.last_full_pass is None:
            return True
        return models.PassRun.objects.filter(kind=models.PassKind.FULL, pk__gt=self.last_full_pass).exists()

    def checkpoint_payload(self) -> dict[str, Any]:
        return {**super().checkpoint_payload(), "wanting": self.wanting, "unsettled": self._unsettled}

    def restore_checkpoint(
        self, payload: dict[str, Any], position: int, horizon: tuple[int, ...], mark: str, mark_at: int
    ) -> None:
        super().restore_checkpoint(payload, position, horizon, mark, mark_at)
        self.wanting = payload["wanting"]
        self._unsettled = payload["unsettled"]

    def nothing_pending(self) -> bool:
        """No answer pass found or wrote anything the next full pass must still act on."""
        pending = self.pending
        return not pending.since_rebuild and not pending.dirty_sets and not any(pending.changed.values())

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

    def _changed(self, kind: str, keys: Iterable[SetKey] = ()) -> None:
        super()._changed(kind, keys)
        if kind in ("GPUClass", "GPUBudget"):
            self.status_written = None  # a recreated row starts from the model's default
            self.borrowed_written = None
        if kind == "GPUClass":
            self._unsettled = None
            self._classes = None

    def _node_replaced(self, old: e.Node | None, new: e.Node | None) -> None:
        """One node changed: only the sets Bound there can change settledness, and only
        its own grace deadline moves (the ledger knows who is Bound where)."""
        super()._node_replaced(old, new)
        if self._deadlines is not None:
            for node, sign in ((old, -1), (new, 1)):
                if node is None or node.ready or not node.ready_since:
                    continue
                at = node.ready_since + timedelta(seconds=self._deadline_grace)
                if sign > 0:
                    bisect.insort(self._deadlines, at)
                else:
                    del self._deadlines[bisect.bisect_left(self._deadlines, at)]
        if self._unsettled is None:
            return
        if self._ledger is None:
            self._unsettled = None
            return
        names = {n.name for n in (old, new) if n is not None}
        self._sets_changed(sorted({key for name in names for key in self._ledger.sets_on.get(name, ())}), ledger=False)

    def _pod_index(self) -> tuple[dict[SetKey, dict[SetKey, e.Pod]], dict[SetKey, e.Pod]]:
        """Pods by their owner hint's set and by (namespace, name): which pods a set's
        change concerns, without a sweep of every pod (kept current pod by pod)."""
        if self._pods_by_key is None or self._pods_by_owner is None:
            self._pods_by_key, self._pods_by_owner = {}, {}
            for pod in self.records["Pod"].values():
                self._pod_replaced(None, pod)
        return self._pods_by_owner, self._pods_by_key

    def _pod_replaced(self, old: e.Pod | None, new: e.Pod | None) -> None:
        by_key, by_owner = self._pods_by_key, self._pods_by_owner
        if by_key is None or by_owner is None:
            return
        if old is not None:
            key = (old.namespace, old.name)
            if by_key.get(key) is old:
                del by_key[key]
            owned = by_owner.get((old.namespace, old.owner_vmi))
            if owned is not None and owned.get(key) is old:
                del owned[key]
                if not owned:
                    del by_owner[(old.namespace, old.owner_vmi)]
        if new is not None:
            key = (new.namespace, new.name)
            by_key[key] = new
            if new.owner_vmi:
                by_owner.setdefault((new.namespace, new.owner_vmi), {})[key] = new

    def _sets_changed(self, keys: Iterable[SetKey], *, ledger: bool = True) -> None:
        """Bring what is kept per set current for ``keys``: who waits for an answer, who is
        settled, and (``ledger``, unless the engine already moved them there) the ledger."""
        keeps: dict[tuple[str, str], bool] = {}  # nodes and classes do not change meanwhile
        for key in keys:
            members = self.members.get(key, {})
            if any(d.wants_answer for d in members.values()):
                self.wanting.add(key)
            else:
                self.wanting.discard(key)
            if self._unsettled is not None:
                if self._settled(key, keeps):
                    self._unsettled.discard(key)
                else:
                    self._unsettled.add(key)
        super()._sets_changed(keys, ledger=ledger)

    def _settled(self, key: SetKey, keeps: dict[tuple[str, str], bool] | None = None) -> bool:
        if self._classes is None:
            self._classes = {c.name: c for c in self.records["GPUClass"].values()}
        nodes, _ = self.node_cache.index(self._tuple("Node"))
        # Settledness does not depend on the members' order: not sorted (``set_members``),
        # which a start at 1M devices did for 385k sets.
        members = self.members.get(key)
        return is_settled(tuple(members.values()) if members else (), nodes, self._classes, keeps)

    def scope(self, catch: Catchup) -> set[SetKey]:
        """The sets a full pass must visit: every set that is not settled, plus what changed.

        Kept set by set as devices change; worked out again for every set only after a
        node or a class changed (settledness reads nothing else).
        """
        if self._unsettled is None:
            keeps: dict[tuple[str, str], bool] = {}  # nodes and classes do not change meanwhile
            self._unsettled = {key for key in self.members if not self._settled(key, keeps)}
        return self._unsettled | (catch.dirty_sets & self.members.keys())

    def requested(self, now: datetime, settings: e.Settings) -> e.Cluster:
        """What an answer pass reads: the requested sets whole, their tenants'
        budgets, every node and class; booked units and usage come from :meth:`ledger`."""
        keys = sorted(self.wanting)
        namespaces = {ns for ns, _ in keys}
        budgets = self._tuple("GPUBudget")
        return e.Cluster(
            now=now,
            classes=self._tuple("GPUClass"),
            nodes=self._tuple("Node"),
            devices=tuple(d for key in keys for d in self.set_members(key)),
            # Every budget when some budget lends: whether a requested set may borrow depends
            # on which sets of any tenant are entitled to the GPUs.
            budgets=budgets
            if any(b.borrowing for b in budgets)
            else tuple(b for b in budgets if b.namespace in namespaces),
            settings=settings,
        )

    def unchanged_since_last_full_pass(self, catch: Catchup, now: datetime, settings: e.Settings) -> PassResult | None:
        """The result of a full pass when it provably equals "change nothing", else None.

        The engine is a function of the records, the settings and the clock. If the last
        full pass changed no device (so its input is still the state), nothing changed
        since, the settings are the same, no NotReady node crossed its grace deadline
        between the two clocks (from an index of deadlines) and no set the last pass left in
        place for its admission grace may move now (``PassResult.wake_at``: the two rules
        that read the clock), the engine would decide exactly nothing again: no sweep needed.
        """
        if self.last_full is None or not catch.nothing_changed:
            return None
        then, then_settings, result = self.last_full
        if result.devices or result.answered or then_settings != settings or now < then:
            return None
        if result.wake_at is not None and result.wake_at <= now:
            return None  # a set's admission grace ended: making room may move it now
        deadlines = self.deadlines(settings.node_grace_seconds)
        i = bisect.bisect_left(deadlines, then)
        if i < len(deadlines) and deadlines[i] < now:
            return None
        counts = {o.value: 0 for o in e.Outcome}
        counts[e.Outcome.REFUSED.value] = result.counts.get(e.Outcome.REFUSED.value, 0)
        return PassResult(devices=(), changes=(), counts=counts, wake_at=result.wake_at)

    def deadlines(self, grace_seconds: int) -> list[datetime]:
        """When each NotReady node passes its grace period, sorted (rebuilt when a node changes)."""
        if self._deadlines is None or self._deadline_grace != grace_seconds:
            self._deadline_grace = grace_seconds
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
        deleted = prune_feed(floor, [self.horizon, *(horizon for _, horizon in readers)])
        self.cursor.pruned = floor
        return deleted

    # -- after the pass ----------------------------------------------------------------------

    def apply_result(self, result: PassResult, ledger_used: bool) -> None:
        """The pass's devices become the state's, in its transaction before the commit
        (while the database writes them): a pass that fails afterwards drops the whole
        state (``run_pass``), so nothing applied here outlives a rollback."""
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

    def passed(
        self,
        kind: str,
        now: datetime,
        settings: e.Settings,
        result: PassResult,
        own_writes: OwnWrites | None = None,
        pass_id: int | None = None,
    ) -> None:
        """The pass committed (its devices are the state's already, :meth:`apply_result`):
        the next catch-up may skip its own writes' feed entries (``own_writes``); a full
        pass ``pass_id`` reconciled the usage records."""
        self.own_writes = own_writes
        if kind == models.PassKind.FULL:
            self.last_full_pass = pass_id
            self.last_full = (now, settings, result)
            classes, budgets = self.status_written or ({}, {})
            self.status_written = ({**classes, **result.class_status}, {**budgets, **result.budget_used})
            self.borrowed_written = {**(self.borrowed_written or {}), **result.budget_borrowed}
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

    def adopt(self, other: MirrorState) -> None:
        super().adopt(other)
        self.last_full = None
        self.status_written = None
        self.borrowed_written = None
        self.record_reader()

    def usage_subjects(self, catch: Catchup, result: PassResult) -> Subjects:
        """The usage-record subjects this pass must reconcile, before :meth:`apply_result`:
        devices the pass wrote or the feed changed, pods the feed changed, and the pods of
        every set whose devices or VMI changed (a launcher's raw usage is its requests minus
        what its set holds). A rebuilt state, a class change, or rows that vanished while other
        passes recorded usage (``Catchup.reconcile_all``) reconcile everything."""
        if catch.view == "rebuilt" or catch.since_rebuild or catch.reconcile_all or catch.changed.get("GPUClass"):
            return Subjects(everything=True)
        written = {d.key: d for d in result.devices}
        device_keys = set(catch.changed.get("GPU", ())) | set(written)
        sets = set(catch.dirty_sets) | {d.set_key for d in result.devices}
        pod_keys = set(catch.changed.get("Pod", ()))
        by_owner, by_key = self._pod_index()
        for key in sets:
            pod_keys |= by_owner.get(key, {}).keys()
        if not device_keys and not pod_keys:
            return Subjects()
        devices = []
        for key in sorted(device_keys):
            device = written.get(key)
            if device is None and key in self.device_ids:
                device = self.records["GPU"].get(self.device_ids[key])
            if device is not None:
                devices.append(device)
        pods = tuple(by_key[k] for k in sorted(pod_keys) if k in by_key)
        owners = {(p.namespace, p.owner_vmi) for p in pods if p.owner_vmi}
        set_devices = tuple(written.get(d.key, d) for key in sorted(owners) for d in self.set_members(key))
        return Subjects(
            device_keys=frozenset(device_keys),
            pod_keys=frozenset(pod_keys),
            devices=tuple(devices),
            pods=pods,
            set_devices=set_devices,
        )


#: The state of this process's pass worker.
STATE = ClusterState()
