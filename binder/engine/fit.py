"""What a node may take and what a budget allows: the fit rules of the binder's passes.

The pass places by these rules, and the catalog, the explanations, the staff board and a
worker's saved state read them too, so each rule has one copy and every caller gives the
binder's own sentence. Pure functions over the engine's dataclasses, plus
:class:`NodeCache`, what a caller keeps between passes of the nodes and classes alone.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence

from binder.engine.accounting import Ledger
from binder.engine.choices import (
    choices_of,
    disagreement,
    has_alternatives,
    passed_over,
    reclassed,
)
from binder.engine.ledger_records import SetKey
from binder.engine.limits import Limits, is_raw_key
from binder.engine.types import (
    Device,
    GpuClass,
    Node,
    Phase,
)

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


def is_settled(
    members: Sequence[Device],
    nodes: Mapping[str, Node],
    classes: Mapping[str, GpuClass],
    keeps: dict[tuple[str, str], bool] | None = None,
) -> bool:
    """Whether a full pass provably leaves the set ``members`` alone, whatever else changes.

    A set is settled when every member is Bound on one Ready node that exists, is not
    draining and matches every member's class, every class exists, and no member waits
    for an answer. Then no step of a full pass acts on it: nothing to restore, gather or
    grow (step 1), its node can keep it (step 2; NotReady nodes count as unsettled even
    inside their grace period, so the clock never has to be consulted), it is neither
    Lost (step 3) nor an order (step 4), nor asks (step 5). A borrowed or marked set may be
    settled too: repaying, marking and releasing find borrowed sets through the ledger
    (``Ledger.borrowed_sets``), never through the scope. The one step that may still
    move it is relieving an over-booked node, which finds its residents through the
    ledger, not through the scope. A worker can therefore give :func:`full_pass` only the
    unsettled sets (``scope``) and get the decisions of a pass over everything.

    ``keeps``: whether a node keeps a set of one class, by (node, class), for many calls
    on the same nodes and classes (a start asks it of 385k sets on 100k nodes).
    """
    if not members:
        return True
    node_name = members[0].node
    one_class = members[0].class_name
    for device in members:
        if (
            device.phase is not Phase.BOUND
            or device.node != node_name
            or device.class_name not in classes
            or device.wants_answer
        ):
            return False
        if device.class_name != one_class:
            one_class = ""
    if one_class and keeps is not None:
        kept = keeps.get((node_name, one_class))
        if kept is None:
            kept = keeps[(node_name, one_class)] = _keeps(nodes.get(node_name), [classes[one_class]])
        return kept
    return _keeps(nodes.get(node_name), [classes[name] for name in sorted({d.class_name for d in members})])


def _keeps(node: Node | None, classes: Sequence[GpuClass]) -> bool:
    """``node`` exists, is Ready, is not draining and matches every one of ``classes``."""
    return node is not None and node.ready and not node.draining and selector_mismatch(node, classes) is None


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
    return _refusal_of(ledger, limits, key, ledger.used_delta(key, candidate))


def _refusal_of(ledger: Ledger, limits: Limits, key: SetKey, more_used: Mapping[str, int]) -> str | None:
    """The budget refusal of a change that adds ``more_used`` (key -> units, negative: frees)
    to the tenant of set ``key``, or None."""
    namespace = key[0]
    for budget_key in sorted(more_used):
        more = more_used[budget_key]
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


def borrow_terms(
    ledger: Ledger, limits: Limits, key: SetKey, more_used: Mapping[str, int]
) -> tuple[str | None, dict[str, tuple[int, int, int]]]:
    """Whether a change adding ``more_used`` to the tenant of set ``key`` may borrow: (None,
    the keys it takes beyond their limits, each with (units over, limit, borrowing)) when
    every over-limit key has a borrowing allowance that covers it, else (why not, {}).
    A change within every limit gives (None, {})."""
    namespace = key[0]
    over: dict[str, tuple[int, int, int]] = {}
    for budget_key in sorted(more_used):
        more = more_used[budget_key]
        limit = limits.limit(budget_key)
        if more <= 0 or limit is None:
            continue
        used = ledger.used[namespace][budget_key]
        if used + more <= limit:
            continue
        allowance = limits.allowance(budget_key)
        kind = "raw" if is_raw_key(budget_key) else "class"
        if not allowance:
            return f"{kind} key {budget_key} has limit {limit} and no borrowing, {used} used", {}
        if used + more > limit + allowance:
            return (
                f"{kind} key {budget_key} has limit {limit} and borrowing {allowance}, {used} used, "
                f"and this set needs {more} more",
                {},
            )
        over[budget_key] = (used + more - limit, limit, allowance)
    return None, over


def describe_overage(over: Mapping[str, tuple[int, int, int]]) -> str:
    """``h100 by 2 (limit 4, borrowing 4)``: how far a borrowed set is over its limits."""
    return ", ".join(f"{k} by {n} (limit {limit}, borrowing {allowance})" for k, (n, limit, allowance) in sorted(
        over.items()))  # fmt: skip


def selector_mismatch(node: Node, classes: Iterable[GpuClass]) -> str | None:
    """The first class nodeSelector label ``node`` lacks, as a sentence, or None."""
    for cls in classes:
        for label, value in sorted(cls.node_selector.items()):
            if node.labels.get(label) != value:
                return f"class {cls.name} needs node label {label}={value}"
    return None


def untolerated_taint(node: Node, classes: Iterable[GpuClass]) -> str | None:
    """The first NoSchedule/NoExecute taint of ``node`` some class of ``classes`` does not
    tolerate, as a sentence, or None.

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
    """The VMI nodeSelector of the devices' unanswered bind requests.

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
    """Why ``node`` takes no new devices of ``classes`` now, or None.

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
