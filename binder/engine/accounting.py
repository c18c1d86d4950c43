"""Accounting: tenant usage per key, node booked units, effective limits.

One ledger serves the binder (which updates it as it moves sets within a pass) and
every read-only consumer (``dump_state``, the catalog, the admin), so "how much does
tenant T use" and "how full is node N" have one answer everywhere. Pod usage comes
from the shared launcher reader; it is never recomputed here by another rule.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping
from operator import attrgetter

from binder.engine.launcher import launcher_of, raw_usage
from binder.engine.ledger_records import Booked, Contribution, Delta, Holding, PodOn, PodsOn, SetKey, Used
from binder.engine.limits import class_units
from binder.engine.types import (
    Cluster,
    Device,
    GpuClass,
    Node,
    Phase,
    Pod,
    Vmi,
)

_lent = attrgetter("borrowed")


class Ledger:
    """Booked units per node and used units per tenant, kept current as sets change.

    Each set's contribution is stored, so a set that moves is subtracted and re-added
    without touching the rest of the cluster.
    """

    def __init__(
        self,
        classes: Mapping[str, GpuClass],
        nodes: Mapping[str, Node],
        sets: Mapping[SetKey, Iterable[Device]],
        pods: Iterable[Pod],
        vmis: Mapping[SetKey, Vmi],
    ) -> None:
        self.classes = classes
        #: A copy: :meth:`set_node` changes it.
        self.nodes: dict[str, Node] = dict(nodes)
        self.booked: dict[str, Counter[str]] = defaultdict(Counter)
        self.device_booked: dict[str, Counter[str]] = defaultdict(Counter)
        self.used: dict[str, Counter[str]] = defaultdict(Counter)
        self.launcher_pods: dict[SetKey, list[tuple[Pod, Vmi]]] = defaultdict(list)
        #: Pods that are no VMI's launcher, with their raw usage for capacity (their node's).
        self.plain_pods: list[tuple[Pod, Mapping[str, int]]] = []
        #: Each set's contribution, kept compact (see :data:`Booked` and :data:`Used`): at
        #: 1M devices a Contribution with two dicts per set was 250 MB of the worker.
        self._contrib: dict[SetKey, tuple[Booked, Used]] = {}
        self._shared_slots: dict[tuple[str, str], tuple[str, str]] = {}
        self._shared_used: dict[Used, Used] = {}
        self._devices: dict[SetKey, tuple[Device, ...]] = {}
        #: Units of each class held Bound and Lost (a class's status), kept current
        #: so a pass that touched a few sets need not count every device.
        self.class_held: dict[Phase, Counter[str]] = {Phase.BOUND: Counter(), Phase.LOST: Counter()}
        #: Node -> the sets with a Bound device there: who an over-booked node can evict.
        self.sets_on: dict[str, set[SetKey]] = defaultdict(set)
        #: Units per key of each tenant's borrowed sets (lending), and per borrowed set:
        #: a tenant's own usage is ``used`` less these, and only borrowed sets are listed.
        self.borrowed: dict[str, Counter[str]] = defaultdict(Counter)
        self.borrowed_sets: dict[SetKey, dict[str, int]] = {}
        #: The borrowed sets marked for reclaim (``reclaim_for``), a subset of ``borrowed_sets``.
        self.marked_sets: set[SetKey] = set()
        #: ``borrowed_sets`` by tenant: repaying judges one tenant's sets without the others.
        self.lent_of: dict[str, set[SetKey]] = {}
        #: The borrowed sets reclaim may mark: every member Bound on one node; by resource
        #: they hold, then node. Kept as sets change (``_lent_at``: where each is listed).
        self.lent_on: dict[str, dict[str, set[SetKey]]] = {}
        self._lent_at: dict[SetKey, tuple[str, tuple[str, ...]]] = {}
        #: Lending's memo for repaying (it decides nothing: a tenant passed over would have
        #: had nothing repaid). The tenants with borrowed sets whose sets changed since repay
        #: last judged them (None: every tenant, a new ledger), and the budgets (with the
        #: default) each was judged under: a tenant neither in the first nor under other
        #: budgets has, as then, no set to repay (own usage only grows within a repay).
        self.repay_due: set[str] | None = None
        self.repay_judged: dict[str, object] = {}
        self._indexed = False

        def find_vmi(namespace: str, name: str) -> Vmi | None:
            return vmis.get((namespace, name))

        for pod in pods:
            vmi = launcher_of(pod, find_vmi)
            if vmi is not None:
                self.launcher_pods[(vmi.namespace, vmi.name)].append((pod, vmi))
                continue
            usage = raw_usage(pod, None, (), classes)
            for resource, units in usage.budget.items():
                self.used[pod.namespace][resource] += units
            for resource, units in usage.capacity.items():
                self.booked[pod.node][resource] += units
            if usage.capacity:
                self.plain_pods.append((pod, usage.capacity))
        set_keys = set(sets) | set(self.launcher_pods)
        self._add_all(sorted(set_keys), sets)
        # Nodes bucketed by free units per resource, kept current from here on, so the
        # binder finds the fullest node with room without scanning every node.
        self.by_free: dict[str, dict[int, list[str]]] = defaultdict(dict)
        for name in sorted(nodes):
            for resource in set(nodes[name].allocatable) | set(self.booked.get(name, ())):
                self.by_free[resource].setdefault(self.free(name, resource), []).append(name)
        self._indexed = True

    # -- reading -------------------------------------------------------------------------

    def devices(self, key: SetKey) -> tuple[Device, ...]:
        return self._devices.get(key, ())

    def set_keys(self) -> Iterable[SetKey]:
        """Every set the ledger holds (an answer pass judging lending looks past its view)."""
        return self._devices.keys()

    def free(self, node: str, resource: str) -> int:
        """Allocatable minus booked; negative when the node is over-booked."""
        allocatable = self.nodes[node].allocatable.get(resource, 0) if node in self.nodes else 0
        return allocatable - self.booked[node][resource]

    def holdings(self) -> dict[str, list[Holding]]:
        """Node -> who books its units: Bound devices (by tenant, VM, name), then pods' raw
        usage for capacity (by tenant, name). The same counts as ``booked``, itemised:
        :meth:`holdings_on` for every node that has any."""
        index = self.pods_on()
        out: dict[str, list[Holding]] = defaultdict(list)
        for node in sorted(set(self.sets_on) | set(index)):
            held = self.holdings_on(node, index)
            if held:
                out[node] = held
        return out

    def pods_on(self) -> PodsOn:
        """Node -> its pods with raw usage, as :meth:`holdings_on` reads them: (pod, its VMI
        when it is a set's launcher, that set or the plain pod's capacity, the order
        holdings tie in). It depends on the pods alone; built once for many
        :meth:`holdings_on` calls."""
        index: PodsOn = defaultdict(list)
        order = 0
        for key in sorted(self.launcher_pods):  # every such set is committed: its devices are known
            for pod, vmi in self.launcher_pods[key]:
                index[pod.node].append((pod, vmi, key, order))
                order += 1
        for pod, capacity in self.plain_pods:
            index[pod.node].append((pod, None, capacity, order))
            order += 1
        return index

    def holdings_on(self, node: str, pods_on: Mapping[str, list[PodOn]] | None = None) -> list[Holding]:
        """Who books ``node``'s units, as :meth:`holdings` lists them for it, worked out for
        that node alone (a page showing a node, or the board's drawn rows, need not itemise
        the whole cluster). ``pods_on``: :meth:`pods_on`, when many nodes are asked."""
        classes = self.classes
        held: list[Holding] = []
        if node:
            for key in sorted(self.sets_on.get(node, ())):
                for device in sorted(self._devices.get(key, ()), key=lambda d: d.name):
                    cls = classes.get(device.class_name)
                    if cls is not None and device.phase is Phase.BOUND and device.node == node:
                        held.append(Holding(cls.resource_name, cls.units_per_device, device=device))
        index = pods_on if pods_on is not None else self.pods_on()
        pods: list[tuple[str, str, str, int, Pod, int, Vmi | None]] = []
        for pod, vmi, source, order in index.get(node, ()):
            if vmi is not None:
                assert isinstance(source, tuple)  # noqa: S101 - a launcher's entry names its set
                capacity = raw_usage(pod, vmi, self._devices.get(source, ()), classes).capacity
            else:
                assert not isinstance(source, tuple)  # noqa: S101 - a plain pod's entry holds its capacity
                capacity = source
            pods.extend((pod.namespace, pod.name, r, order, pod, units, vmi) for r, units in capacity.items())
        pods.sort(key=lambda p: (p[0], p[1], p[2], p[3]))
        held.extend(Holding(resource, units, pod=pod, launcher=vmi) for _, _, resource, _, pod, units, vmi in pods)
        return held

    def copy(self) -> Ledger:
        """An independent ledger with the same contents, in time linear in nodes and sets.

        For a reader that keeps one ledger current (a web process's read model) and hands
        a page a ledger of its own that later commits will not move. What :meth:`commit`
        changes in place (the per-node and per-tenant counters, the free-units buckets,
        the sets per node) is copied; what it replaces (each set's contribution and
        devices) and what it never changes (classes, pods) is shared.
        """
        twin = Ledger.__new__(Ledger)
        twin.classes = self.classes
        twin.nodes = dict(self.nodes)
        twin.booked = defaultdict(Counter, {k: Counter(v) for k, v in self.booked.items()})
        twin.device_booked = defaultdict(Counter, {k: Counter(v) for k, v in self.device_booked.items()})
        twin.used = defaultdict(Counter, {k: Counter(v) for k, v in self.used.items()})
        twin.launcher_pods = defaultdict(list, {k: list(v) for k, v in self.launcher_pods.items()})
        twin.plain_pods = list(self.plain_pods)
        twin._contrib = dict(self._contrib)
        twin._shared_slots = self._shared_slots  # only ever added to: safe to share
        twin._shared_used = self._shared_used
        twin._devices = dict(self._devices)
        twin.class_held = {phase: Counter(held) for phase, held in self.class_held.items()}
        twin.sets_on = defaultdict(set, {k: set(v) for k, v in self.sets_on.items()})
        twin.borrowed = defaultdict(Counter, {k: Counter(v) for k, v in self.borrowed.items()})
        twin.borrowed_sets = dict(self.borrowed_sets)
        twin.marked_sets = set(self.marked_sets)
        twin.lent_of = {k: set(v) for k, v in self.lent_of.items()}
        twin.lent_on = {r: {n: set(v) for n, v in on.items()} for r, on in self.lent_on.items()}
        twin._lent_at = dict(self._lent_at)
        twin.repay_due = None if self.repay_due is None else set(self.repay_due)
        twin.repay_judged = dict(self.repay_judged)
        twin.by_free = defaultdict(
            dict, {r: {free: list(names) for free, names in buckets.items()} for r, buckets in self.by_free.items()}
        )
        twin._indexed = self._indexed
        return twin

    def over_booked(self, node: str) -> list[str]:
        """Resources of ``node`` booked beyond allocatable, sorted."""
        return sorted(r for r, units in self.booked[node].items() if units > 0 and self.free(node, r) < 0)

    def over_booked_nodes(self) -> list[str]:
        """The ledger's nodes with some resource booked beyond allocatable, sorted.

        Read from the free-units index (its negative buckets), so finding the few
        over-booked nodes costs nothing per healthy node.
        """
        return sorted({name for buckets in self.by_free.values() for free, names in buckets.items() if free < 0
                       for name in names})  # fmt: skip

    # -- changing ------------------------------------------------------------------------

    def _sums(self, key: SetKey, members: tuple[Device, ...]) -> tuple[dict[tuple[str, str], int], dict[str, int]]:
        """What set ``key`` would book per (node, resource) and use per key if its devices
        were ``members``: Bound and Lost devices count in usage, Bound ones on a node book
        it, then its launcher pods' raw usage (one loop over the devices for both)."""
        classes = self.classes
        booked: dict[tuple[str, str], int] = {}
        used: dict[str, int] = {}
        for device in members:
            phase = device.phase
            if phase is Phase.PENDING:
                continue
            cls = classes.get(device.class_name)
            if cls is None:
                continue
            units = cls.units_per_device
            resource = cls.resource_name
            used[cls.name] = used.get(cls.name, 0) + units
            used[resource] = used.get(resource, 0) + units
            if phase is Phase.BOUND and device.node:
                slot = (device.node, resource)
                booked[slot] = booked.get(slot, 0) + units
        if key in self.launcher_pods:
            self._launchers_add(key, members, booked, used)
        return booked, used

    def _launchers_add(
        self, key: SetKey, members: tuple[Device, ...], booked: dict[tuple[str, str], int], used: dict[str, int]
    ) -> None:
        """Add set ``key``'s launcher pods' raw usage to its sums (``members``: its devices)."""
        for pod, vmi in self.launcher_pods.get(key, ()):
            usage = raw_usage(pod, vmi, members, self.classes)
            for resource, units in usage.budget.items():
                used[resource] = used.get(resource, 0) + units
            for resource, units in usage.capacity.items():
                slot = (pod.node, resource)
                booked[slot] = booked.get(slot, 0) + units

    def contribution(self, key: SetKey, devices: Iterable[Device]) -> Contribution:
        """What ``key`` would add if its devices were ``devices``."""
        booked, used = self._sums(key, tuple(devices))
        return Contribution(booked=booked, used=used)

    def _kept(self, booked: dict[tuple[str, str], int], used: dict[str, int]) -> tuple[Booked, Used]:
        """A contribution as the ledger keeps it (see :data:`Booked` and :data:`Used`)."""
        slots = self._shared_slots
        kept_booked = tuple((slots.setdefault(slot, slot), units) for slot, units in booked.items()) if booked else ()
        kept_used = tuple(used.items())
        return kept_booked, self._shared_used.setdefault(kept_used, kept_used)

    def used_delta(self, key: SetKey, devices: Iterable[Device]) -> dict[str, int]:
        """What the tenant of ``key`` would use more per key (negative: less) if its devices
        were ``devices``: the ``used`` half of :meth:`delta`, without the bookings."""
        members = tuple(devices)
        classes = self.classes
        used = class_units(members, classes)
        for pod, vmi in self.launcher_pods.get(key, ()):
            for resource, units in raw_usage(pod, vmi, members, classes).budget.items():
                used[resource] = used.get(resource, 0) + units
        return self.used_delta_from(key, used)

    def used_delta_from(self, key: SetKey, used: dict[str, int]) -> dict[str, int]:
        """``used`` (what set ``key`` would use, key -> units; changed in place) less what it
        uses now."""
        old = self._contrib.get(key)
        if old is not None:
            for k, units in old[1]:
                used[k] = used.get(k, 0) - units
        return used

    def delta(self, key: SetKey, devices: Iterable[Device]) -> Delta:
        """New contribution minus the current one."""
        new_booked, new_used = self._sums(key, tuple(devices))
        old = self._contrib.get(key)
        booked: Counter[tuple[str, str]] = Counter(new_booked)
        used: Counter[str] = Counter(new_used)
        if old is not None:
            for slot, units in old[0]:
                booked[slot] -= units
            for k, units in old[1]:
                used[k] -= units
        return Delta(booked=booked, used=used)

    def commit(self, key: SetKey, devices: tuple[Device, ...]) -> None:
        """Make ``devices`` the current state of set ``key``."""
        namespace = key[0]
        old = self._contrib.get(key)
        if key in self.borrowed_sets or any(map(_lent, devices)):
            self._borrowing(key, devices)
        if namespace in self.lent_of and self.repay_due is not None:
            self.repay_due.add(namespace)
        if old is None and key not in self.launcher_pods and all(d.phase is Phase.PENDING for d in devices):
            # A new order (a catch-up after 10k of them commits 10k): it books and uses
            # nothing, so only its devices are kept, as ``_add_all`` keeps them.
            self._contrib[key] = ((), ())
            self._devices[key] = devices
            return
        booked, used = self._sums(key, devices)
        before = {}
        if self._indexed:
            touched = set(booked) | ({slot for slot, _ in old[0]} if old is not None else set())
            before = {nr: self.free(*nr) for nr in touched}
        if old is not None:
            for (node, resource), units in old[0]:
                self.booked[node][resource] -= units
            for k, units in old[1]:
                self.used[namespace][k] -= units
            was_devices = self._devices.get(key, ())
            self._devices_book(was_devices, -1)
            self._index_nodes(key, was_devices, -1)
        for (node, resource), units in booked.items():
            self.booked[node][resource] += units
        for k, units in used.items():
            self.used[namespace][k] += units
        self._devices_book(devices, +1)
        self._index_nodes(key, devices, +1)
        self._contrib[key] = self._kept(booked, used)
        self._devices[key] = devices
        for (node, resource), was in before.items():
            now = self.free(node, resource)
            if now != was and node in self.nodes:
                self._rebucket(node, resource, was, now)

    def _borrowing(self, key: SetKey, devices: Iterable[Device]) -> None:
        """Set ``key``'s borrowed units are now those of ``devices`` (its held borrowed members)."""
        tenant = self.borrowed[key[0]]
        for k, units in self.borrowed_sets.pop(key, {}).items():
            tenant[k] -= units
            if not tenant[k]:
                del tenant[k]
        devices = tuple(devices)
        lent = [d for d in devices if d.borrowed and d.held]
        units_now = class_units(lent, self.classes)
        if units_now:
            self.borrowed_sets[key] = units_now
            for k, units in units_now.items():
                tenant[k] += units
        if units_now and any(d.reclaim_for for d in lent):
            self.marked_sets.add(key)
        else:
            self.marked_sets.discard(key)
        self._list_lent(key, devices if units_now else ())

    def _list_lent(self, key: SetKey, devices: tuple[Device, ...]) -> None:
        """List ``key`` (now ``devices``, or nothing when it borrows nothing) in ``lent_of``
        and, when every member is Bound on one node, in ``lent_on``."""
        namespace = key[0]
        where = self._lent_at.pop(key, None)
        if where is not None:
            node, resources = where
            for resource in resources:
                on = self.lent_on[resource]
                on[node].discard(key)
                if not on[node]:
                    del on[node]
                    if not on:
                        del self.lent_on[resource]
        if not devices:
            of = self.lent_of.get(namespace)
            if of is not None:
                of.discard(key)
                if not of:
                    del self.lent_of[namespace]
                    self.repay_judged.pop(namespace, None)
            return
        self.lent_of.setdefault(namespace, set()).add(key)
        node = devices[0].node
        if not node or not all(d.phase is Phase.BOUND and d.node == node for d in devices):
            return
        classes = self.classes
        resources = tuple(sorted({classes[d.class_name].resource_name for d in devices if d.class_name in classes}))
        for resource in resources:
            self.lent_on.setdefault(resource, {}).setdefault(node, set()).add(key)
        self._lent_at[key] = (node, resources)

    def lending_index(self) -> dict[str, object]:
        """What the ledger keeps of lending, to compare a kept ledger with one built from
        scratch (verification): borrowed units per tenant and set, marks, and the indexes."""
        return {
            "borrowed": {k: {r: n for r, n in v.items() if n} for k, v in self.borrowed.items() if any(v.values())},
            "borrowed_sets": dict(self.borrowed_sets),
            "marked_sets": set(self.marked_sets),
            "lent_of": {k: set(v) for k, v in self.lent_of.items()},
            "lent_on": {r: {n: set(v) for n, v in on.items()} for r, on in self.lent_on.items()},
        }

    def own_used(self, namespace: str, key: str) -> int:
        """The tenant's own usage of ``key``: its usage less the units of its borrowed sets."""
        lent = self.borrowed.get(namespace)
        return self.used[namespace][key] - (lent[key] if lent else 0)

    def _add_all(self, keys: Iterable[SetKey], sets: Mapping[SetKey, Iterable[Device]]) -> None:  # noqa: C901 - flat: a million devices
        """:meth:`commit` of each set of ``keys`` (its devices in ``sets``) while the ledger
        is built (no set held yet, no free-units index): the sums, the devices' bookings
        per node, the class totals and the sets per node in one loop over each set's
        devices. A start at 1M devices commits 385k sets: one call, three loops and a
        Contribution each took seconds."""
        classes = self.classes
        bound, lost = self.class_held[Phase.BOUND], self.class_held[Phase.LOST]
        device_booked, sets_on, ledger_booked, ledger_used = self.device_booked, self.sets_on, self.booked, self.used
        contrib, kept_devices, launchers = self._contrib, self._devices, self.launcher_pods
        shared_slot, shared_used = self._shared_slots.setdefault, self._shared_used.setdefault
        pending, bound_, lost_ = Phase.PENDING, Phase.BOUND, Phase.LOST
        nothing: tuple[Booked, Used] = ((), ())
        for key in keys:
            devices = tuple(sets.get(key, ()))
            kept_devices[key] = devices
            if any(map(_lent, devices)):
                self._borrowing(key, devices)
            booked: dict[tuple[str, str], int] = {}
            used: dict[str, int] = {}
            for device in devices:
                phase = device.phase
                if phase is pending:
                    continue
                node = device.node
                if phase is bound_ and node:
                    sets_on[node].add(key)
                cls = classes.get(device.class_name)
                if cls is None:
                    continue
                units = cls.units_per_device
                name, resource = cls.name, cls.resource_name
                used[name] = used.get(name, 0) + units
                used[resource] = used.get(resource, 0) + units
                if phase is bound_:
                    bound[name] += units
                    if node:
                        slot = (node, resource)
                        booked[slot] = booked.get(slot, 0) + units
                        device_booked[node][resource] += units
                elif phase is lost_:
                    lost[name] += units
            if key in launchers:
                self._launchers_add(key, devices, booked, used)
            if not booked and not used:
                contrib[key] = nothing
                continue
            for (node, resource), units in booked.items():
                ledger_booked[node][resource] += units
            if used:
                tenant = ledger_used[key[0]]
                for k, units in used.items():
                    tenant[k] += units
            kept_used = tuple(used.items())
            contrib[key] = (
                tuple([(shared_slot(slot, slot), units) for slot, units in booked.items()]),
                shared_used(kept_used, kept_used),
            )

    def _rebucket(self, node: str, resource: str, was: int, now: int) -> None:
        self._unbucket(node, resource, was)
        bisect.insort(self.by_free[resource].setdefault(now, []), node)

    def fullest_with_room(self, resource: str, units: int) -> Iterator[str]:
        """Nodes with at least ``units`` free of ``resource``: fewest free first, then by name."""
        buckets = self.by_free.get(resource, {})
        for free in sorted(f for f in buckets if f >= units):
            yield from buckets[free]

    def room_count(self, resource: str, units: int) -> int:
        """How many nodes have at least ``units`` free of ``resource`` (from the index's buckets)."""
        return sum(len(names) for free, names in self.by_free.get(resource, {}).items() if free >= units)

    def set_node(self, name: str, node: Node | None) -> None:
        """Node ``name`` is now ``node`` (None: deleted): its free units change, nothing
        else (bookings belong to sets and pods), so the index moves just this node."""
        nodes = self.nodes
        old = nodes.get(name)
        resources = set(self.booked.get(name, ()))
        for n in (old, node):
            if n is not None:
                resources |= set(n.allocatable)
        if old is not None:
            for resource in resources:
                self._unbucket(name, resource, self.free(name, resource))
        if node is None:
            nodes.pop(name, None)
            return
        nodes[name] = node
        for resource in set(node.allocatable) | set(self.booked.get(name, ())):
            bisect.insort(self.by_free[resource].setdefault(self.free(name, resource), []), name)

    def _unbucket(self, node: str, resource: str, was: int) -> None:
        buckets = self.by_free[resource]
        old_bucket = buckets.get(was)
        if old_bucket is not None:
            index = bisect.bisect_left(old_bucket, node)
            if index < len(old_bucket) and old_bucket[index] == node:
                del old_bucket[index]
                if not old_bucket:
                    del buckets[was]

    def _index_nodes(self, key: SetKey, devices: Iterable[Device], sign: int) -> None:
        for node in {d.node for d in devices if d.phase is Phase.BOUND and d.node}:
            if sign > 0:
                self.sets_on[node].add(key)
                continue
            on = self.sets_on.get(node)
            if on is not None:
                on.discard(key)
                if not on:
                    del self.sets_on[node]

    def _devices_book(self, devices: Iterable[Device], sign: int) -> None:
        """Count ``devices`` in (``sign`` +1) or out of (-1) the devices' bookings per node
        and the Bound and Lost units per class."""
        classes = self.classes
        bound, lost = self.class_held[Phase.BOUND], self.class_held[Phase.LOST]
        for device in devices:
            phase = device.phase
            if phase is Phase.PENDING:
                continue  # books nothing and is held as nothing
            cls = classes.get(device.class_name)
            if cls is None:
                continue
            units = sign * cls.units_per_device
            if phase is Phase.BOUND:
                if device.node:
                    self.device_booked[device.node][cls.resource_name] += units
                bound[cls.name] += units
            elif phase is Phase.LOST:
                lost[cls.name] += units


def build_ledger(
    *,
    classes: Iterable[GpuClass],
    devices: Iterable[Device],
    pods: Iterable[Pod],
    vmis: Iterable[Vmi],
    nodes: Iterable[Node] = (),
) -> Ledger:
    """The one way to build a ledger from records: devices grouped into their sets (members
    in key order). The binder, the admin, the catalog, the webhook's advisory check and the
    usage API all count through it."""
    sets: dict[SetKey, list[Device]] = defaultdict(list)
    for device in sorted(devices, key=lambda d: d.key):
        sets[device.set_key].append(device)
    return Ledger(
        classes={c.name: c for c in classes},
        nodes={n.name: n for n in nodes},
        sets={k: tuple(v) for k, v in sets.items()},
        pods=pods,
        vmis={(v.namespace, v.name): v for v in vmis},
    )


def ledger_for(cluster: Cluster) -> Ledger:
    """The ledger of a whole cluster snapshot."""
    return build_ledger(
        classes=cluster.classes, nodes=cluster.nodes, devices=cluster.devices, pods=cluster.pods, vmis=cluster.vmis
    )


def tenant_usage(ledger: Ledger, namespace: str) -> dict[str, int]:
    """Usage per key of one tenant, zero keys dropped."""
    return {k: v for k, v in sorted(ledger.used.get(namespace, Counter()).items()) if v}
