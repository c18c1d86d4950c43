"""The working state of one pass: what it reads, how it chooses a node, how it changes sets.

:class:`PassState` holds the cluster as the pass found it and the ledger it moves sets
in; the handling of sets that accept several classes (``binder.engine.pass_choices``),
placing one set (``binder.engine.pass_placing``) and the steps (``binder.engine.placement``)
are built on it, and the lending rules (``binder.engine.lending``) work over it (how the
storeys fit: ``binder.engine.placement._Pass``). Nothing here does I/O.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from operator import attrgetter

from binder.engine.accounting import Ledger, ledger_for
from binder.engine.fit import (
    NodeCache,
    _budget_refusal,
    _labels,
    _refusal_of,
    refuses_new,
    requested_selector,
    requested_selector_mismatch,
    selector_mismatch,
    untolerated_taint,
)
from binder.engine.ledger_records import SetKey
from binder.engine.limits import Limits, class_units, effective_limits
from binder.engine.types import (
    Budget,
    Change,
    ClassStatus,
    Cluster,
    Device,
    GpuClass,
    Outcome,
    PassResult,
    Phase,
    Vmi,
)

#: How long after the webhook admits a VMI that VMI surely is in the mirror (the apiserver stores
#: it as the webhook answers; the sync mirrors it within a second or so): until then the set's
#: ``admitted`` stands for it.
VMI_MIRRORED_SECONDS = 10
#: A VMI in one of these phases has ended: it is pinned to nothing any more.
FINISHED_VMI_PHASES = frozenset({"Succeeded", "Failed"})
REASON_BOUND = "bound: fullest node with room"


class PassState:
    """The mutable working state of one pass."""

    def __init__(
        self,
        cluster: Cluster,
        ledger: Ledger | None = None,
        cache: NodeCache | None = None,
        scope: Iterable[SetKey] | None = None,
    ) -> None:
        self.now = cluster.now
        self.settings = cluster.settings
        self.classes: dict[str, GpuClass] = {c.name: c for c in cluster.classes}
        self.cache = cache if cache is not None else NodeCache()
        self.cache.classes = self.classes
        self.nodes, self.node_names = self.cache.index(cluster.nodes)
        #: Each changed set's members as the pass found them, taken at its first change.
        self._before: dict[SetKey, tuple[Device, ...]] = {}
        self.budgets = cluster.budgets
        #: The VMIs and VirtualMachines as read (making room asks which stopped VMs exist).
        self.vmis = cluster.vmis
        self.virtual_machines = cluster.virtual_machines
        self.ledger = ledger if ledger is not None else ledger_for(cluster)
        self._set_keys = sorted(set(scope) if scope is not None else {d.set_key for d in cluster.devices})
        self._in_scope = set(self._set_keys)
        by_ns: dict[str, list[Budget]] = defaultdict(list)
        for budget in cluster.budgets:
            by_ns[budget.namespace].append(budget)
        self.budgets_by_ns = by_ns
        self._limits: dict[str, Limits] = {}
        self.counts: Counter[str] = Counter({o.value: 0 for o in Outcome})
        #: Sets this pass sent to Lost: failing to rebind them right away is no new refusal.
        self._lost_now: set[SetKey] = set()
        #: Sets this pass could not place (counted once, however many sweeps tried them).
        self.refused: set[SetKey] = set()
        self.answered: list[tuple[str, str]] = []
        #: Making room: waiting set -> the sets moved for it, in the order taken.
        self.room_plans: dict[SetKey, tuple[SetKey, ...]] = {}
        #: Making room: when the first set kept in place by its admission grace may move.
        self.wake_at: datetime | None = None
        #: Set when a growing set moved whole this sweep, freeing its old node's units.
        self.room_freed = False
        #: Lending rules apply: some budget names a borrowing, or some set holds borrowed GPUs
        #: (``binder.engine.lending``; without either, no set borrows or is marked).
        self.lending = any(b.borrowing for b in cluster.budgets) or bool(self.ledger.borrowed_sets)
        self._vmis = cluster.vmis
        self._vmi_index: dict[SetKey, Vmi] | None = None

    # -- reading -------------------------------------------------------------------------

    def set_keys(self) -> list[SetKey]:
        return list(self._set_keys)

    def live_vmi(self, key: SetKey) -> Vmi | None:
        """The set's VMI (same namespace and name as its VM) while it has not finished: a VMI
        admitted to the set is pinned to the node the set was Bound on then. Indexed on first
        use (only an over-booked node asks)."""
        if self._vmi_index is None:
            self._vmi_index = {(v.namespace, v.name): v for v in self._vmis}
        vmi = self._vmi_index.get(key)
        return vmi if vmi is not None and vmi.phase not in FINISHED_VMI_PHASES else None

    def admitted_recently(self, key: SetKey) -> bool:
        """The webhook pinned a VMI to the set within :data:`VMI_MIRRORED_SECONDS` (its first member
        carries when): that VMI may not be mirrored yet, but it is pinned where the set is. Past
        that, a set without a VMI is a stopped VM's, whatever its last admission."""
        members = self.members(key)
        first = min(members, key=_by_name) if members else None
        if first is None or first.admitted is None:
            return False
        ends = first.admitted + timedelta(seconds=min(VMI_MIRRORED_SECONDS, self.settings.move_grace_seconds))
        if self.now >= ends:
            return False
        # The clock decides here: the "nothing changed" rule must not skip the pass after this.
        self.wake_at = ends if self.wake_at is None else min(self.wake_at, ends)
        return True

    def members(self, key: SetKey) -> tuple[Device, ...]:
        return self.ledger.devices(key)

    def placed_in_pass(self, key: SetKey) -> bool:
        """Whether this pass placed or moved some member of the set (its phase or node changed)."""
        before = self._before.get(key)
        if before is None:
            return False
        return {(d.name, d.phase, d.node) for d in before} != {(d.name, d.phase, d.node) for d in self.members(key)}

    def limits(self, namespace: str) -> Limits:
        """The tenant's effective limits (budgets do not change within a pass: worked out once)."""
        found = self._limits.get(namespace)
        if found is None:
            found = self._limits[namespace] = effective_limits(
                self.budgets_by_ns.get(namespace, ()), self.settings.default_budget
            )
        return found

    def units(self, devices: Iterable[Device]) -> Counter[str]:
        total: Counter[str] = Counter()
        for device in devices:
            cls = self.classes.get(device.class_name)
            if cls is not None:
                total[cls.resource_name] += cls.units_per_device
        return total

    def _classes_of(self, devices: Iterable[Device]) -> list[GpuClass]:
        return [self.classes[name] for name in sorted({d.class_name for d in devices}) if name in self.classes]

    def _selector_mismatch(self, node_name: str, devices: Iterable[Device]) -> str | None:
        return selector_mismatch(self.nodes[node_name], self._classes_of(devices))

    def not_ready_past_grace(self, node_name: str) -> bool:
        node = self.nodes[node_name]
        if node.ready:
            return False
        if node.ready_since is None:
            return True
        return (self.now - node.ready_since).total_seconds() > self.settings.node_grace_seconds

    def cannot_keep(self, node_name: str, devices: Sequence[Device]) -> str | None:
        """Why ``node_name`` cannot keep the held set ``devices`` (step 2), or None."""
        node = self.nodes.get(node_name)
        if node is None:
            return f"node {node_name} was deleted"
        if self.not_ready_past_grace(node_name):
            since = _rfc3339(node.ready_since) if node.ready_since else "an unknown time"
            return (
                f"node {node_name} has been NotReady since {since}, "
                f"longer than the {self.settings.node_grace_seconds}s grace period"
            )
        if node.draining:
            return f"node {node_name} is labelled gpuplane.io/drain=true"
        mismatch = self._selector_mismatch(node_name, devices)
        if mismatch:
            return f"node {node_name} no longer matches: {mismatch}"
        return None

    def taint_note(self, devices: Sequence[Device]) -> str:
        """A note for a refusal: the nodes kept out by a taint the classes do not tolerate,
        so "no node has room" does not hide the one setting an operator can change."""
        selector = requested_selector(devices)
        wanted = f" with the VMI's nodeSelector {_labels(selector)}" if selector else ""
        classes = self._classes_of(devices)
        cache_key = frozenset(c.name for c in classes)
        tainted = self.cache.tainted.get(cache_key)
        if tainted is None:
            tainted = tuple((n, why) for n in self.node_names if (why := untolerated_taint(self.nodes[n], classes)))
            self.cache.tainted[cache_key] = tainted
        if not tainted:
            return wanted
        first, why = tainted[0]
        more = f" and {len(tainted) - 1} more" if len(tainted) > 1 else ""
        return f"{wanted} (not tolerated: {first}{more}; {why})"

    def cannot_take(self, node_name: str, devices: Sequence[Device]) -> str | None:
        """Why ``node_name`` takes nothing new for ``devices``, or None."""
        node = self.nodes.get(node_name)
        if node is None:
            return "deleted"
        return refuses_new(node, self._classes_of(devices)) or requested_selector_mismatch(node, devices)

    # -- choosing a node -----------------------------------------------------------------

    def fit(self, key: SetKey, candidate: tuple[Device, ...], node: str) -> int | None:
        """Free units left on ``node`` for the set's resources if ``candidate`` were current.

        None when any of those resources would be over-booked.
        """
        delta = self.ledger.delta(key, candidate)
        left = 0
        for resource in self.units(d for d in candidate if d.node == node):
            after = self.ledger.free(node, resource) - delta.booked[(node, resource)]
            if after < 0:
                return None
            left += after
        return left

    def best_node(  # noqa: C901 - binding new orders: each node condition is one branch
        self,
        key: SetKey,
        placed_on: Callable[[str], tuple[Device, ...]],
        moving: Sequence[Device],
        exclude: Iterable[str] = (),
        prefer: Counter[str] | None = None,
    ) -> str | None:
        """The fullest node with room for ``moving``, or None.

        ``placed_on(n)`` gives the set's devices as they would be with ``moving`` Bound on
        n. ``prefer`` ranks nodes first by units of the set they already hold (step 1).
        """
        skip = set(exclude)
        need = self.units(moving)
        if not need:
            return None
        # Nodes where the set's own units or its launcher pods already sit need the full
        # delta (the pods' raw booking shrinks as devices arrive); everywhere else the set
        # simply adds its units, and free units must cover them.
        special = {d.node for d in self.members(key) if d.phase is Phase.BOUND}
        special |= {p.node for p, _ in self.ledger.launcher_pods.get(key, ())}
        # Units held per node, 0 where none: a Counter's own lookup of a missing name is a
        # Python call (``__missing__``), once for every node considered.
        held = prefer.get if prefer else None
        eligible = self.eligible_nodes(moving)
        best: tuple[int, int, str] | None = None

        def consider(name: str, left: int | None) -> None:
            nonlocal best
            if left is None:
                return
            rank = (-held(name, 0) if held is not None else 0, left, name)
            if best is None or rank < best:
                best = rank

        for name in sorted(special):
            if name in eligible and name not in skip:
                consider(name, self.fit(key, placed_on(name), name))
        if len(need) == 1:
            # One resource: the fullest node with room is the first eligible node in the
            # free-units index (fewest free first, then by name).
            ((resource, units),) = need.items()
            for name in self.ledger.fullest_with_room(resource, units):
                if name in eligible and name not in skip and name not in special:
                    consider(name, self.ledger.free(name, resource) - units)
                    break
        else:
            # Several resources: only nodes with room for each can take the set. Walk the
            # smallest of the per-resource "room" lists (from the free-units index) and
            # rank each candidate as the plain scan would (fewest free left, then name).
            free = self.ledger.free
            fewest = min(need, key=lambda r: (self.ledger.room_count(r, need[r]), r))
            for name in self.ledger.fullest_with_room(fewest, need[fewest]):
                if name not in eligible or name in skip or name in special:
                    continue
                left: int | None = 0
                for resource, units in need.items():
                    after = free(name, resource) - units
                    if after < 0:
                        left = None
                        break
                    left = (left or 0) + after
                consider(name, left)
        return best[2] if best else None

    def eligible_nodes(self, devices: Sequence[Device]) -> set[str]:
        """Nodes that may take new units of ``devices``' classes (cached: readiness,
        cordons, labels and taints do not change within a pass, and the cache follows a
        changed node), and of an unanswered bind request's nodeSelector."""
        classes = frozenset(d.class_name for d in devices)
        return self.cache.eligible_for((classes, frozenset(requested_selector(devices).items())), self.classes)

    def budget_refusal(self, key: SetKey, candidate: tuple[Device, ...]) -> str | None:
        """Why making ``candidate`` current would push the tenant over a budget, or None
        (each device as the class it is booked as: the pass tries choices itself)."""
        return _budget_refusal(self.ledger, self.limits(key[0]), key, candidate)

    def held_refusal(self, key: SetKey, members: tuple[Device, ...], names: set[str]) -> str | None:
        """:meth:`budget_refusal` of ``members`` with the ``names`` ones Bound (on any node:
        usage does not depend on where).

        A set without launcher pods uses what its held devices' classes take, so that is
        summed here without copying a record (a pass binding 10k orders checks 10k
        budgets); a set with launcher pods goes through the candidate, whose pods' raw
        usage depends on what the set holds.
        """
        ledger = self.ledger
        if key in ledger.launcher_pods:
            return self.budget_refusal(key, self.bound_on(members, "-", names))
        used = class_units(members, self.classes, names)
        return _refusal_of(ledger, self.limits(key[0]), key, ledger.used_delta_from(key, used))

    # -- changing ------------------------------------------------------------------------

    def _moved(self, device: Device, phase: Phase, node: str, reason: str, code: str, held_as: str = "") -> Device:
        held_as = held_as or device.class_name
        if (device.phase, device.node, device.reason, device.reason_code, device.class_name) == (
            phase,
            node,
            reason,
            code,
            held_as,
        ):
            return device
        changed = (device.phase, device.node) != (phase, node)
        return device.placed(held_as, phase, node, self.now if changed else device.since, reason, reason_code=code)

    def apply(self, key: SetKey, devices: Iterable[Device]) -> None:
        """Make ``devices`` the set's members from now on (the ledger moves with them).

        With lending, a set is borrowed and marked as a whole: its held members share the
        flag and the mark, and a member that is not held carries neither (a released or
        re-ordered device borrows nothing). That is kept here, where every change of a set
        passes, rather than by the lending rules, which change only some of them."""
        if self.lending:
            devices = _lent_alike(key, tuple(devices), self.ledger.borrowed_sets)
        if key not in self._before:
            self._before[key] = self.ledger.devices(key)
        if key not in self._in_scope:
            # A settled set outside the scope that relieving a node moved: the later
            # steps visit it as a pass over every set would (it may now be Lost).
            self._in_scope.add(key)
            bisect.insort(self._set_keys, key)
        # Members of one set share its namespace: by name is by key.
        self.ledger.commit(key, tuple(sorted(devices, key=_by_name)))

    def with_reason(self, key: SetKey, names: Iterable[str], reason: str, *, code: str) -> None:
        """Set ``reason`` (of kind ``code``, a :class:`~binder.engine.reasons.Code`) on the
        named members without moving anything."""
        chosen = set(names)
        members = self.members(key)
        if all(d.reason == reason and d.reason_code == code for d in members if d.name in chosen):
            return
        self.apply(
            key,
            (
                d.placed(d.class_name, d.phase, d.node, d.since, reason, reason_code=code) if d.name in chosen else d
                for d in members
            ),
        )

    @staticmethod
    def bound_on(devices: Iterable[Device], node: str, names: set[str]) -> tuple[Device, ...]:
        return tuple(
            d.placed(d.class_name, Phase.BOUND, node, d.since, d.reason) if d.name in names else d for d in devices
        )

    def place(
        self,
        key: SetKey,
        moving: Sequence[Device],
        *,
        exclude: Iterable[str] = (),
        prefer: Counter[str] | None = None,
    ) -> str | None:
        """Find the node for ``moving`` (members of ``key``); None if no node has room."""
        members = self.members(key)
        names = {d.name for d in moving}
        return self.best_node(key, lambda n: self.bound_on(members, n, names), moving, exclude=exclude, prefer=prefer)

    def settle(
        self,
        key: SetKey,
        moving: Sequence[Device],
        phase: Phase,
        node: str,
        reason: str,
        held_as: str = "",
        *,
        code: str,
    ) -> None:
        """Move the ``moving`` members to ``phase`` on ``node``, saying ``reason`` (of kind
        ``code``); ``held_as``, when given, is the class they are held as from now on (one
        of their choices)."""
        if phase is Phase.BOUND:
            self.refused.discard(key)
        names = {d.name for d in moving}
        self.apply(
            key,
            (self._moved(d, phase, node, reason, code, held_as) if d.name in names else d for d in self.members(key)),
        )

    # -- result --------------------------------------------------------------------------

    def result(self, *, with_status: bool = True) -> PassResult:
        devices: list[Device] = []
        changes: list[Change] = []
        for key in sorted(self._before):
            # Members of one set share its namespace: by name is by key.
            original = {d.name: d for d in self._before[key]}
            for device in self.members(key):
                before = original[device.name]
                if device is before:
                    continue
                if (before.phase, before.node) == (device.phase, device.node) and device.since != before.since:
                    device = device.placed(device.class_name, device.phase, device.node, before.since, device.reason)
                if (before.phase, before.node, before.borrowed) != (device.phase, device.node, device.borrowed):
                    # A placement change, or a set that stops (or starts) borrowing where it is.
                    changes.append(
                        Change(
                            namespace=device.namespace,
                            name=device.name,
                            vm_name=device.vm_name,
                            from_phase=before.phase,
                            from_node=before.node,
                            to_phase=device.phase,
                            to_node=device.node,
                            reason=device.reason,
                            reason_code=device.reason_code,
                        )
                    )
                if device != before:
                    devices.append(device)
        class_status: dict[str, ClassStatus] = {}
        budget_used: dict[tuple[str, str], dict[str, int]] = {}
        budget_borrowed: dict[tuple[str, str], dict[str, int]] = {}
        if with_status:
            class_status = self.class_status()
            nothing: Counter[str] = Counter()
            used_of, lent_of = self.ledger.used, self.ledger.borrowed  # .get: adds no tenant
            for budget in sorted(self.budgets, key=lambda b: (b.namespace, b.name)):
                used = used_of.get(budget.namespace) or nothing
                budget_used[(budget.namespace, budget.name)] = {k: used[k] for k in sorted(budget.limits)}
                lent = lent_of.get(budget.namespace)
                budget_borrowed[(budget.namespace, budget.name)] = (
                    {k: v for k, v in sorted(lent.items()) if v} if lent else {}
                )
        self.counts[Outcome.REFUSED] = len(self.refused)
        return PassResult(
            devices=tuple(devices),
            changes=tuple(changes),
            counts=dict(self.counts),
            class_status=class_status,
            budget_used=budget_used,
            answered=tuple(self.answered),
            budget_borrowed=budget_borrowed,
            room_plans=dict(self.room_plans),
            wake_at=self.wake_at,
        )

    def class_status(self) -> dict[str, ClassStatus]:
        """Each class's allocatable, Bound and Lost units: counts the ledger keeps as sets
        change, and allocatable from the node cache (it reads nodes and classes only)."""
        bound = self.ledger.class_held[Phase.BOUND]
        lost = self.ledger.class_held[Phase.LOST]
        if self.cache.allocatable is None:
            self.cache.allocatable = {
                name: sum(
                    node.allocatable.get(cls.resource_name, 0)
                    for node in self.nodes.values()
                    if all(node.labels.get(k) == v for k, v in cls.node_selector.items())
                )
                for name, cls in self.classes.items()
            }
        allocatable = self.cache.allocatable
        return {
            name: ClassStatus(allocatable=allocatable.get(name, 0), bound=bound[name], lost=lost[name])
            for name in sorted(self.classes)
        }


_by_name = attrgetter("name")


def _lent_alike(key: SetKey, devices: tuple[Device, ...], borrowed_sets: Mapping[SetKey, object]) -> tuple[Device, ...]:
    """``devices`` with the held ones sharing one borrowed flag and mark, the others neither."""
    if key not in borrowed_sets and not any(d.borrowed or d.reclaim_for for d in devices):
        return devices  # nothing borrowed or marked: nothing to keep alike
    held = [d for d in devices if d.held]
    lent = any(d.borrowed for d in held)
    mark = next((d.reclaim_for for d in held if d.reclaim_for), "") if lent else ""
    return tuple(
        d if (d.borrowed, d.reclaim_for) == ((lent, mark) if d.held else (False, ""))
        else d.placed(d.class_name, d.phase, d.node, d.since, d.reason, borrowed=d.held and lent,
                      reclaim_for=mark if d.held else "")
        for d in devices
    )  # fmt: skip


def _rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")
