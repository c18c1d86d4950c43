"""The binder's passes (SPEC §4): where every GPU set lives, decided in one place.

The binder is the only writer of placement, and a pass sees the whole cluster at one
moment, so capacity and budget checks here cannot be raced past. The rules run in a
fixed order (restore sets, move sets off nodes that cannot keep them, rebind Lost sets,
bind new orders, answer bind requests) over sets sorted by stable keys, so the same
input always gives the same decisions. Each step changes whole sets only: step 1
first makes every set whole again, whatever a half-failed write left behind.

``full_pass`` and ``answer_pass`` take a :class:`Cluster` and return a
:class:`PassResult`; they never mutate their input and never do I/O.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime

from binder.engine.accounting import Ledger, Limits, SetKey, effective_limits, is_raw_key, ledger_for
from binder.engine.choices import (
    choices_of,
    disagreement,
    has_alternatives,
    passed_over,
    placed_as,
    reclassed,
    spec_class,
)
from binder.engine.types import (
    Budget,
    Change,
    ClassStatus,
    Cluster,
    Device,
    GpuClass,
    Node,
    Outcome,
    PassResult,
    Phase,
)

#: Answer prefixes written to ``status.answer``; the webhook reads them.
ANSWER_BOUND = "bound:"
ANSWER_REFUSED = "refused:"

REASON_BOUND = "bound: fullest node with room"

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


EligibleKey = tuple[frozenset[str], frozenset[tuple[str, str]]]


@dataclasses.dataclass
class NodeCache:
    """What the engine derives from nodes and classes alone, kept by a caller between
    passes: replaced whenever a class changes, and brought current node by node
    (:meth:`node_changed`) when a node changes, so a node's heartbeat costs that node,
    not a sweep of the cluster."""

    #: Nodes that may take new units, per (class names, requested nodeSelector); see
    #: ``_Pass.eligible_nodes``.
    eligible: dict[EligibleKey, set[str]] = dataclasses.field(default_factory=dict)
    #: Nodes whose taint some of these classes do not tolerate, with why (refusal notes).
    tainted: dict[frozenset[str], tuple[tuple[str, str], ...]] = dataclasses.field(default_factory=dict)
    #: Allocatable units of each class's resource on the nodes its selector matches.
    allocatable: dict[str, int] | None = None
    #: The nodes by name and their sorted names (an answer pass at 10k nodes spent more
    #: building these than placing its set).
    nodes: dict[str, Node] | None = None
    node_names: list[str] | None = None
    #: The classes the sets below were worked out with (the cache is replaced when one changes).
    classes: dict[str, GpuClass] = dataclasses.field(default_factory=dict)
    #: Nodes that take new units of one class (Ready, schedulable, not draining, its
    #: selector matched, its taints tolerated), per class name; key ``""``: of no class.
    per_class: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    #: Nodes per (label, value), for a bind request's own nodeSelector (built on first use).
    labelled: dict[tuple[str, str], set[str]] | None = None

    def index(self, nodes: Iterable[Node]) -> tuple[Mapping[str, Node], Sequence[str]]:
        """``nodes`` by name and their sorted names, built once per cache."""
        if self.nodes is None or self.node_names is None:
            self.nodes = {n.name: n for n in nodes}
            self.node_names = sorted(self.nodes)
        return self.nodes, self.node_names

    def prepare(self, nodes: Iterable[Node], classes: Iterable[GpuClass]) -> None:
        """Work out each class's eligible nodes now (a sweep of the nodes per class), so
        the first order of a class after a start does not pay for it."""
        self.index(nodes)
        self.classes = {c.name: c for c in classes}
        for name in ("", *sorted(self.classes)):
            self._class_set(name)

    def eligible_for(self, key: EligibleKey, classes: Mapping[str, GpuClass]) -> set[str]:
        """The nodes that may take new units of ``key``'s classes and requested selector.

        Worked out once per class (one sweep of the nodes) and per label; a combination
        of classes and labels is then an intersection of those sets.
        """
        cached = self.eligible.get(key)
        if cached is not None:
            return cached
        names, selector = key
        present = sorted(n for n in names if n in classes) or [""]
        sets = sorted((self._class_set(name) for name in present), key=len)
        found = set(sets[0]).intersection(*sets[1:])
        if selector:
            labelled = self._labelled()
            for pair in selector:
                found &= labelled.get(pair, set())
        self.eligible[key] = found
        return found

    def _class_set(self, name: str) -> set[str]:
        found = self.per_class.get(name)
        if found is None:
            classes = (self.classes[name],) if name else ()
            found = {n for n, node in (self.nodes or {}).items() if refuses_new(node, classes) is None}
            self.per_class[name] = found
        return found

    def _labelled(self) -> dict[tuple[str, str], set[str]]:
        if self.labelled is None:
            self.labelled = defaultdict(set)
            for name, node in (self.nodes or {}).items():
                for pair in node.labels.items():
                    self.labelled[pair].add(name)
        return self.labelled

    def _takes(self, node: Node, key: EligibleKey) -> bool:
        names, selector = key
        classes = [self.classes[n] for n in sorted(names) if n in self.classes]
        return refuses_new(node, classes) is None and all(node.labels.get(k) == v for k, v in selector)

    def node_changed(self, name: str, node: Node | None) -> None:
        """Node ``name`` is now ``node`` (None: deleted): update everything derived from it."""
        if self.nodes is None or self.node_names is None:
            return
        old = self.nodes.get(name)
        if node is None:
            self.nodes.pop(name, None)
            if old is not None:
                del self.node_names[bisect.bisect_left(self.node_names, name)]
        else:
            self.nodes[name] = node
            if old is None:
                bisect.insort(self.node_names, name)
        for cls_name, found in self.per_class.items():
            classes = (self.classes[cls_name],) if cls_name else ()
            _put(found, name, node is not None and refuses_new(node, classes) is None)
        for key, found in self.eligible.items():
            _put(found, name, node is not None and self._takes(node, key))
        if self.labelled is not None:
            for pair in old.labels.items() if old is not None else ():
                self.labelled[pair].discard(name)
            for pair in node.labels.items() if node is not None else ():
                self.labelled[pair].add(name)
        self._retaint(name, node)
        if self.allocatable is not None:
            self._reallocate(old, node)

    def _retaint(self, name: str, node: Node | None) -> None:
        for cls_key, tainted in list(self.tainted.items()):
            kept = [t for t in tainted if t[0] != name]
            why = untolerated_taint(node, self._sorted_classes(cls_key)) if node is not None else None
            if why:
                bisect.insort(kept, (name, why))
            self.tainted[cls_key] = tuple(kept)

    def _reallocate(self, old: Node | None, new: Node | None) -> None:
        allocatable = self.allocatable if self.allocatable is not None else {}
        for cls_name, cls in self.classes.items():
            for sign, n in ((-1, old), (1, new)):
                if n is not None and all(n.labels.get(k) == v for k, v in cls.node_selector.items()):
                    allocatable[cls_name] = allocatable.get(cls_name, 0) + sign * n.allocatable.get(
                        cls.resource_name, 0
                    )

    def _sorted_classes(self, names: frozenset[str]) -> list[GpuClass]:
        return [self.classes[n] for n in sorted(names) if n in self.classes]


def _put(found: set[str], name: str, member: bool) -> None:
    if member:
        found.add(name)
    else:
        found.discard(name)


def is_settled(members: Sequence[Device], nodes: Mapping[str, Node], classes: Mapping[str, GpuClass]) -> bool:
    """Whether a full pass provably leaves the set ``members`` alone, whatever else changes.

    A set is settled when every member is Bound on one Ready node that exists, is not
    draining and matches every member's class, every class exists, and no member waits
    for an answer. Then no step of a full pass acts on it: nothing to restore, gather or
    grow (step 1), its node can keep it (step 2; NotReady nodes count as unsettled even
    inside their grace period, so the clock never has to be consulted), it is neither
    Lost (step 3) nor an order (step 4), nor asks (step 5). The one step that may still
    move it is relieving an over-booked node, which finds its residents through the
    ledger, not through the scope. A worker can therefore give :func:`full_pass` only the
    unsettled sets (``scope``) and get the decisions of a pass over everything.
    """
    if not members:
        return True
    node_name = members[0].node
    node = nodes.get(node_name)
    if node is None or not node.ready or node.draining:
        return False
    for device in members:
        if (
            device.phase is not Phase.BOUND
            or device.node != node_name
            or device.class_name not in classes
            or device.wants_answer
        ):
            return False
    names = sorted({d.class_name for d in members})
    return selector_mismatch(node, [classes[name] for name in names]) is None


def full_pass(
    cluster: Cluster,
    ledger: Ledger | None = None,
    cache: NodeCache | None = None,
    scope: Iterable[SetKey] | None = None,
) -> PassResult:
    """Run every step of a full pass over the whole cluster.

    ``ledger``, when given, must be ``ledger_for(cluster)`` (a worker keeps one between
    passes instead of rebuilding it); the pass moves sets in it, so afterwards it is the
    ledger of the result. ``cache``, when given, is a :class:`NodeCache` the caller keeps
    between passes and replaces whenever a node or a class changes. ``scope``, when
    given, lists the sets the steps visit: it must hold every set that is not
    :func:`is_settled` (more does no harm), and the result is then the same as over
    every set, at the cost of the sets that can change.
    """
    run = _Pass(cluster, ledger, cache, scope)
    if cluster.settings.enabled:
        run.restore_sets()
        run.move_off_unfit_nodes()
        # Step 3, then the growth step 1 could not do yet. A growing set that moves whole
        # frees room on its old node: Lost sets get it first, then growth again. Each
        # round places a Pending or Lost device, so this ends; new orders come last, so
        # a second pass finds nothing left to place.
        run.rebind_lost_sets()
        while True:
            run.room_freed = False
            run.grow_sets()
            if not run.room_freed:
                break
            run.rebind_lost_sets()
        run.bind_orders()
        run.answer_requests(run.set_keys())
    return run.result()


def answer_pass(cluster: Cluster, ledger: Ledger | None = None, cache: NodeCache | None = None) -> PassResult:
    """Answer unanswered bind requests, placing only the requested sets; nothing else.

    With ``ledger`` (the ledger of the whole cluster, moved in place), ``cluster`` needs
    to hold only the requested sets (whole), their tenants' budgets, the nodes and the
    classes: booked units and usage come from the ledger (SPEC §4: an answer pass reads
    only what it needs). ``cache`` as for :func:`full_pass`.
    """
    run = _Pass(cluster, ledger, cache)
    if cluster.settings.enabled:
        keys = sorted({d.set_key for d in cluster.devices if d.wants_answer})
        for key in keys:
            run.settle_requested_set(key)
        run.answer_requests(keys)
    return run.result(with_status=False)


def try_order(cluster: Cluster, key: SetKey, ledger: Ledger | None = None) -> tuple[Device, ...]:
    """The members of the order ``key`` (all Pending, in ``cluster`` or in ``ledger``, which
    the pass changes) as binding new orders would place them now, with nothing else moved:
    the catalog's "would it fit, and as which class" answered by the binder's own rules."""
    run = _Pass(cluster, ledger=ledger, scope=[key])
    if cluster.settings.enabled:
        run.bind_order(key)
    return run.members(key)


def budget_refusal(ledger: Ledger, limits: Limits, key: SetKey, candidate: tuple[Device, ...]) -> str | None:
    """Why making ``candidate`` the devices of set ``key`` would push its tenant over a
    budget, or None.

    A module function (not only a pass method) so the admission webhook's advisory check
    gives the very sentence the binder would: same ledger, same limits, same words. An
    order whose members accept several classes is over budget only when every choice is:
    the sentence then names each choice and why.
    """
    refusal = _budget_refusal(ledger, limits, key, candidate)
    if refusal is None or any(d.held for d in ledger.devices(key)):
        return refusal
    placing = [d for d in candidate if d.held]
    if not has_alternatives(placing) or disagreement(candidate):
        return refusal
    names = {d.name for d in placing}
    notes = []
    for choice in choices_of(placing[0]):
        if choice not in ledger.classes:
            notes.append((choice, f"class {choice} does not exist"))
            continue
        why = _budget_refusal(ledger, limits, key, reclassed(candidate, names, choice))
        if why is None:
            return None
        notes.append((choice, why))
    return f"over budget for every class the set accepts: {passed_over(notes)}"


def _budget_refusal(ledger: Ledger, limits: Limits, key: SetKey, candidate: tuple[Device, ...]) -> str | None:
    """``budget_refusal`` for ``candidate`` as it is (each device as its own class)."""
    namespace = key[0]
    delta = ledger.delta(key, candidate)
    for budget_key in sorted(delta.used):
        more = delta.used[budget_key]
        if more <= 0:
            continue
        limit = limits.limit(budget_key)
        used = ledger.used[namespace][budget_key]
        if limit is not None and used + more > limit:
            kind = "raw" if is_raw_key(budget_key) else "class"
            source = "default budget (deny)" if limits.deny_rest else "budget"
            return (
                f"over budget: {kind} key {budget_key} has limit {limit} in the {source}, "
                f"{used} used, and this set needs {more} more"
            )
    return None


def selector_mismatch(node: Node, classes: Iterable[GpuClass]) -> str | None:
    """The first class nodeSelector label ``node`` lacks, as a sentence, or None."""
    for cls in classes:
        for label, value in sorted(cls.node_selector.items()):
            if node.labels.get(label) != value:
                return f"class {cls.name} needs node label {label}={value}"
    return None


def untolerated_taint(node: Node, classes: Iterable[GpuClass]) -> str | None:
    """The first NoSchedule/NoExecute taint of ``node`` some class of ``classes`` does not
    tolerate, as a sentence, or None (SPEC §4 step 2).

    The launcher pod carries the classes' tolerations (the webhook adds them), so a node
    whose taint one of them does not tolerate could never run the VM: it takes no new
    devices of that class. Taints under ``node.kubernetes.io/`` are the Ready and cordon
    rules' business. Only new placements ask this: a taint never moves a held set.
    """
    blocking = [t for t in node.taints if t.blocks_new]
    if not blocking:
        return None
    for cls in classes:
        for taint in blocking:
            if not any(t.tolerates(taint) for t in cls.tolerations):
                return f"node has taint {taint}, which class {cls.name} does not tolerate"
    return None


#: Joins the values one label was asked with in two ways: no node label holds a NUL (the
#: parser refuses it), so such a label matches no node, and the refusal names both values.
_CONFLICT = "\x00"


def _label(label: str, value: str) -> str:
    if _CONFLICT in value:
        return f"{label} (conflicting values {' and '.join(value.split(_CONFLICT))})"
    return f"{label}={value}"


def _labels(selector: Mapping[str, str]) -> str:
    return ", ".join(_label(k, v) for k, v in sorted(selector.items()))


def requested_selector(devices: Iterable[Device]) -> dict[str, str]:
    """The VMI nodeSelector of the devices' unanswered bind requests (SPEC §5 step 4).

    The webhook writes the same selector on every device of the set; should two differ
    (a request rewritten half way), both hold, and a label asked two ways matches no node.
    """
    selector: dict[str, str] = {}
    for device in devices:
        if device.wants_answer:
            for label, value in device.bind_node_selector.items():
                asked = selector.setdefault(label, value).split(_CONFLICT)
                if value not in asked:
                    selector[label] = _CONFLICT.join(sorted({*asked, value}))
    return selector


def requested_selector_mismatch(node: Node, devices: Iterable[Device]) -> str | None:
    """The first label of the VMI's nodeSelector (written with an unanswered bind request)
    that ``node`` lacks, as a sentence, or None: the set's launcher could not run there."""
    for label, value in sorted(requested_selector(devices).items()):
        if node.labels.get(label) != value:
            return f"the VMI's nodeSelector needs node label {_label(label, value)}"
    return None


def refuses_new(node: Node, classes: Iterable[GpuClass]) -> str | None:
    """Why ``node`` takes no new devices of ``classes`` now (SPEC §4 step 4), or None.

    The binder places by this rule and the catalog counts free units by it: one copy.
    """
    if not node.ready:
        return "NotReady"
    if node.unschedulable:
        return "cordoned"
    if node.draining:
        return "draining"
    classes = tuple(classes)
    return selector_mismatch(node, classes) or untolerated_taint(node, classes)


def describe_units(units: Counter[str]) -> str:
    """``2 x nvidia.com/A, 1 x nvidia.com/B``."""
    return ", ".join(f"{n} x {r}" for r, n in sorted(units.items()) if n)


class _Pass:
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
        self.ledger = ledger if ledger is not None else ledger_for(cluster)
        self._set_keys = sorted(set(scope) if scope is not None else {d.set_key for d in cluster.devices})
        self._in_scope = set(self._set_keys)
        by_ns: dict[str, list[Budget]] = defaultdict(list)
        for budget in cluster.budgets:
            by_ns[budget.namespace].append(budget)
        self._budgets_by_ns = by_ns
        self.counts: Counter[str] = Counter({o.value: 0 for o in Outcome})
        #: Sets this pass sent to Lost: failing to rebind them right away is no new refusal.
        self._lost_now: set[SetKey] = set()
        #: Sets this pass could not place (counted once, however many sweeps tried them).
        self.refused: set[SetKey] = set()
        self.answered: list[tuple[str, str]] = []
        #: Set when a growing set moved whole this sweep, freeing its old node's units.
        self.room_freed = False

    # -- reading -------------------------------------------------------------------------

    def set_keys(self) -> list[SetKey]:
        return list(self._set_keys)

    def members(self, key: SetKey) -> tuple[Device, ...]:
        return self.ledger.devices(key)

    def limits(self, namespace: str) -> Limits:
        return effective_limits(self._budgets_by_ns.get(namespace, ()), self.settings.default_budget)

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

    def best_node(  # noqa: C901 - SPEC §4 step 4: each node condition is one branch
        self,
        key: SetKey,
        placed_on: Callable[[str], tuple[Device, ...]],
        moving: Sequence[Device],
        exclude: Iterable[str] = (),
        prefer: Counter[str] | None = None,
    ) -> str | None:
        """The fullest node with room for ``moving`` (SPEC §4 step 4), or None.

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
        prefer = prefer or Counter()
        eligible = self.eligible_nodes(moving)
        best: tuple[int, int, str] | None = None

        def consider(name: str, left: int | None) -> None:
            nonlocal best
            if left is None:
                return
            rank = (-prefer[name], left, name)
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

    # -- changing ------------------------------------------------------------------------

    def _moved(self, device: Device, phase: Phase, node: str, reason: str, held_as: str = "") -> Device:
        held_as = held_as or device.class_name
        if (device.phase, device.node, device.reason, device.class_name) == (phase, node, reason, held_as):
            return device
        changed = (device.phase, device.node) != (phase, node)
        return dataclasses.replace(
            device,
            class_name=held_as,
            phase=phase,
            node=node,
            reason=reason,
            since=self.now if changed else device.since,
        )

    def apply(self, key: SetKey, devices: Iterable[Device]) -> None:
        if key not in self._before:
            self._before[key] = self.ledger.devices(key)
        if key not in self._in_scope:
            # A settled set outside the scope that relieving a node moved: the later
            # steps visit it as a pass over every set would (it may now be Lost).
            self._in_scope.add(key)
            bisect.insort(self._set_keys, key)
        self.ledger.commit(key, tuple(sorted(devices, key=lambda d: d.key)))

    def with_reason(self, key: SetKey, names: Iterable[str], reason: str) -> None:
        """Set ``reason`` on the named members without moving anything."""
        chosen = set(names)
        members = self.members(key)
        if all(d.reason == reason for d in members if d.name in chosen):
            return
        self.apply(key, (dataclasses.replace(d, reason=reason) if d.name in chosen else d for d in members))

    @staticmethod
    def _bound_on(devices: Iterable[Device], node: str, names: set[str]) -> tuple[Device, ...]:
        return tuple(dataclasses.replace(d, phase=Phase.BOUND, node=node) if d.name in names else d for d in devices)

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
        return self.best_node(key, lambda n: self._bound_on(members, n, names), moving, exclude=exclude, prefer=prefer)

    def settle(
        self, key: SetKey, moving: Sequence[Device], phase: Phase, node: str, reason: str, held_as: str = ""
    ) -> None:
        """Move the ``moving`` members to ``phase`` on ``node``; ``held_as``, when given,
        is the class they are held as from now on (one of their choices)."""
        if phase is Phase.BOUND:
            self.refused.discard(key)
        names = {d.name for d in moving}
        self.apply(
            key, (self._moved(d, phase, node, reason, held_as) if d.name in names else d for d in self.members(key))
        )

    # -- step 1: restore sets ------------------------------------------------------------

    def restore_sets(self) -> None:
        for key in self.set_keys():
            self.release_classless(key)
            held = [d for d in self.members(key) if d.held]
            if len({(d.phase, d.node) for d in held}) > 1:
                self.gather(key)
            self.grow(key, allow_move=True, final=False)

    def grow_sets(self) -> None:
        """Retry growing sets whose new members step 1 could not place (before new orders)."""
        for key in self.set_keys():
            self.grow(key, allow_move=True)

    def release_classless(self, key: SetKey) -> None:
        """Devices whose class does not exist hold nothing and wait, Pending, saying why."""
        for device in self.members(key):
            if device.class_name in self.classes:
                continue
            if device.phase is Phase.PENDING and len(device.choices) > 1:
                continue  # its order's reason covers every choice
            missing = f"pending: class {device.class_name} does not exist"
            if device.phase is not Phase.PENDING:
                released = f"{missing}; the device's units were released"
                self.settle(key, [device], Phase.PENDING, "", released, held_as=spec_class(device))
            elif not device.reason.startswith(missing):
                self.with_reason(key, [device.name], missing)

    def gather(self, key: SetKey) -> None:
        held = [d for d in self.members(key) if d.held]
        layout = sorted({d.node if d.phase is Phase.BOUND else "Lost" for d in held})
        split = f"it was split across {', '.join(layout)}"
        prefer: Counter[str] = Counter()
        for device in held:
            if device.phase is Phase.BOUND:
                prefer[device.node] += self.units([device]).total()
        self.place_or_lose(
            key,
            held,
            Outcome.RESTORED,
            lambda node: f"restored: set gathered onto {node} ({split})",
            f"lost: no node has room for the whole set ({split})",
            prefer=prefer,
        )

    def grow(self, key: SetKey, *, allow_move: bool, final: bool = True) -> None:
        """New Pending members of a Bound set: grow on its node, else move whole (step 1).

        Step 1 tries first (``final=False``: a refusal is not counted yet); the full pass
        tries again once steps 2-3 may have freed room, so a second pass has nothing left
        to do.
        """
        members = self.members(key)
        held = [d for d in members if d.held]
        joined = self.join_as_held(key, members, held)
        if joined is None:
            return
        members, held_as = joined
        fresh = [d for d in members if d.phase is Phase.PENDING and d.class_name in self.classes]
        if not held or not fresh or len({(d.phase, d.node) for d in held}) > 1:
            return
        if held[0].phase is Phase.LOST:
            reason = "pending: waiting for the rest of the set, which is Lost, to be rebound"
            self.with_reason(key, (d.name for d in fresh), reason)
            return
        node = held[0].node
        names = {d.name for d in fresh}
        refusal = self.budget_refusal(key, self._bound_on(members, node, names))
        if refusal:
            self.with_reason(key, names, f"pending: {refusal}")
            if final:
                self.refused.add(key)
            return
        if not self.cannot_take(node, fresh) and self.fit(key, self._bound_on(members, node, names), node) is not None:
            self.settle(key, fresh, Phase.BOUND, node, f"bound: the set grew on its node {node}", held_as)
            self.counts[Outcome.BOUND] += 1
            return
        whole = held + fresh
        target = None
        if allow_move:
            if held_as:
                target = self.place_choosing(key, whole, (held_as,), exclude=[node])[0]
            else:
                target = self.place(key, whole, exclude=[node])
        if target is not None:
            self.settle(key, held, Phase.BOUND, target, f"moved from {node}: the set grew and {node} has no room")
            self.settle(key, fresh, Phase.BOUND, target, REASON_BOUND, held_as)
            self.counts[Outcome.MOVED] += 1
            self.room_freed = True
            return
        where = f"on {node} or any node with room for the whole set" if allow_move else f"on {node}"
        self.with_reason(key, names, f"pending: no room for {describe_units(self.units(fresh))} {where}")
        if final:
            self.refused.add(key)

    # -- step 2: move held sets off nodes that cannot keep them --------------------------

    def move_off_unfit_nodes(self) -> None:
        for key in self.set_keys():
            held = [d for d in self.members(key) if d.phase is Phase.BOUND]
            if held and len({d.node for d in held}) == 1:
                why = self.cannot_keep(held[0].node, held)
                if why:
                    self.move(key, held[0].node, why)
        # Over-booked nodes in name order, each judged when its turn comes (as a sweep of
        # every node would): a set moved off one node can leave its launcher pod booking
        # raw units on another.
        last = ""
        while True:
            later = [n for n in self.ledger.over_booked_nodes() if n > last and n in self.nodes]
            if not later:
                break
            last = later[0]
            self.relieve(last)

    def relieve(self, node: str) -> None:
        """Evict the most recently bound sets from an over-booked node until it fits."""
        if not self.ledger.over_booked(node):
            return
        residents: list[tuple[datetime, SetKey]] = []
        for key in sorted(self.ledger.sets_on.get(node, ())):
            bound = [d for d in self.members(key) if d.phase is Phase.BOUND and d.node == node]
            if bound:
                residents.append((max(d.since or _EPOCH for d in bound), key))
        # First the sets whose leaving frees units here, newest first. A set whose VM's
        # launcher pod runs here frees nothing by leaving (the pod keeps booking its
        # units), so it is moved only if the devices alone still do not fit.
        for frees_units in (True, False):
            for _, key in sorted(residents, reverse=True):
                over = self.ledger.over_booked(node)
                if not over:
                    return
                held = [d for d in self.members(key) if d.held]
                holds = self.units(d for d in held if d.phase is Phase.BOUND and d.node == node)
                if not holds:
                    continue  # already moved
                lifted = tuple(
                    dataclasses.replace(d, phase=Phase.LOST, node="") if d.held else d for d in self.members(key)
                )
                delta = self.ledger.delta(key, lifted)
                allocatable = self.nodes[node].allocatable
                if frees_units:
                    if not any(delta.booked[(node, r)] < 0 for r in over):
                        continue
                else:
                    devices_over = {r for r in over if self.ledger.device_booked[node][r] > allocatable.get(r, 0)}
                    if not any(holds[r] for r in devices_over):
                        continue
                detail = ", ".join(
                    f"{r} allocatable {allocatable.get(r, 0)}, booked {self.ledger.booked[node][r]}" for r in over
                )
                self.move(key, node, f"node {node} is over-booked ({detail})", held=held)

    def move(self, key: SetKey, from_node: str, why: str, held: Sequence[Device] | None = None) -> None:
        held = list(held) if held is not None else [d for d in self.members(key) if d.held]
        self.place_or_lose(
            key,
            held,
            Outcome.MOVED,
            lambda _: f"moved from {from_node}: {why}",
            f"lost: {why}; no other node has room for the set",
            exclude=[from_node],
        )

    def place_or_lose(
        self,
        key: SetKey,
        held: Sequence[Device],
        outcome: Outcome,
        placed: Callable[[str], str],
        lost: str,
        *,
        exclude: Iterable[str] = (),
        prefer: Counter[str] | None = None,
    ) -> None:
        """Put the held members of ``key`` on the best node, or send them all to Lost.

        A set with alternatives tries its choices in order (keeping its class when a
        launcher holds it): the first one with room wins."""
        choices = self.move_choices(key)
        choice, notes = "", list[tuple[str, str]]()
        if choices is None:
            node = self.place(key, held, exclude=exclude, prefer=prefer)
        else:
            node, choice, notes = self.place_choosing(key, held, choices, exclude=exclude, prefer=prefer)
        if node is not None:
            self.settle(key, held, Phase.BOUND, node, placed(node) + placed_as(choice, notes), choice)
            self.counts[outcome] += 1
        else:
            self.settle(key, held, Phase.LOST, "", lost + (f" ({passed_over(notes)})" if notes else ""))
            self.counts[Outcome.LOST] += 1
            self._lost_now.add(key)

    # -- step 3: rebind Lost sets --------------------------------------------------------

    def rebind_lost_sets(self) -> None:
        lost: list[tuple[datetime, SetKey]] = []
        for key in self.set_keys():
            held = [d for d in self.members(key) if d.held]
            if held and all(d.phase is Phase.LOST for d in held):
                lost.append((min(d.since or _EPOCH for d in held), key))
        for _, key in sorted(lost):
            self.rebind(key)

    def rebind(self, key: SetKey) -> None:
        """Place a Lost set, with its new members if their budget allows (no check for the rest)."""
        choices = self.move_choices(key)
        if choices is not None:
            self.rebind_choosing(key, choices)
            return
        members = self.members(key)
        held = [d for d in members if d.held]
        fresh = [d for d in members if d.phase is Phase.PENDING and d.class_name in self.classes]
        refusal = None
        if fresh:
            # Budget does not depend on the node: Bound and Lost both count.
            refusal = self.budget_refusal(key, self._bound_on(members, "-", {d.name for d in fresh}))
            if not refusal:
                node = self.place(key, held + fresh)
                if node is not None:
                    self.settle(key, held, Phase.BOUND, node, f"rebound: {REASON_BOUND}")
                    self.settle(key, fresh, Phase.BOUND, node, REASON_BOUND)
                    self.counts[Outcome.BOUND] += 1
                    return
        node = self.place(key, held)
        if node is None:
            if not any(d.reason.startswith("lost:") for d in held):
                self.with_reason(
                    key, (d.name for d in held), f"lost: no node has room for {describe_units(self.units(held))}"
                )
            if key not in self._lost_now:
                self.refused.add(key)
            return
        self.settle(key, held, Phase.BOUND, node, f"rebound: {REASON_BOUND}")
        self.counts[Outcome.BOUND] += 1
        if fresh:
            why = f"pending: {refusal}" if refusal else f"pending: no room for new members next to the set on {node}"
            self.with_reason(key, (d.name for d in fresh), why)
            self.grow(key, allow_move=False)

    # -- step 4: bind new orders ---------------------------------------------------------

    def bind_orders(self) -> None:
        orders: list[tuple[datetime, SetKey]] = []
        for key in self.set_keys():
            members = self.members(key)
            if all(d.phase is Phase.PENDING for d in members):
                orders.append((min(d.created or _EPOCH for d in members), key))
        for _, key in sorted(orders):
            self.bind_order(key)

    def bind_order(self, key: SetKey) -> None:
        members = self.members(key)
        if has_alternatives(members):
            self.bind_choosing(key, members)
            return
        missing = sorted({d.class_name for d in members if d.class_name not in self.classes})
        if missing:
            for device in members:
                if device.class_name in missing:
                    why = f"pending: class {device.class_name} does not exist"
                else:
                    why = f"pending: waiting for the set's devices of missing class {', '.join(missing)}"
                self.with_reason(key, [device.name], why)
            self.refused.add(key)
            return
        names = {d.name for d in members}
        refusal = self.budget_refusal(key, self._bound_on(members, "-", names))
        if refusal:
            self.with_reason(key, names, f"pending: {refusal}")
            self.refused.add(key)
            return
        node = self.place(key, members)
        if node is None:
            self.with_reason(
                key,
                names,
                f"pending: no Ready, schedulable node matching the set's classes has room for "
                f"{describe_units(self.units(members))}{self.taint_note(members)}",
            )
            self.refused.add(key)
            return
        self.settle(key, members, Phase.BOUND, node, REASON_BOUND)
        self.counts[Outcome.BOUND] += 1

    # -- choices: sets that accept several classes ---------------------------------------

    def launcher_holds(self, key: SetKey) -> bool:
        """Whether a launcher pod that has not finished runs the set's VM: it asked for
        the raw resource of the class the set is held as, so the set keeps that class."""
        return any(not pod.finished for pod, _ in self.ledger.launcher_pods.get(key, ()))

    def join_as_held(
        self, key: SetKey, members: tuple[Device, ...], held: Sequence[Device]
    ) -> tuple[tuple[Device, ...], str] | None:
        """New members of a held set with alternatives join as the class it is held as:
        ``members`` with them re-classed, and that class ("" when nothing changes). None
        when they list other choices than the rest: they wait, saying so."""
        if not held or len(held) == len(members) or not has_alternatives(members):
            return members, ""
        pending = {d.name for d in members if d.phase is Phase.PENDING}
        held_as = self.joining_class(key, members)
        if held_as:
            return reclassed(members, pending, held_as), held_as
        differ = disagreement(members)
        if differ:
            self.with_reason(key, pending, f"pending: {differ}")
            return None
        return members, ""

    def joining_class(self, key: SetKey, members: Sequence[Device]) -> str:
        """The class new members of a held set with alternatives join as: the one the set
        is held as. Empty for a set without alternatives, or one held as several classes
        (a write that failed half way) or whose members list different choices."""
        if not has_alternatives(members) or disagreement(members):
            return ""
        held = {d.class_name for d in members if d.held}
        return next(iter(held)) if len(held) == 1 else ""

    def move_choices(self, key: SetKey) -> tuple[str, ...] | None:
        """The classes a held set with alternatives may take when it moves, is gathered or
        is rebound, in order; None for a set without alternatives (the single-class rules).

        A set whose launcher runs, or whose members list different choices, keeps the
        class it is held as.
        """
        members = self.members(key)
        if not has_alternatives(members):
            return None
        held = sorted({d.class_name for d in members if d.held})
        if disagreement(members) or self.launcher_holds(key):
            return (held[0],) if len(held) == 1 else None
        return choices_of(members[0])

    def place_choosing(
        self,
        key: SetKey,
        moving: Sequence[Device],
        choices: Sequence[str],
        *,
        exclude: Iterable[str] = (),
        prefer: Counter[str] | None = None,
        budget: bool = False,
    ) -> tuple[str | None, str, list[tuple[str, str]]]:
        """The first of ``choices`` with a node that has room for ``moving`` booked as
        that class (and, with ``budget``, that the tenant's budget allows), and the
        fullest such node: (node, class, the classes passed over with why). The node is
        None when no choice fits."""
        notes: list[tuple[str, str]] = []
        names = {d.name for d in moving}
        for choice in choices:
            if choice not in self.classes:
                notes.append((choice, f"class {choice} does not exist"))
                continue
            members = reclassed(self.members(key), names, choice)
            as_choice = [d for d in members if d.name in names]
            if budget:
                refusal = self.budget_refusal(key, self._bound_on(members, "-", names))
                if refusal:
                    notes.append((choice, refusal))
                    continue

            def placed_on(n: str, m: tuple[Device, ...] = members) -> tuple[Device, ...]:
                return self._bound_on(m, n, names)

            node = self.best_node(key, placed_on, as_choice, exclude=exclude, prefer=prefer)
            if node is not None:
                return node, choice, notes
            units = describe_units(self.units(as_choice))
            notes.append((choice, f"no {choice} node has room for {units}{self.taint_note(as_choice)}"))
        return None, "", notes

    def bind_choosing(self, key: SetKey, members: Sequence[Device]) -> None:
        """Bind a new order whose members list alternatives: the first choice with room
        and budget, else Pending saying why for every choice."""
        names = {d.name for d in members}
        differ = disagreement(members)
        if differ:
            self.with_reason(key, names, f"pending: {differ}")
            self.refused.add(key)
            return
        node, choice, notes = self.place_choosing(key, members, choices_of(members[0]), budget=True)
        if node is None:
            self.with_reason(key, names, f"pending: none of the set's classes can take it: {passed_over(notes)}")
            self.refused.add(key)
            return
        self.settle(key, members, Phase.BOUND, node, REASON_BOUND + placed_as(choice, notes), choice)
        self.counts[Outcome.BOUND] += 1

    def rebind_choosing(self, key: SetKey, choices: Sequence[str]) -> None:
        """Rebind a Lost set with alternatives: with its new members where their budget
        allows, else alone (no budget check: it already counts), first choice first."""
        members = self.members(key)
        held = [d for d in members if d.held]
        fresh = [d for d in members if d.phase is Phase.PENDING] if not disagreement(members) else []
        if fresh:
            node, choice, notes = self.place_choosing(key, held + fresh, choices, budget=True)
            if node is not None:
                self.settle(key, held, Phase.BOUND, node, f"rebound: {REASON_BOUND}{placed_as(choice, notes)}", choice)
                self.settle(key, fresh, Phase.BOUND, node, REASON_BOUND + placed_as(choice, notes), choice)
                self.counts[Outcome.BOUND] += 1
                return
        node, choice, notes = self.place_choosing(key, held, choices)
        if node is None:
            if not any(d.reason.startswith("lost:") for d in held):
                why = f"lost: none of the set's classes has a node with room for it: {passed_over(notes)}"
                self.with_reason(key, (d.name for d in held), why)
            if key not in self._lost_now:
                self.refused.add(key)
            return
        self.settle(key, held, Phase.BOUND, node, f"rebound: {REASON_BOUND}{placed_as(choice, notes)}", choice)
        self.counts[Outcome.BOUND] += 1
        if fresh:
            why = f"pending: no room for new members next to the set on {node}"
            self.with_reason(key, (d.name for d in fresh), why)
            self.grow(key, allow_move=False)

    # -- answer pass ---------------------------------------------------------------------

    def settle_requested_set(self, key: SetKey) -> None:
        """Answer-pass placement of one requested set: no moves of held sets."""
        members = self.members(key)
        held = [d for d in members if d.held]
        if len({(d.phase, d.node) for d in held}) > 1:
            return
        if held and held[0].phase is Phase.BOUND:
            self.grow(key, allow_move=False)
        elif held:
            self.rebind(key)
        else:
            self.bind_order(key)

    # -- step 5: answer ------------------------------------------------------------------

    def answer_requests(self, keys: Iterable[SetKey]) -> None:
        for key in keys:
            members = self.members(key)
            if not any(d.wants_answer for d in members):
                continue
            nodes = {d.node for d in members}
            whole = all(d.phase is Phase.BOUND for d in members) and len(nodes) == 1
            answered = []
            for device in members:
                if device.wants_answer:
                    if whole:
                        answer = ANSWER_BOUND + device.node
                    elif len({(d.phase, d.node) for d in members if d.held}) > 1:
                        answer = (
                            ANSWER_REFUSED + "the set is split across nodes; the next full pass restores it; try again"
                        )
                    else:
                        answer = ANSWER_REFUSED + (_first_refusal(members) or "the set is not placed")
                    device = dataclasses.replace(device, answered_request=device.bind_request, answer=answer)
                    self.answered.append(device.key)
                answered.append(device)
            self.apply(key, answered)

    # -- result --------------------------------------------------------------------------

    def result(self, *, with_status: bool = True) -> PassResult:
        devices: list[Device] = []
        changes: list[Change] = []
        for key in sorted(self._before):
            original = {d.key: d for d in self._before[key]}
            for device in self.members(key):
                before = original[device.key]
                if device is before:
                    continue
                if (before.phase, before.node) == (device.phase, device.node):
                    if device.since != before.since:
                        device = dataclasses.replace(device, since=before.since)
                else:
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
                        )
                    )
                if device != before:
                    devices.append(device)
        class_status: dict[str, ClassStatus] = {}
        budget_used: dict[tuple[str, str], dict[str, int]] = {}
        if with_status:
            class_status = self.class_status()
            for budget in sorted(self.budgets, key=lambda b: (b.namespace, b.name)):
                used = self.ledger.used.get(budget.namespace, Counter())
                budget_used[(budget.namespace, budget.name)] = {k: used[k] for k in sorted(budget.limits)}
        self.counts[Outcome.REFUSED] = len(self.refused)
        return PassResult(
            devices=tuple(devices),
            changes=tuple(changes),
            counts=dict(self.counts),
            class_status=class_status,
            budget_used=budget_used,
            answered=tuple(self.answered),
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


def _rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _first_refusal(members: Iterable[Device]) -> str:
    for device in members:
        if device.phase is not Phase.BOUND and device.reason:
            return device.reason.removeprefix("pending: ")
    return ""
