"""Staff actions: run a full pass now, retry a Lost set, cordon or drain a node (and undo
it), and tell staff what came of it.

Both go through the binder queue (``binder.queue.queue_full_pass``) like every other
event, never by calling ``run_pass`` inline: passes stay serialized and collapsed, and
a staff click cannot jump the queue ahead of a webhook's answer pass. What staff see
depends on where the pass runs: without a broker Celery runs it in-process when the
request's transaction commits (in autocommit mode: at once), so its result can be
shown; with a broker a worker runs it later, and staff are told it is queued.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone
from kubernetes.client import ApiException

from binder import apiserver, models
from binder.engine.preview import EFFECT, READINESS, NodeAction, title
from binder.engine.types import DRAIN_LABEL
from binder.errors import describe
from binder.mirror.write import mirror_event
from binder.queue import queue_full_pass

log = logging.getLogger(__name__)


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def sets(count: int) -> str:
    return plural(count, "set")


@dataclass(frozen=True, slots=True)
class PassOutcome:
    """What asking for a full pass led to, as far as this request can know."""

    run: models.PassRun | None = None
    queued: bool = False
    """A broker is configured: a worker runs the pass; nothing more is known here."""
    deferred: bool = False
    """The caller is inside a transaction: the pass runs when it commits."""
    error: str = ""

    @property
    def message(self) -> str:
        if self.error:
            return f"The full pass failed: {self.error}"
        if self.run is not None:
            run = self.run
            # A pass counts sets (and refused orders), the board counts devices: say which.
            text = (
                f"Full pass #{run.pk} ran: bound {sets(run.bound)}, moved {sets(run.moved)}, lost {sets(run.lost)}, "
                f"refused {plural(run.refused, 'order')}, restored {sets(run.restored)}; "
                f"{plural(run.devices_written, 'device')} written"
            )
            return text + (f" (skipped: {run.skipped})" if run.skipped else "") + "."
        if self.deferred:
            return "Queued a full pass; it runs when this request's transaction commits."
        return "Queued a full pass on the binder queue; a worker runs it (see Passes for its result)."


def staff_trigger(username: str) -> str:
    """The ``PassRun.triggered_by`` of a staff action: who clicked."""
    return f"staff:{username}"


def full_pass_now(triggered_by: str = "staff", change: Callable[[], None] | None = None) -> PassOutcome:
    """Queue a full pass and, when it ran in-process, return its record.

    ``change``, when given, runs in the same transaction after the pass is queued: the
    pass sees it, and the events the change itself queues collapse into this pass, which
    keeps the staff trigger. If it raises, nothing is written and no pass is queued.
    """
    before = models.PassRun.objects.filter(kind=models.PassKind.FULL).order_by("-pk").values_list("pk", flat=True)
    last = before.first() or 0
    deferred = transaction.get_connection().in_atomic_block
    if change is not None:
        changed = False
        try:
            with transaction.atomic():
                queue_full_pass(triggered_by=triggered_by)
                change()
                changed = True
        except Exception as exc:
            if not changed:
                raise  # the change failed: rolled back, nothing queued; the caller says why
            log.exception("full pass after a staff change failed")
            return PassOutcome(error=f"{type(exc).__name__}: {exc}")
        return _ran(last, deferred)
    try:
        queue_full_pass(triggered_by=triggered_by)
    except Exception as exc:  # an in-process pass that failed must reach staff, not a 500 page
        log.exception("full pass requested by staff failed")
        return PassOutcome(error=f"{type(exc).__name__}: {exc}")
    return _ran(last, deferred)


def _ran(last: int, deferred: bool) -> PassOutcome:
    """What became of the pass queued after pass ``last``, as far as this request can know."""
    if not settings.CELERY_TASK_ALWAYS_EAGER:
        return PassOutcome(queued=True)
    if deferred:
        return PassOutcome(deferred=True)
    run = models.PassRun.objects.filter(kind=models.PassKind.FULL, pk__gt=last).order_by("pk").first()
    return PassOutcome(run=run, queued=run is None)


@dataclass(frozen=True, slots=True)
class RetryOutcome:
    """A Lost set's retry: the pass outcome and where the set stands afterwards."""

    namespace: str
    vm: str
    outcome: PassOutcome
    phases: dict[str, int]
    nodes: tuple[str, ...]
    reason: str

    @property
    def message(self) -> str:
        name = f"{self.namespace}/{self.vm}"
        if self.outcome.error:
            return f"Retry of {name}: {self.outcome.message}"
        if self.outcome.deferred:
            return f"Queued a full pass to retry {name}; it runs when this request's transaction commits."
        if self.outcome.run is None:
            return f"Queued a full pass to retry {name} on the binder queue; a worker runs it (see Passes)."
        if self.phases.get(models.Phase.LOST):
            return f"{self.outcome.message} {name} is still Lost: {self.reason}"
        if set(self.phases) == {models.Phase.BOUND}:
            return f"{self.outcome.message} {name} is now Bound on {', '.join(self.nodes)}."
        state = ", ".join(f"{n} {p}" for p, n in sorted(self.phases.items())) or "no devices any more"
        return f"{self.outcome.message} {name} now has {state}."

    @property
    def bound(self) -> bool:
        return set(self.phases) == {models.Phase.BOUND}

    @property
    def level(self) -> str:
        """How staff are told: success only when the set is Bound now; a warning when the
        pass ran and it is not; info while the pass is still to run; error when it failed."""
        if self.outcome.error:
            return "error"
        if self.outcome.run is None:
            return "info"
        return "success" if self.bound else "warning"


def retry_lost_set(namespace: str, vm: str, triggered_by: str = "staff") -> RetryOutcome:
    """Ask for a full pass to rebind a Lost set (step 3 of the pass rebinds Lost sets
    first, oldest first), then read where the set stands if the pass already ran."""
    outcome = full_pass_now(triggered_by)
    devices = list(
        models.GpuDevice.objects.filter(namespace__name=namespace, vm_name=vm).values_list("phase", "node", "reason")
    )
    phases: dict[str, int] = {}
    for phase, _, _ in devices:
        phases[phase] = phases.get(phase, 0) + 1
    lost_reason = next((r for p, _, r in devices if p == models.Phase.LOST), "")
    return RetryOutcome(
        namespace=namespace,
        vm=vm,
        outcome=outcome,
        phases=phases,
        nodes=tuple(sorted({n for _, n, _ in devices if n})),
        reason=lost_reason,
    )


# -- node actions --------------------------------------------------------------------------------


class NodeActionError(Exception):
    """A node action that could not be made (nothing was written); the message says why."""


@dataclass(frozen=True, slots=True)
class NodeActionOutcome:
    node: str
    action: NodeAction
    outcome: PassOutcome
    written_to: str
    """Where the change went: "the API server" (cluster mode) or "the mirror" (standalone)."""
    sets: tuple[tuple[str, str, tuple[str, ...]], ...] = ()
    """After the pass (when it ran): the sets that were on the node and those the pass
    changed, their phase and nodes."""

    @property
    def message(self) -> str:
        text = f"{title(self.action)} {self.node}: {EFFECT[self.action]} (written to {self.written_to})."
        where = "; ".join(
            f"{key} {phase}{' on ' + ', '.join(nodes) if nodes else ''}" for key, phase, nodes in self.sets
        )
        return f"{text} {self.outcome.message}" + (f" Now: {where}." if where and self.outcome.run else "")

    @property
    def level(self) -> str:
        """error, warning (a set it held went Lost), or success."""
        if self.outcome.error:
            return "error"
        if any(phase == models.Phase.LOST for _, phase, _ in self.sets):
            return "warning"
        return "success"


#: Cluster mode: the merge patch of each action (drain is the label).
NODE_PATCHES: dict[NodeAction, dict[str, Any]] = {
    NodeAction.CORDON: {"spec": {"unschedulable": True}},
    NodeAction.UNCORDON: {"spec": {"unschedulable": None}},
    NodeAction.DRAIN: {"metadata": {"labels": {DRAIN_LABEL: "true"}}},
    NodeAction.UNDRAIN: {"metadata": {"labels": {DRAIN_LABEL: None}}},
}


def _write_node_to_api_server(name: str, action: NodeAction) -> None:
    api = apiserver.api()
    try:
        current = api.get("Node", "", name)
        if current is None:
            raise NodeActionError(f"node {name} is not in the API server (deleted?); nothing was changed")
        version = str((current.get("metadata") or {}).get("resourceVersion") or "")
        written = api.patch_node(name, NODE_PATCHES[action], version)
    except ApiException as exc:
        if exc.status == 409:
            raise NodeActionError(
                f"node {name} changed in the API server while this was written (409 Conflict); "
                "nothing was changed: look at the preview again"
            ) from None
        raise NodeActionError(f"the API server refused to {action.value} {name}: {describe(exc)}") from None
    # The mirror now, not when the watch event arrives: the queued pass decides from it
    # (the event, when it comes, finds the row already so and queues nothing).
    mirror_event("Node", "MODIFIED", written)


def _write_node_row(name: str, action: NodeAction) -> None:
    row = models.Node.objects.select_for_update().filter(name=name).first()
    if row is None:
        raise NodeActionError(f"no node {name} in the mirror; nothing was changed")
    if action in READINESS:
        # Standalone mode: the database is the cluster, so staff stand in for the kubelet.
        ready = action is NodeAction.READY
        if row.ready != ready:
            row.ready, row.ready_since = ready, timezone.now()
            row.save(update_fields=["ready", "ready_since"])
        return
    if action in (NodeAction.CORDON, NodeAction.UNCORDON):
        row.unschedulable = action is NodeAction.CORDON
        row.save(update_fields=["unschedulable"])
        return
    labels = dict(row.labels or {})
    if action is NodeAction.DRAIN:
        labels[DRAIN_LABEL] = "true"
    else:
        labels.pop(DRAIN_LABEL, None)
    row.labels = labels
    row.save(update_fields=["labels"])


def change_node(name: str, action: NodeAction, triggered_by: str = "staff") -> NodeActionOutcome:
    """Cordon, uncordon, drain or undrain ``name``, then queue a full pass (``triggered_by``).

    In cluster mode the API server owns the node: the change is a merge patch there with the
    node's resourceVersion as precondition, then mirrored; in standalone mode it is the
    mirror row. Raises :class:`NodeActionError` (nothing written) when it cannot be made.
    """
    held = sorted(
        set(
            models.GpuDevice.objects.filter(node=name, phase=models.Phase.BOUND).values_list(
                "namespace__name", "vm_name"
            )
        )
    )
    cluster_mode = apiserver.cluster_mode()
    if cluster_mode and action in READINESS:
        raise NodeActionError(f"in cluster mode the kubelet reports whether {name} is Ready; nothing was changed")
    write = _write_node_to_api_server if cluster_mode else _write_node_row
    outcome = full_pass_now(triggered_by, change=lambda: write(name, action))
    sets = []
    if outcome.run is not None:
        # The sets it held, then every other set the pass placed, moved or sent to Lost (a
        # node back to Ready takes its Lost sets back: "team-nlp/llm-train-a Bound on ...").
        decided = models.Decision.objects.filter(pass_run=outcome.run).values_list("namespace", "vm_name")
        held += sorted(set(decided) - set(held))
        for namespace, vm in held:
            rows = list(
                models.GpuDevice.objects.filter(namespace__name=namespace, vm_name=vm).values_list("phase", "node")
            )
            phases = {p for p, _ in rows}
            phase = (
                models.Phase.BOUND
                if models.Phase.BOUND in phases
                else (models.Phase.LOST if models.Phase.LOST in phases else models.Phase.PENDING)
            )
            sets.append((f"{namespace}/{vm}", str(phase), tuple(sorted({n for _, n in rows if n}))))
    return NodeActionOutcome(name, action, outcome, "the API server" if cluster_mode else "the mirror", tuple(sets))
