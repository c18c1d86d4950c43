"""The VMI admission decision, as pure functions of the review and a read-only view of the mirror.

The webhook sits in the path of every VMI start, behind a 10 s timeout and a
``failurePolicy``, so what it decides must be easy to test exhaustively and impossible
to get wrong by a database detail: this module never imports Django and never does
I/O. It decides from a parsed :class:`~webhooks.review.Review` plus a :class:`MirrorView`
of the VMI's namespace (:func:`decide`), turns the binder's answers into a verdict
(:func:`conclude`), and builds the AdmissionReview v1 response (:func:`response`).
Every denial's wording is here.

Budgets are checked with the engine's own ledger and ``budget_refusal``, so an
advisory denial here carries the very sentence the binder would write; the binder
still re-checks at bind time (admission checks are advisory).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from binder.engine import (
    ANSWER_BOUND,
    ANSWER_REFUSED,
    Budget,
    DefaultBudget,
    Device,
    GpuClass,
    Node,
    Phase,
    Pod,
    Vmi,
    budget_refusal,
    build_ledger,
    effective_limits,
)
from binder.engine.choices import choices_of, reclassed
from binder.engine.fit import borrow_terms, refuses_new
from binder.engine.matching import term_matches, unmet
from webhooks.patch import HOSTNAME_LABEL, build_patch, encode_patch, missing_tolerations
from webhooks.review import (
    DEVICE_PREFIX,
    REQUIRED_AFFINITY,
    REVIEW_API_VERSION,
    REVIEW_KIND,
    Review,
    Scheduling,
    parse_review,
)

#: HTTP status code put in ``response.status`` on denial (below 400 the apiserver makes it 400).
DENIED_CODE = 403


@dataclass(frozen=True, slots=True)
class DeviceIndex:
    """A namespace's devices by name and by VM (members sorted by name), and the view's nodes by name."""

    by_name: Mapping[str, Device]
    by_vm: Mapping[str, tuple[Device, ...]]
    nodes: Mapping[str, Node]


@dataclass(frozen=True, slots=True)
class MirrorView:
    """The read-only slice of the mirror one decision reads: the VMI's namespace.

    ``devices``, ``budgets``, ``pods`` and ``vmis`` are those of ``namespace`` (records of
    other namespaces are ignored); ``classes`` are all GPU classes; ``nodes`` at least the
    nodes the namespace's devices are on (the pin needs each node's own labels). ``enabled``
    and ``default_budget`` are the settings ``GPUPLANE_ENABLED`` and
    ``GPUPLANE_DEFAULT_BUDGET``.
    """

    namespace: str
    enabled: bool = True
    devices: tuple[Device, ...] = ()
    classes: tuple[GpuClass, ...] = ()
    nodes: tuple[Node, ...] = ()
    budgets: tuple[Budget, ...] = ()
    pods: tuple[Pod, ...] = ()
    vmis: tuple[Vmi, ...] = ()
    default_budget: DefaultBudget = DefaultBudget.UNLIMITED
    _index: DeviceIndex | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def index(self) -> DeviceIndex:
        """The namespace's devices by name and by VM, built once per view: a view kept
        between calls (the read model's) answers a Bound call without a pass over the
        namespace's devices."""
        found = self._index
        if found is None:
            by_name = {d.name: d for d in self.devices if d.namespace == self.namespace}
            by_vm: dict[str, list[Device]] = {}
            for device in sorted(by_name.values(), key=lambda d: d.name):
                by_vm.setdefault(device.vm_name, []).append(device)
            found = DeviceIndex(
                by_name, {vm: tuple(members) for vm, members in by_vm.items()}, {n.name: n for n in self.nodes}
            )
            object.__setattr__(self, "_index", found)
        return found


class Action(enum.StrEnum):
    """What the webhook does with a VMI."""

    ALLOW = "allow"
    """Allow untouched."""
    DENY = "deny"
    """Deny with ``message``."""
    PATCH = "patch"
    """Allow with ``patch`` (pin to ``node``, raw deviceNames)."""
    BIND = "bind"
    """Not decidable yet: request binding of ``bind`` (the whole set) and wait for answers."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """The decision about one review. ``uid`` is the request uid the response must echo."""

    action: Action
    uid: str
    message: str = ""
    node: str = ""
    patch: tuple[Mapping[str, Any], ...] = ()
    bind: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


def scheduling_conflict(scheduling: Scheduling, node: Node | None, node_name: str) -> str | None:
    """Why the VMI's own constraints exclude the node holding its GPUs, or None.

    Checked as the scheduler checks the launcher pod (which KubeVirt gives the VMI's
    nodeSelector and affinity): every nodeSelector label equal, and at least one required
    node affinity term satisfied. ``node`` None is a node missing from the mirror: its
    labels are unknown, so any constraint is a conflict the caller may retry.
    """
    if node is None:
        if scheduling.node_selector or scheduling.required is not None:
            return (
                f"node {node_name} is not in gpuplane's mirror, so its labels cannot be checked "
                "against the VMI's nodeSelector and node affinity; try again"
            )
        return None
    for key in sorted(scheduling.node_selector):
        want, have = scheduling.node_selector[key], node.labels.get(key)
        if have == want:
            continue
        shown = f"{key}={have}" if have is not None else f"no label {key}"
        if key == HOSTNAME_LABEL:
            return f"spec.nodeSelector pins {key}={want}, but its GPUs are on node {node_name} ({shown})"
        return f"spec.nodeSelector {key}={want} does not match node {node_name} ({shown})"
    if scheduling.required is not None and not any(term_matches(t, node) for t in scheduling.required):
        where = f"spec.affinity.nodeAffinity.{REQUIRED_AFFINITY}"
        if not scheduling.required:
            return f"{where} has no nodeSelectorTerms, so no node, {node_name} included, satisfies it"
        missing = unmet(scheduling.required, node)
        detail = f" (unmet: {'; '.join(missing)})" if missing else " (an empty term matches no node)"
        return f"{where}: no nodeSelectorTerm matches node {node_name}, which holds its GPUs{detail}"
    return None


# -- deciding ------------------------------------------------------------------------------


def decide(review: Mapping[str, Any] | Review, view: MirrorView) -> Verdict:  # noqa: C901 - the admission steps, in order
    """Decide a VMI CREATE from the review and the mirror.

    A VMI naming no gpuplane.io devices (or any operation but CREATE, which is all the
    webhook is registered for) is allowed untouched without reading ``view``; the view
    passes an empty one then. Otherwise the named devices are checked, then the set:
    all Bound on one node gives the patch; anything else needs the binder (``BIND``),
    after an advisory budget check.
    """
    r = review if isinstance(review, Review) else parse_review(review)
    if not r.needs_mirror:
        return Verdict(Action.ALLOW, r.uid)
    vmi = f"VMI {r.namespace}/{r.name or '(generated name)'}"
    if not view.enabled:
        return _deny(
            r, f"GPUs are turned off on this platform (GPUPLANE_ENABLED=false): {vmi} names gpuplane.io devices"
        )
    if not r.name:
        return _deny(r, f"{vmi} names gpuplane.io devices but has no metadata.name to match the devices' vmName")
    seen: set[str] = set()
    for entry in r.named:
        if not entry.device:
            return _deny(r, f"{vmi} has a deviceName {DEVICE_PREFIX!r} without a device name")
        if entry.device in seen:
            return _deny(r, f"{vmi} names device {DEVICE_PREFIX}{entry.device} more than once")
        seen.add(entry.device)

    index = view.index()
    devices = index.by_name
    for name in r.device_names:
        device = devices.get(name)
        if device is None:
            return _deny(r, f"{vmi}: device {DEVICE_PREFIX}{name} does not exist in namespace {r.namespace}")
        if device.vm_name != r.name:
            return _deny(r, f"{vmi}: device {DEVICE_PREFIX}{name} belongs to VM {device.vm_name}, not to {r.name}")
    members = index.by_vm.get(r.name, ())
    missing = [d.name for d in members if d.name not in seen]
    if missing:
        listed = ", ".join(DEVICE_PREFIX + m for m in missing)
        return _deny(r, f"{vmi} names only part of its set of {len(members)} devices; it must also name {listed}")
    classes = {c.name: c for c in view.classes}
    for device in members:
        # A Pending device may still be placed as any of its choices; a held one is its class.
        accepted = choices_of(device) if device.phase is Phase.PENDING else (device.class_name,)
        if not any(choice in classes for choice in accepted):
            what = f"class {accepted[0]}, which does not exist"
            if len(accepted) > 1:
                what = f"classes {', '.join(accepted)}, none of which exists"
            return _deny(r, f"{vmi}: device {DEVICE_PREFIX}{device.name} has {what}")

    nodes = {d.node for d in members}
    # A set marked for reclaim is not pinned: its GPUs are wanted by a waiting set, and its
    # VM is not running yet, so the answer pass releases it and places it as an order.
    if all(d.phase is Phase.BOUND for d in members) and len(nodes) == 1 and not any(d.reclaim_for for d in members):
        (node,) = nodes
        return _patched(r, view, node)

    refusal = advisory_budget_refusal(view, (r.namespace, r.name), members)
    if refusal:
        return _deny(r, refusal)
    names = tuple(d.name for d in members)
    if r.dry_run:
        # A dry run must have no side effects (sideEffects: NoneOnDryRun), and placing
        # the set is one: allow it unpinned and say why.
        return Verdict(
            Action.ALLOW, r.uid, warnings=(f"dry run: the GPUs of {vmi} are not placed yet, so it is not pinned",)
        )
    return Verdict(Action.BIND, r.uid, bind=names)


def advisory_budget_refusal(view: MirrorView, key: tuple[str, str], members: Sequence[Device]) -> str | None:
    """The binder's budget sentence if placing the set's Pending members would exceed a
    budget of its tenant, else None.

    Uses the engine's ledger over the namespace's devices, pods and VMIs (the shared
    launcher reader decides which pods are launchers) and its ``budget_refusal``; Bound
    and Lost members already count, so only Pending ones can add usage.
    """
    namespace = key[0]
    limits = effective_limits((b for b in view.budgets if b.namespace == namespace), view.default_budget)
    if limits.unlimited:
        return None  # nothing to exceed: no ledger to build
    ledger = build_ledger(
        classes=view.classes,
        devices=(d for d in view.devices if d.namespace == namespace),
        pods=(p for p in view.pods if p.namespace == namespace),
        vmis=(v for v in view.vmis if v.namespace == namespace),
    )
    candidate = tuple(
        dataclasses.replace(d, phase=Phase.BOUND, node="-") if d.phase is Phase.PENDING else d
        for d in sorted(members, key=lambda d: d.key)
    )
    refusal = budget_refusal(ledger, limits, key, candidate)
    if refusal and limits.borrowing:
        # Over its limits, the order may still borrow idle GPUs: the binder decides that.
        placing = {d.name for d in members if d.phase is Phase.PENDING}
        for choice in choices_of(candidate[0]) if placing else ():
            as_choice = reclassed(candidate, placing, choice) if len(candidate[0].choices) > 1 else candidate
            if borrow_terms(ledger, limits, key, ledger.used_delta(key, as_choice))[0] is None:
                return None
    return refusal


def conclude(review: Review, view: MirrorView, answers: Mapping[str, str]) -> Verdict:
    """Turn the binder's answers (device name -> ``status.answer``) into the verdict.

    Every device answered ``bound:<node>`` with one node: allow with the patch. Any
    ``refused:<reason>``: deny with the binder's reason, as it wrote it.
    """
    vmi = f"VMI {review.namespace}/{review.name}"
    for name in sorted(answers):
        answer = answers[name]
        if answer.startswith(ANSWER_REFUSED):
            reason = answer.removeprefix(ANSWER_REFUSED).strip() or "no reason given"
            return _deny(review, f"{vmi}: the binder could not place its GPUs: {reason}")
    nodes = set()
    for name in sorted(answers):
        answer = answers[name]
        if not answer.startswith(ANSWER_BOUND) or not answer.removeprefix(ANSWER_BOUND):
            return _deny(
                review, f"{vmi}: unexpected answer {answer!r:.100} for device {DEVICE_PREFIX}{name}; try again"
            )
        nodes.add(answer.removeprefix(ANSWER_BOUND))
    if len(nodes) != 1:
        listed = ", ".join(sorted(nodes)) or "none"
        return _deny(review, f"{vmi}: the set's devices were answered with different nodes ({listed}); try again")
    (node,) = nodes
    return _patched(review, view, node)


def timed_out(review: Review, seconds: float) -> Verdict:
    """No answer in time: deny, telling the user a retry may well succeed."""
    return _deny(
        review,
        f"VMI {review.namespace}/{review.name}: the binder did not answer within {seconds:g}s "
        "(it may be busy with a full pass); try again",
    )


def no_time_to_bind(review: Review, margin: float) -> Verdict:
    """The set is Pending and the call has no time left to bind it: the apiserver's
    timeoutSeconds is too short for a wait (the webhook answers ``margin`` seconds before
    it), or the call spent its time queued. Nothing was written; say so, and what to change."""
    return _deny(
        review,
        f"VMI {review.namespace}/{review.name}: its GPUs are not bound yet and no time is left in this call "
        f"to bind them (the webhook answers {margin:g}s before the apiserver's timeoutSeconds: a call that "
        "waited for a free thread, or a timeoutSeconds under 2, leaves none; deploy/ registers 10); try again",
    )


def too_many_waiting(review: Review, limit: int) -> Verdict:
    """This process already holds ``limit`` calls waiting for the binder: shed this one at once."""
    return _deny(
        review,
        f"VMI {review.namespace}/{review.name}: the webhook is already waiting for the binder on {limit} "
        "calls, as many as it holds at once (GPUPLANE_WEBHOOK_MAX_WAITING); try again",
    )


def overloaded(review: Review, busy: int) -> Verdict:
    """This process already has ``busy`` calls admitted, as many as it holds at once: shed this
    one at once, before it queues behind them past the apiserver's deadline."""
    return _deny(
        review,
        f"VMI {review.namespace}/{review.name}: the webhook is busy with {busy} calls, as many as it "
        "holds at once (GPUPLANE_WEBHOOK_THREADS + GPUPLANE_WEBHOOK_QUEUE); try again",
    )


def set_changed(review: Review) -> Verdict:
    """The set's rows changed between the decision and the bind-request write."""
    return _deny(
        review, f"VMI {review.namespace}/{review.name}: its set of GPU devices changed while it was checked; try again"
    )


def set_kept_moving(review: Review, tries: int) -> Verdict:
    """The set moved (or was released) under each of ``tries`` admissions in a row."""
    return _deny(
        review,
        f"VMI {review.namespace}/{review.name}: its GPUs were being moved by the binder while it was admitted "
        f"({tries} times in a row); try again",
    )


def device_gone(review: Review, device: str) -> Verdict:
    """A device was deleted, or moved to another VM, while the call waited: it will never answer."""
    return _deny(
        review,
        f"VMI {review.namespace}/{review.name}: device gpuplane.io/{device} was deleted "
        f"or no longer belongs to VM {review.name}; try again",
    )


def answer_pass_failed(review: Review) -> Verdict:
    """The bind requests are written but running or publishing the answer pass failed."""
    return _deny(review, f"VMI {review.namespace}/{review.name}: the binder could not run an answer pass; try again")


def bind_request_refused(review: Review, why: str) -> Verdict:
    """Cluster mode: the API server refused the bind-request annotation."""
    return _deny(
        review, f"VMI {review.namespace}/{review.name}: the API server refused the bind request ({why}); try again"
    )


def database_unavailable(review: Review) -> Verdict:
    """The database went away (dropped connection, restart, failover): retryable, never a 500."""
    return _deny(review, f"VMI {review.namespace}/{review.name}: the gpuplane database is unavailable; try again")


def _deny(review: Review, message: str) -> Verdict:
    return Verdict(Action.DENY, review.uid, message=message)


#: What a VM starting on a node that refuses new pods can wait for, by ``refuses_new``'s word.
_STUCK_ADVICE = {
    "NotReady": "which is NotReady: its launcher could not start there. The binder moves the set once the node "
    "has been NotReady for GPUPLANE_NODE_GRACE_SECONDS; KubeVirt retries the start",
    "cordoned": "which is cordoned: kube-scheduler places no new pod there. Uncordon it, or label it "
    "gpuplane.io/drain=true to have the binder move its sets; then start the VM again",
    "draining": "which is labelled gpuplane.io/drain=true: the binder is moving the set; try again",
}


def cannot_start(node: Node, classes: Sequence[GpuClass]) -> str | None:
    """Why a launcher pinned to ``node`` could not start there now, or None. A set keeps its node
    while it cannot take anything new (SPEC §4 step 2), but a VMI pinned there would wait for a
    pod kube-scheduler never places, and the set may move away meanwhile: refuse it instead, saying
    what the operator or the binder does next."""
    why = refuses_new(node, classes)
    if why is None:
        return None
    return _STUCK_ADVICE.get(why, f"which its launcher cannot use now ({why}); the binder moves a set off a node "
                                  "its class no longer matches, but never for a taint")  # fmt: skip


def _patched(review: Review, view: MirrorView, node: str) -> Verdict:
    """Allow with the patch pinning the VMI to ``node``, unless its own constraints exclude it.

    The pin uses the node's own ``kubernetes.io/hostname`` label (not its name: they differ
    on EKS); a node without the label, or missing from the view, is pinned by name through
    a required node affinity.
    """
    found = view.index().nodes.get(node)
    classes = {c.name: c for c in view.classes}
    devices = view.index().by_name
    held_as = [classes[devices[name].class_name] for name in review.device_names]
    stuck = cannot_start(found, held_as) if found is not None else None
    if stuck:
        return _deny(review, f"VMI {review.namespace}/{review.name}: its GPUs are held on node {node}, {stuck}")
    conflict = scheduling_conflict(review.scheduling, found, node)
    if conflict:
        return _deny(
            review,
            f"VMI {review.namespace}/{review.name}: its GPUs are on node {node}, "
            f"which the VMI's own scheduling constraints exclude: {conflict}",
        )
    resources = {}
    wanted = []
    for name in review.device_names:
        cls = classes[devices[name].class_name]
        resources[name] = (cls.resource_name, cls.units_per_device)
        wanted.append(cls)
    hostname = found.labels.get(HOSTNAME_LABEL) if found is not None else None
    ops = build_patch(
        review.vmi,
        node,
        resources,
        hostname=hostname or None,
        tolerations=missing_tolerations(review.scheduling.tolerations, wanted),
    )
    return Verdict(Action.PATCH, review.uid, node=node, patch=tuple(ops))


def response(verdict: Verdict) -> dict[str, Any]:
    """The AdmissionReview v1 response for a final verdict (not ``BIND``).

    Mutating webhooks return patch and patchType together or neither; a denial carries
    ``status.code`` 403 (the apiserver would turn an unset code into 400) and the message
    the user sees after ``admission webhook "..." denied the request:``.
    """
    if verdict.action is Action.BIND:
        raise ValueError("a BIND verdict has no response yet: the binder must answer first")
    body: dict[str, Any] = {"uid": verdict.uid, "allowed": verdict.action is not Action.DENY}
    if verdict.action is Action.DENY:
        body["status"] = {"code": DENIED_CODE, "message": verdict.message}
    elif verdict.action is Action.PATCH:
        body["patchType"] = "JSONPatch"
        body["patch"] = encode_patch(verdict.patch)
    if verdict.warnings:
        body["warnings"] = list(verdict.warnings)
    return {"apiVersion": REVIEW_API_VERSION, "kind": REVIEW_KIND, "response": body}


__all__ = [
    "Action",
    "DeviceIndex",
    "MirrorView",
    "Verdict",
    "advisory_budget_refusal",
    "conclude",
    "decide",
    "overloaded",
    "response",
    "scheduling_conflict",
    "timed_out",
    "too_many_waiting",
]
