"""What a node action would do, before staff confirm it: the next full pass, run on a copy.

Cordon, uncordon, drain and undrain change one node; what follows is the binder's next
full pass. The preview runs that same pass (:func:`binder.engine.full_pass`, nothing of its
own) on a copy of the cluster with the node changed and reports, per set, where it would
be afterwards. Sets held on the node come first (the ones staff asked about); any other
set the pass would change is listed too, since the pass changes it whether or not the
action caused it. The same cluster gives the same answer as the pass itself (placement is
deterministic), so the confirmation page shows what will happen, not a guess.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from binder.engine.placement import full_pass
from binder.engine.types import DRAIN_LABEL, Cluster, Device, Node, Phase


class NodeAction(enum.StrEnum):
    CORDON = "cordon"
    UNCORDON = "uncordon"
    DRAIN = "drain"
    UNDRAIN = "undrain"
    #: Standalone mode only (the database is the cluster; in a cluster the kubelet owns Ready).
    READY = "ready"
    NOT_READY = "not-ready"


#: The actions that change the node's Ready condition (offered in standalone mode only).
READINESS = (NodeAction.READY, NodeAction.NOT_READY)


#: What each action does to the node, in words (the confirmation page's heading).
EFFECT = {
    NodeAction.CORDON: "mark unschedulable (spec.unschedulable=true): keeps its sets, takes nothing new",
    NodeAction.UNCORDON: "mark schedulable again (spec.unschedulable=false)",
    NodeAction.DRAIN: f"label {DRAIN_LABEL}=true: the binder moves every set off it",
    NodeAction.UNDRAIN: f"remove the label {DRAIN_LABEL}: it may hold sets again",
    NodeAction.READY: "mark Ready (its Ready condition true, as from now): it may hold sets again",
    NodeAction.NOT_READY: "mark NotReady (as from now): its sets move away once the grace period has passed",
}


def title(action: NodeAction) -> str:
    """The action as a button or a heading says it ("Cordon", "Mark NotReady")."""
    titles = {NodeAction.READY: "Mark Ready", NodeAction.NOT_READY: "Mark NotReady"}
    return titles.get(action, action.value.capitalize())


class PreviewError(ValueError):
    """The preview cannot be made (no such node); the message says why."""


def changed_node(node: Node, action: NodeAction, now: datetime | None = None) -> Node:
    """``node`` as it is after ``action`` (taken at ``now``: a change of Ready dates it)."""
    if action is NodeAction.READY:
        return node if node.ready else dataclasses.replace(node, ready=True, ready_since=now)
    if action is NodeAction.NOT_READY:
        return node if not node.ready else dataclasses.replace(node, ready=False, ready_since=now)
    if action is NodeAction.CORDON:
        return dataclasses.replace(node, unschedulable=True)
    if action is NodeAction.UNCORDON:
        return dataclasses.replace(node, unschedulable=False)
    labels = dict(node.labels)
    if action is NodeAction.DRAIN:
        labels[DRAIN_LABEL] = "true"
    else:
        labels.pop(DRAIN_LABEL, None)
    return dataclasses.replace(node, labels=labels)


def already(node: Node, action: NodeAction) -> bool:
    """True when the node is already as the action would leave it."""
    return changed_node(node, action) == node


@dataclass(frozen=True, slots=True)
class SetOutcome:
    """One set before and after the pass: its units, where it is and where it would be."""

    namespace: str
    vm: str
    units: int
    before_phase: Phase
    before_nodes: tuple[str, ...]
    after_phase: Phase
    after_nodes: tuple[str, ...]
    reason: str
    """The pass's reason for the set's new placement ("" when it stays)."""

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.vm}"

    @property
    def changes(self) -> bool:
        return (self.before_phase, self.before_nodes) != (self.after_phase, self.after_nodes)

    @property
    def target(self) -> str:
        """Where the set would be, in words: "stays on n1", "n2", "Lost", "Pending"."""
        if not self.changes:
            return f"stays on {', '.join(self.after_nodes)}" if self.after_nodes else f"stays {self.after_phase.value}"
        if self.after_phase is Phase.BOUND:
            return ", ".join(self.after_nodes)
        return self.after_phase.value


@dataclass(frozen=True, slots=True)
class NodePreview:
    node: str
    action: NodeAction
    already: bool
    """The node is already so: the action changes nothing (the pass may still)."""
    on_node: tuple[SetOutcome, ...]
    """Sets held on the node now (Bound there), and where the pass would put them."""
    elsewhere: tuple[SetOutcome, ...]
    """Other sets the same pass would change."""

    @property
    def lost(self) -> tuple[SetOutcome, ...]:
        return tuple(s for s in (*self.on_node, *self.elsewhere) if s.changes and s.after_phase is Phase.LOST)


def _phase(devices: list[Device]) -> tuple[Phase, tuple[str, ...]]:
    """A set's phase in one word (Bound if any member is: a set growing on its node is
    still held there) and the nodes its Bound members are on."""
    phases = {d.phase for d in devices}
    phase = Phase.BOUND if Phase.BOUND in phases else Phase.LOST if Phase.LOST in phases else Phase.PENDING
    return phase, tuple(sorted({d.node for d in devices if d.phase is Phase.BOUND and d.node}))


def preview(cluster: Cluster, node_name: str, action: NodeAction) -> NodePreview:
    """The next full pass after ``action`` on ``node_name``, run on a copy of ``cluster``."""
    nodes = {n.name: n for n in cluster.nodes}
    if node_name not in nodes:
        raise PreviewError(f"no node {node_name!r} in the cluster")
    node = nodes[node_name]
    copy = dataclasses.replace(
        cluster, nodes=tuple(changed_node(n, action, cluster.now) if n.name == node_name else n for n in cluster.nodes)
    )
    result = full_pass(copy)
    after_by_key: Mapping[tuple[str, str], Device] = {d.key: d for d in result.devices}
    units_of = {c.name: c.units_per_device for c in cluster.classes}
    reasons: dict[tuple[str, str], str] = {}
    for change in result.changes:
        reasons.setdefault((change.namespace, change.vm_name), change.reason)
    before: dict[tuple[str, str], list[Device]] = defaultdict(list)
    after: dict[tuple[str, str], list[Device]] = defaultdict(list)
    for device in cluster.devices:
        before[device.set_key].append(device)
        after[device.set_key].append(after_by_key.get(device.key, device))
    on_node, elsewhere = [], []
    for key in sorted(before):
        was, will = _phase(before[key]), _phase(after[key])
        outcome = SetOutcome(
            namespace=key[0],
            vm=key[1],
            units=sum(units_of.get(d.class_name, 0) for d in before[key]),
            before_phase=was[0],
            before_nodes=was[1],
            after_phase=will[0],
            after_nodes=will[1],
            reason=reasons.get(key, "") if (was != will) else "",
        )
        if node_name in was[1]:
            on_node.append(outcome)
        elif outcome.changes:
            elsewhere.append(outcome)
    return NodePreview(node_name, action, already(node, action), tuple(on_node), tuple(elsewhere))
