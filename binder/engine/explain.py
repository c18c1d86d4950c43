"""Why a Lost or Pending set does not fit, and what would make it fit.

The reason a pass writes ("no other node has room for the set") was true at that pass and
says nothing about what to do. Staff need, at the moment they look: how much the set needs
on one node, the largest gap a node that may take it has, who holds the rest of that node,
and which node would take it after one change (Ready again, uncordoned, some units freed).
So this is computed at display time from the one ledger the binder places by, with the
placement rules' own sentences (``refuses_new``, ``budget_refusal``), never stored.

The same numbers give the board its "largest free gap per class": free units on nodes that
may take new units of the class (NotReady, cordoned, draining, tainted-untolerated and
label-mismatched nodes count nothing free), see :func:`class_gaps`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from binder.engine.accounting import Ledger, ledger_for
from binder.engine.choices import choices_of, disagreement, has_alternatives, reclassed
from binder.engine.fit import budget_refusal, refuses_new, requested_selector_mismatch
from binder.engine.ledger_records import Holding, SetKey
from binder.engine.lending import Lending, set_id
from binder.engine.limits import effective_limits
from binder.engine.making_room import MakingRoom
from binder.engine.pass_placing import PlacingPass
from binder.engine.reasons import Code
from binder.engine.types import Cluster, Device, GpuClass, Node, Phase

#: Options ("would fit on X after …") listed per need: enough to act on, short to read.
MAX_OPTIONS = 3
#: Holders named per gap; past it a count stands in for the rest.
MAX_HOLDERS = 4


@dataclass(frozen=True, slots=True)
class Holder:
    """Who books units of a node: a set (its Bound devices), a VMI's launcher pod or a plain pod."""

    kind: str
    namespace: str
    name: str
    units: int

    def __str__(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class Option:
    """A node that would take the set after ``change`` (empty: nothing but freeing units)
    and freeing ``to_free`` units now held by ``holders``."""

    node: str
    room: int
    """Units the set could use there now: free, plus what the set itself already books there."""
    to_free: int
    change: str = ""
    holders: tuple[Holder, ...] = ()
    own: int = 0
    """Units there the set books already (its launcher pod's raw usage, its Bound devices)."""
    state: str = ""
    """The node's state ``change`` undoes: NotReady, cordoned, draining ("" otherwise)."""

    def sentence(self) -> str:
        steps = [self.change] if self.change else []
        if self.own and self.change:
            steps[0] += f"; this set already books {self.own} units there"
        if self.to_free > 0:
            steps.append(f"free {self.to_free} (held by {_holders(self.holders)})")
        if not steps:
            return f"{self.node} has room now: a pass would bind it there (retry)"
        return f"on {self.node}: " + " and ".join(steps)


@dataclass(frozen=True, slots=True)
class Need:
    """What the set needs of one GPU resource on one node, and the largest gap for it."""

    resource: str
    classes: tuple[str, ...]
    units: int
    gap_node: str = ""
    gap: int = 0
    gap_holders: tuple[Holder, ...] = ()
    options: tuple[Option, ...] = ()
    nodes_offering: int = 0
    """Nodes with at least ``units`` allocatable of the resource (whatever their state)."""

    @property
    def label(self) -> str:
        return ", ".join(self.classes) or self.resource


@dataclass(frozen=True, slots=True)
class Explanation:
    """A Lost or Pending set, explained now."""

    namespace: str
    vm: str
    phase: Phase
    devices: int
    needs: tuple[Need, ...] = ()
    problems: tuple[str, ...] = ()
    """What no room would cure: a class that does not exist, a budget the set would exceed."""
    vmi_node: str = ""
    vmi_node_not_ready_since: datetime | None = None
    vmi_node_not_ready: bool = False
    reason: str = ""
    """The reason the last pass wrote (kept beside the explanation: it says why it moved)."""
    reason_code: str = ""
    """That reason's :class:`~binder.engine.reasons.Code`: what the explanation switches on."""
    reclaim: str = ""
    """While the last pass said the set waits for reclaim (its code): the borrowed sets
    marked for it now and where, from their marks."""
    room: str = ""
    """Making room: the stopped VMs' sets a pass would move now so the set fits, and where
    (``t1/b (to n2), t1/a (to n2) off n1``); empty when no such plan exists."""
    room_over_limit: bool = False
    """The plan moves more sets than ``GPUPLANE_MOVES_PER_PASS`` allows in one pass."""

    @property
    def key(self) -> SetKey:
        return (self.namespace, self.vm)

    @property
    def summary(self) -> str:
        """One line: what the set needs and the largest gap (or what else stops it); first,
        when the last pass marked borrowed sets for it, that reclaim is what it waits for."""
        parts = list(self.problems)
        if self.reclaim:
            parts.insert(0, f"waits for reclaim: {self.reclaim}")
        for need in self.needs:
            text = f"needs {need.units} × {need.label} on one node"
            if not need.nodes_offering:
                text += f"; no node has {need.units} {need.resource} allocatable"
            elif need.gap_node:
                text += f"; the largest gap is {need.gap} on {need.gap_node}"
                held = sum(h.units for h in need.gap_holders)
                if held:
                    text += f", {held} held by {_holders(need.gap_holders)}"
            else:
                text += "; no node that may take it offers that many"
            parts.append(text)
        return "; ".join(parts)

    @property
    def room_note(self) -> str:
        """What making room would move for it now (empty: nothing would)."""
        if not self.room or self.problems:
            return ""
        if self.room_over_limit:
            return (f"making room would move {self.room}: more sets than GPUPLANE_MOVES_PER_PASS lets one pass "
                    "move, so no pass does it (raise the setting, or move some yourself)")  # fmt: skip
        return f"would fit by making room: moving {self.room} (stopped VMs' sets; the next full pass does it)"

    @property
    def vmi_note(self) -> str:
        """Where its VMI runs, flagged when that node is NotReady."""
        if not self.vmi_node:
            return ""
        if self.vmi_node_not_ready:
            since = _iso(self.vmi_node_not_ready_since) if self.vmi_node_not_ready_since else "an unknown time"
            return f"its VMI is running on {self.vmi_node}, which is NotReady since {since}"
        return f"its VMI is running on {self.vmi_node}"

    @property
    def steps(self) -> tuple[str, ...]:
        """What would fit, fewest changes first (only when nothing but room stands in the way)."""
        return tuple(option.sentence() for option in self.fits)

    @property
    def fits(self) -> tuple[Option, ...]:
        """The options behind :attr:`steps`, in the same order (the console links each to its node's action)."""
        if self.problems:
            return ()
        return tuple(option for need in self.needs for option in need.options)

    def text(self) -> str:
        """Everything in sentences (the board's panel and the device page show this)."""
        lines = [self.summary]
        if self.vmi_note:
            lines.append(self.vmi_note)
        if self.room_note:
            lines.append(self.room_note)
        if self.steps:
            lines.append("would fit: " + "; ".join(self.steps))
        return "\n".join(line for line in lines if line)


def _iso(moment: datetime) -> str:
    return moment.isoformat(timespec="seconds")


def _holders(holders: Iterable[Holder]) -> str:
    items = list(holders)
    named = ", ".join(f"{h} ({h.units})" for h in items[:MAX_HOLDERS])
    return named + (f" and {len(items) - MAX_HOLDERS} more" if len(items) > MAX_HOLDERS else "")


def holders_of(holdings: Iterable[Holding], resource: str, exclude: SetKey | None = None) -> tuple[Holder, ...]:
    """Who books ``resource`` on a node, largest first: sets by their Bound devices, pods
    by their raw usage (a launcher pod named so). ``exclude``'s own units are left out."""
    units: Counter[tuple[str, str, str]] = Counter()
    for holding in holdings:
        if holding.resource != resource:
            continue
        if holding.device is not None:
            if holding.device.set_key == exclude:
                continue
            units[("set", holding.device.namespace, holding.device.vm_name)] += holding.units
        elif holding.pod is not None:
            launcher = holding.launcher
            if launcher is not None and (launcher.namespace, launcher.name) == exclude:
                continue
            kind = "launcher pod" if launcher is not None else "pod"
            units[(kind, holding.pod.namespace, holding.pod.name)] += holding.units
    ranked = sorted(units.items(), key=lambda item: (-item[1], item[0]))
    return tuple(Holder(kind, ns, name, n) for (kind, ns, name), n in ranked)


@dataclass
class Explainer:
    """Explains sets of one cluster snapshot; caches what many sets share (the nodes that
    may take a class, ranked by free units), so explaining every Lost set of a 10,000-node
    cluster is one scan of the nodes per class, not one per set."""

    cluster: Cluster
    ledger: Ledger
    holdings: Mapping[str, list[Holding]] = field(default_factory=dict)
    _ranked: dict[tuple[tuple[str, ...], str, frozenset[tuple[str, str]]], list[tuple[int, str, str]]] = field(
        default_factory=dict
    )
    _base: dict[tuple[tuple[tuple[str, ...], str, frozenset[tuple[str, str]]], int], _Base] = field(
        default_factory=dict
    )

    def __post_init__(self) -> None:
        self._room: MakingRoom | None = None
        self.classes: dict[str, GpuClass] = {c.name: c for c in self.cluster.classes}
        self.nodes: dict[str, Node] = {n.name: n for n in self.cluster.nodes}
        self.vmis = {(v.namespace, v.name): v for v in self.cluster.vmis}
        if not self.holdings:
            self.holdings = self.ledger.holdings()

    def explain(self, key: SetKey, members: tuple[Device, ...] | None = None) -> Explanation:
        """The explanation of set ``key`` (its devices from the ledger unless given)."""
        devices = members if members is not None else self.ledger.devices(key)
        waiting = [d for d in devices if d.phase is not Phase.BOUND]
        phase = Phase.LOST if any(d.phase is Phase.LOST for d in waiting) else Phase.PENDING
        # A set with alternatives may be placed as any of its classes: each one's needs.
        ways = [devices]
        if has_alternatives(devices) and not disagreement(devices):
            everyone = {d.name for d in devices}
            ways = [reclassed(devices, everyone, choice) for choice in choices_of(devices[0])]
        missing = [sorted({d.class_name for d in way} - set(self.classes)) for way in ways]
        problems = [f"class {name} does not exist" for name in min(missing, key=len)] if all(missing) else []
        own = self.ledger.contribution(key, devices).booked
        needs_of_ways: list[Need] = []
        for way in ways:
            known = [d for d in way if d.class_name in self.classes]
            if len(ways) > 1 and len(known) < len(way):
                continue  # a choice whose class does not exist has nothing to show
            # The whole set goes to one node: what it needs there, per resource.
            need: Counter[str] = Counter()
            names: dict[str, set[str]] = defaultdict(set)
            for device in known:
                cls = self.classes[device.class_name]
                need[cls.resource_name] += cls.units_per_device
                names[cls.resource_name].add(cls.name)
            needs_of_ways.extend(
                self._need(key, known, resource, units, tuple(sorted(names[resource])), own)
                for resource, units in sorted(need.items())
            )
        needs = tuple(needs_of_ways)
        if not problems and needs:
            limits = effective_limits(
                (b for b in self.cluster.budgets if b.namespace == key[0]), self.cluster.settings.default_budget
            )
            target = next((n.gap_node for n in needs if n.gap_node), "")
            candidate = tuple(replace(d, phase=Phase.BOUND, node=target) for d in devices)
            refusal = budget_refusal(self.ledger, limits, key, candidate)
            if refusal:
                problems.append(refusal)
        vmi = self.vmis.get(key)
        vmi_node = vmi.node if vmi is not None and vmi.phase == "Running" else ""
        code = waiting[0].reason_code if waiting else ""
        node = self.nodes.get(vmi_node)
        return Explanation(
            namespace=key[0],
            vm=key[1],
            phase=phase,
            devices=len(devices),
            needs=needs,
            problems=tuple(problems),
            vmi_node=vmi_node,
            vmi_node_not_ready=bool(vmi_node) and (node is None or not node.ready),
            vmi_node_not_ready_since=node.ready_since if node is not None and not node.ready else None,
            reason=waiting[0].reason if waiting else "",
            reason_code=code,
            reclaim=self._marked_for(key) if code == Code.WAITS_FOR_RECLAIM else "",
            **self._room_plan(key, problems, code),
        )

    def _room_plan(self, key: SetKey, problems: list[str], code: str) -> dict[str, Any]:
        """The plan making room would carry out for the set now (``binder.engine.making_room``:
        the same rule over this snapshot, nothing moved), as :class:`Explanation` fields."""
        settings = self.cluster.settings
        if (
            problems
            or code == Code.WAITS_FOR_RECLAIM
            or not self.cluster.virtual_machines
            or settings.moves_per_pass <= 0
        ):
            return {}
        if self._room is None:
            run = PlacingPass(self.cluster, ledger=self.ledger)
            self._room = MakingRoom(run, Lending(run))
        plan = self._room.plan(key)
        if plan is None:
            return {}
        return {"room": plan.describe(), "room_over_limit": len(plan.moves) > settings.moves_per_pass}

    def _marked_for(self, key: SetKey) -> str:
        """``t1/a, t1/b on n1, borrowed and marked for it, waits for its VM to stop``: the
        borrowed sets whose ``reclaim_for`` names ``key``, by node (empty: none now)."""
        me = set_id(key)
        by_node: dict[str, list[str]] = defaultdict(list)
        for other in sorted(self.ledger.marked_sets):
            members = self.ledger.devices(other)
            if members and members[0].reclaim_for == me:
                by_node[members[0].node].append(set_id(other))
        if not by_node:
            return ""
        where = "; ".join(f"{', '.join(sets)} on {node}" for node, sets in sorted(by_node.items()))
        return f"{where}, borrowed and marked for it, waits for its VM to stop"

    def _need(
        self,
        key: SetKey,
        devices: list[Device],
        resource: str,
        units: int,
        class_names: tuple[str, ...],
        own: Mapping[tuple[str, str], int],
    ) -> Need:
        classes = [self.classes[name] for name in class_names]
        cache_key = (class_names, resource, frozenset((d.name, d.bind_request) for d in devices if d.wants_answer))
        ranked = self._ranked.get(cache_key)
        if ranked is None:
            ranked = []
            for node in self.nodes.values():
                if node.allocatable.get(resource, 0) <= 0:
                    continue
                why = refuses_new(node, classes) or requested_selector_mismatch(node, devices) or ""
                ranked.append((self.ledger.free(node.name, resource), node.name, why))
            ranked.sort(key=lambda r: (-r[0], r[1]))
            self._ranked[cache_key] = ranked
        base = self._base.get((cache_key, units))
        if base is None:
            big = [r for r in ranked if self.nodes[r[1]].allocatable.get(resource, 0) >= units]
            base = _Base(
                takers=[r for r in big if not r[2]],
                options=sorted(big, key=lambda r: _option_order(r, units)),
                by_name={r[1]: r for r in big},
            )
            self._base[(cache_key, units)] = base
        # The set's own units (its launcher pod's raw booking, its Bound devices) are room
        # for it on their node: only those few nodes differ from the shared ranking, and
        # extra room only moves a node up, so the shared top entries plus them suffice.
        mine = {name for (name, res) in own if res == resource and name in base.by_name}

        def with_own(r: tuple[int, str, str]) -> tuple[int, str, str]:
            return (r[0] + own.get((r[1], resource), 0), r[1], r[2])

        adjusted = [with_own(base.by_name[name]) for name in sorted(mine)]
        takers = [r for r in base.takers[: 1 + len(mine)] if r[1] not in mine] + [r for r in adjusted if not r[2]]
        gap = min(takers, key=lambda r: (-r[0], r[1]), default=None)
        # Fewest changes first: units to free, then a state staff can change (Ready,
        # cordon, drain) before a label or taint mismatch, which is last of all.
        shared = [r for r in base.options[: MAX_OPTIONS + len(mine)] if r[1] not in mine]
        candidates = sorted(shared + adjusted, key=lambda r: _option_order(r, units))
        big_enough = base.by_name
        options = []
        for room, name, why in candidates[:MAX_OPTIONS]:
            change = _change(why, self.nodes[name]) if why else ""
            to_free = max(0, units - room)
            held = holders_of(self.holdings.get(name, ()), resource, key) if to_free else ()
            options.append(Option(name, max(room, 0), to_free, change, held, own.get((name, resource), 0), _state(why)))
        return Need(
            resource=resource,
            classes=class_names,
            units=units,
            gap_node=gap[1] if gap else "",
            gap=max(gap[0], 0) if gap else 0,
            gap_holders=holders_of(self.holdings.get(gap[1], ()), resource, key) if gap and gap[0] < units else (),
            options=tuple(options),
            nodes_offering=len(big_enough),
        )


@dataclass(frozen=True, slots=True)
class _Base:
    """Nodes with enough allocatable for a need, ranked once per class, selector and size."""

    takers: list[tuple[int, str, str]]
    """Nodes that may take it, the most free first."""
    options: list[tuple[int, str, str]]
    """Every such node in the order options are offered."""
    by_name: dict[str, tuple[int, str, str]]


def _option_order(entry: tuple[int, str, str], units: int) -> tuple[bool, int, int, str]:
    room, name, why = entry
    return (_rank(why) == 2, max(0, units - room), _rank(why), name)


def _rank(why: str) -> int:
    """0: the node may take the set; 1: a state staff change (Ready, cordon, drain); 2: labels, taints."""
    if not why:
        return 0
    return 1 if why in ("NotReady", "cordoned", "draining") else 2


def _state(why: str) -> str:
    """The node state a staff action undoes, from ``refuses_new``'s reason ("" for others)."""
    return why if _rank(why) == 1 else ""


def _change(why: str, node: Node) -> str:
    """The change that would let ``node`` take new units, from ``refuses_new``'s reason."""
    if why == "NotReady":
        since = f" (NotReady since {_iso(node.ready_since)})" if node.ready_since else ""
        return f"bring it back to Ready{since}"
    if why == "cordoned":
        return "uncordon it"
    if why == "draining":
        return "stop draining it (remove the gpuplane.io/drain label)"
    return f"change the node: {why}"


def explain_sets(cluster: Cluster, ledger: Ledger | None = None) -> dict[SetKey, Explanation]:
    """Every set with a Lost or Pending device, explained (sorted by namespace and VM)."""
    ledger = ledger if ledger is not None else ledger_for(cluster)
    explainer = Explainer(cluster, ledger)
    keys = sorted({d.set_key for d in cluster.devices if d.phase is not Phase.BOUND})
    return {key: explainer.explain(key) for key in keys}


@dataclass(frozen=True, slots=True)
class ClassGap:
    """A class's free units where it may go now: in all, and the largest gap on one node."""

    class_name: str
    resource: str
    free: int
    largest: int
    node: str


def takes_new(node: Node, classes: Iterable[GpuClass]) -> bool:
    """Whether ``node`` may take new units of ``classes`` (the placement rule's test)."""
    return refuses_new(node, classes) is None


def class_gaps(cluster: Cluster, ledger: Ledger) -> list[ClassGap]:
    """Per class: free units on nodes that may take it, and the largest gap among them
    (in devices' units: a class of 2 units per device counts whole devices' worth)."""
    out = []
    for cls in sorted(cluster.classes, key=lambda c: c.name):
        free = largest = 0
        where = ""
        for node in cluster.nodes:
            if node.allocatable.get(cls.resource_name, 0) <= 0 or not takes_new(node, (cls,)):
                continue
            units = max(0, ledger.free(node.name, cls.resource_name))
            free += units
            if units > largest or (units == largest and units and node.name < where):
                largest, where = units, node.name
        out.append(ClassGap(cls.name, cls.resource_name, free, largest, where))
    return out
