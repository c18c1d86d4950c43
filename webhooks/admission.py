"""The VMI admission decision (SPEC §5), as pure functions of the review and the mirror.

The webhook sits in the path of every VMI start, behind a 10 s timeout and a
``failurePolicy``, so what it decides must be easy to test exhaustively and impossible
to get wrong by a database detail. Hence the split: this module never imports Django
and never does I/O. It parses the AdmissionReview (:func:`parse_review`, raising
:class:`ReviewError` naming the bad field), decides from the review plus a read-only
:class:`MirrorView` of the VMI's namespace (:func:`decide`), turns the binder's answers
into a verdict (:func:`conclude`), builds the JSONPatch (:func:`build_patch`) and the
AdmissionReview v1 response (:func:`response`). ``webhooks.views`` only fills the
view, writes the bind requests and waits for the answers.

Budgets are checked with the engine's own ledger and ``budget_refusal``, so an
advisory denial here carries the very sentence the binder would write; the binder
still re-checks at bind time (admission checks are advisory, SPEC §4).
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jsonpatch
import jsonpointer

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
from binder.kube.objects import text_problem

#: A VMI names a gpuplane device with ``deviceName: gpuplane.io/<GPU name>``.
DEVICE_PREFIX = "gpuplane.io/"
#: The node label the patch pins the VMI with: its value is the node's own label, which
#: may differ from the node's name (on EKS the name is the full DNS name, the label the short one).
HOSTNAME_LABEL = "kubernetes.io/hostname"
#: The node field a required node affinity pins by where a node has no hostname label.
NAME_FIELD = "metadata.name"
REQUIRED_AFFINITY = "requiredDuringSchedulingIgnoredDuringExecution"
#: Node selector requirement operators (core/v1 NodeSelectorOperator) and the field ones.
LABEL_OPERATORS = frozenset({"In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"})
FIELD_OPERATORS = frozenset({"In", "NotIn"})
REVIEW_API_VERSION = "admission.k8s.io/v1"
REVIEW_KIND = "AdmissionReview"
VMI_GROUP = "kubevirt.io"
VMI_KIND = "VirtualMachineInstance"
#: The lists of ``spec.domain.devices`` whose entries carry a ``deviceName``.
DEVICE_SECTIONS = ("gpus", "hostDevices")
#: HTTP status code put in ``response.status`` on denial (below 400 the apiserver makes it 400).
DENIED_CODE = 403
#: Kubernetes UIDs are at most 36 characters; anything far longer is not a real review.
UID_MAX = 128


class ReviewError(ValueError):
    """The request is not an AdmissionReview v1 for a VMI; ``field`` says where it went wrong.

    The view answers these with HTTP 400 and a JSON body: a malformed review is the
    caller's fault and must never become a 500 (or, worse, an allow).
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True, slots=True)
class Named:
    """One ``spec.domain.devices.<section>[index]`` entry that names a gpuplane device."""

    section: str
    index: int
    device: str


@dataclass(frozen=True, slots=True)
class Requirement:
    """One node selector requirement (``matchExpressions`` on labels, ``matchFields`` on fields)."""

    key: str
    operator: str
    values: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Term:
    """One ``nodeSelectorTerms`` entry: its requirements are ANDed; terms are ORed."""

    expressions: tuple[Requirement, ...] = ()
    fields: tuple[Requirement, ...] = ()


@dataclass(frozen=True, slots=True)
class Scheduling:
    """Where the VMI itself says it may run: checked against the node holding its GPUs,
    so a pin never silently overrides the user's own constraints (SPEC §5 step 3).

    ``required`` is None when the VMI has no required node affinity (an empty tuple would
    be a required affinity with no terms, which no node satisfies).
    """

    node_selector: Mapping[str, str] = dataclasses.field(default_factory=dict)
    required: tuple[Term, ...] | None = None
    tolerations: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class Review:
    """What the decision needs from an AdmissionReview request, already type-checked.

    ``vmi`` is the request's object as sent (the patch is computed against it).
    ``name`` is "" when the VMI has only a ``generateName``.
    """

    uid: str
    namespace: str
    name: str
    operation: str
    dry_run: bool
    vmi: Mapping[str, Any]
    named: tuple[Named, ...]
    scheduling: Scheduling = Scheduling()

    @property
    def device_names(self) -> tuple[str, ...]:
        """The named devices, each once, in the order the VMI names them."""
        return tuple(dict.fromkeys(n.device for n in self.named))

    @property
    def needs_mirror(self) -> bool:
        """False on the fast path: nothing of gpuplane's to decide, so no reads at all."""
        return self.operation == "CREATE" and bool(self.named)


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


# -- parsing -------------------------------------------------------------------------------


def _mapping(value: Any, field: str, *, required: bool = False) -> Mapping[str, Any]:
    if value is None:
        if required:
            raise ReviewError(field, "is required")
        return {}
    if not isinstance(value, Mapping):
        raise ReviewError(field, f"must be an object, got {_type(value)}")
    return value


def _string(value: Any, field: str, *, required: bool = False, max_length: int = 253) -> str:
    if value is None or (value == "" and not required):
        if required:
            raise ReviewError(field, "is required")
        return ""
    if not isinstance(value, str):
        raise ReviewError(field, f"must be a string, got {_type(value)}")
    if required and not value:
        raise ReviewError(field, "must not be empty")
    if len(value) > max_length:
        raise ReviewError(field, f"is longer than {max_length} characters")
    problem = text_problem(value)
    if problem is not None:
        # "\ud800" in JSON decodes to a lone surrogate, which cannot be encoded (the answer
        # echoes the uid; the database reads the namespace): a 500 before; a NUL as well.
        raise ReviewError(field, problem)
    return value


def _type(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}.get(
        type(value), "null" if value is None else "a number" if isinstance(value, int | float) else type(value).__name__
    )


def _group(api_version: str) -> str:
    return api_version.rsplit("/", 1)[0] if "/" in api_version else ""


def parse_review(body: Any) -> Review:  # noqa: C901 - one check per field of the review, in order
    """Check an AdmissionReview v1 for a VMI and extract what :func:`decide` reads.

    Only fields the decision uses are checked, but each of those strictly: a wrong type
    anywhere on the way to a deviceName raises :class:`ReviewError` naming the field.
    """
    if not isinstance(body, Mapping):
        raise ReviewError("(body)", f"must be an AdmissionReview object, got {_type(body)}")
    api_version = body.get("apiVersion")
    if api_version != REVIEW_API_VERSION:
        raise ReviewError("apiVersion", f"must be {REVIEW_API_VERSION}, got {api_version!r:.80}")
    if body.get("kind") != REVIEW_KIND:
        raise ReviewError("kind", f"must be {REVIEW_KIND}, got {body.get('kind')!r:.80}")
    request = _mapping(body.get("request"), "request", required=True)
    uid = _string(request.get("uid"), "request.uid", required=True, max_length=UID_MAX)

    kind = _mapping(request.get("kind"), "request.kind", required=True)
    group = _string(kind.get("group"), "request.kind.group")
    kind_name = _string(kind.get("kind"), "request.kind.kind", required=True)
    if (group, kind_name) != (VMI_GROUP, VMI_KIND):
        raise ReviewError(
            "request.kind", f"this webhook admits {VMI_GROUP} {VMI_KIND} only, got {group or 'core'} {kind_name}"
        )
    operation = _string(request.get("operation"), "request.operation") or "CREATE"
    dry_run = request.get("dryRun", False)
    if dry_run is None:
        dry_run = False
    if not isinstance(dry_run, bool):
        raise ReviewError("request.dryRun", f"must be a boolean, got {_type(dry_run)}")

    obj = _mapping(request.get("object"), "request.object", required=True)
    obj_kind = _string(obj.get("kind"), "request.object.kind")
    if obj_kind and obj_kind != VMI_KIND:
        raise ReviewError("request.object.kind", f"must be {VMI_KIND}, got {obj_kind!r}")
    obj_api = _string(obj.get("apiVersion"), "request.object.apiVersion")
    if obj_api and _group(obj_api) != VMI_GROUP:
        raise ReviewError("request.object.apiVersion", f"must be in group {VMI_GROUP}, got {obj_api!r}")
    meta = _mapping(obj.get("metadata"), "request.object.metadata")
    name = _string(meta.get("name"), "request.object.metadata.name")
    namespace = _string(request.get("namespace"), "request.namespace", max_length=63) or _string(
        meta.get("namespace"), "request.object.metadata.namespace", max_length=63
    )
    if not namespace:
        raise ReviewError("request.namespace", "is required (a VMI is namespaced)")

    spec = _mapping(obj.get("spec"), "request.object.spec")
    domain = _mapping(spec.get("domain"), "request.object.spec.domain")
    devices = _mapping(domain.get("devices"), "request.object.spec.domain.devices")
    named: list[Named] = []
    for section in DEVICE_SECTIONS:
        where = f"request.object.spec.domain.devices.{section}"
        entries = devices.get(section)
        if entries is None:
            continue
        if not isinstance(entries, list):
            raise ReviewError(where, f"must be an array, got {_type(entries)}")
        for index, entry in enumerate(entries):
            entry = _mapping(entry, f"{where}[{index}]", required=True)
            device_name = _string(entry.get("deviceName"), f"{where}[{index}].deviceName")
            _string(entry.get("name"), f"{where}[{index}].name")
            if device_name.startswith(DEVICE_PREFIX):
                named.append(Named(section, index, device_name.removeprefix(DEVICE_PREFIX)))
    # Only a VMI that names gpuplane devices is pinned, so only its constraints are read:
    # every other VMI stays on the fast path, untouched.
    scheduling = parse_scheduling(spec, "request.object.spec") if named else Scheduling()
    return Review(
        uid=uid,
        namespace=namespace,
        name=name,
        operation=operation,
        dry_run=dry_run,
        vmi=obj,
        named=tuple(named),
        scheduling=scheduling,
    )


def _strings(value: Any, field: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ReviewError(field, f"must be an array of strings, got {_type(value)}")
    return tuple(_string(v, f"{field}[{i}]", required=True, max_length=316) for i, v in enumerate(value))


def _requirements(value: Any, field: str, operators: frozenset[str]) -> tuple[Requirement, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ReviewError(field, f"must be an array, got {_type(value)}")
    found = []
    for i, entry in enumerate(value):
        where = f"{field}[{i}]"
        entry = _mapping(entry, where, required=True)
        key = _string(entry.get("key"), f"{where}.key", required=True, max_length=316)
        operator = _string(entry.get("operator"), f"{where}.operator", required=True)
        if operator not in operators:
            allowed = ", ".join(sorted(operators))
            raise ReviewError(f"{where}.operator", f"must be one of {allowed}, got {operator!r:.40}")
        found.append(Requirement(key, operator, _strings(entry.get("values"), f"{where}.values")))
    return tuple(found)


def parse_scheduling(spec: Mapping[str, Any], field: str) -> Scheduling:
    """The VMI's ``nodeSelector``, required node affinity and tolerations, type-checked.

    The apiserver has decoded the object already, so a wrong type here means a hand-made
    review; it is refused with the field's name (HTTP 400), never guessed at.
    """
    raw_selector = _mapping(spec.get("nodeSelector"), f"{field}.nodeSelector")
    selector = {
        _string(k, f"{field}.nodeSelector", required=True, max_length=316): _string(
            v, f"{field}.nodeSelector[{k!r}]", max_length=63
        )
        for k, v in raw_selector.items()
    }
    affinity = _mapping(spec.get("affinity"), f"{field}.affinity")
    node_affinity = _mapping(affinity.get("nodeAffinity"), f"{field}.affinity.nodeAffinity")
    required: tuple[Term, ...] | None = None
    where = f"{field}.affinity.nodeAffinity.{REQUIRED_AFFINITY}"
    if node_affinity.get(REQUIRED_AFFINITY) is not None:
        raw = _mapping(node_affinity.get(REQUIRED_AFFINITY), where)
        terms = raw.get("nodeSelectorTerms")
        if not isinstance(terms, list):
            raise ReviewError(f"{where}.nodeSelectorTerms", f"must be an array, got {_type(terms)}")
        parsed = []
        for i, raw_term in enumerate(terms):
            at = f"{where}.nodeSelectorTerms[{i}]"
            term = _mapping(raw_term, at, required=True)
            parsed.append(
                Term(
                    _requirements(term.get("matchExpressions"), f"{at}.matchExpressions", LABEL_OPERATORS),
                    _requirements(term.get("matchFields"), f"{at}.matchFields", FIELD_OPERATORS),
                )
            )
        required = tuple(parsed)
    raw_tolerations = spec.get("tolerations")
    if raw_tolerations is not None and not isinstance(raw_tolerations, list):
        raise ReviewError(f"{field}.tolerations", f"must be an array, got {_type(raw_tolerations)}")
    tolerations = tuple(
        _mapping(t, f"{field}.tolerations[{i}]", required=True) for i, t in enumerate(raw_tolerations or ())
    )
    return Scheduling(selector, required, tolerations)


# -- node constraints (what the scheduler checks) ----------------------------------------------


def _label_requirement_holds(req: Requirement, labels: Mapping[str, str]) -> bool:
    value = labels.get(req.key)
    match req.operator:
        case "In":
            return value is not None and value in req.values
        case "NotIn":
            return value is None or value not in req.values
        case "Exists":
            return value is not None
        case "DoesNotExist":
            return value is None
        case _:  # Gt, Lt: integers, one value
            if value is None or len(req.values) != 1:
                return False
            try:
                have, want = int(value), int(req.values[0])
            except ValueError:
                return False
            return have > want if req.operator == "Gt" else have < want


def _field_requirement_holds(req: Requirement, node_name: str) -> bool:
    if req.key != NAME_FIELD:
        return False  # the scheduler supports metadata.name only
    return (node_name in req.values) == (req.operator == "In")


def term_matches(term: Term, node: Node) -> bool:
    """Whether ``node`` satisfies one node selector term; an empty term matches no node."""
    if not term.expressions and not term.fields:
        return False
    return all(_label_requirement_holds(r, node.labels) for r in term.expressions) and all(
        _field_requirement_holds(r, node.name) for r in term.fields
    )


def _describe(req: Requirement) -> str:
    values = f" [{', '.join(req.values)}]" if req.values else ""
    return f"{req.key} {req.operator}{values}"


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
        unmet = [
            _describe(r)
            for t in scheduling.required
            for r in t.expressions
            if not _label_requirement_holds(r, node.labels)
        ] + [_describe(r) for t in scheduling.required for r in t.fields if not _field_requirement_holds(r, node.name)]
        detail = f" (unmet: {'; '.join(unmet)})" if unmet else " (an empty term matches no node)"
        return f"{where}: no nodeSelectorTerm matches node {node_name}, which holds its GPUs{detail}"
    return None


# -- deciding ------------------------------------------------------------------------------


def decide(review: Mapping[str, Any] | Review, view: MirrorView) -> Verdict:  # noqa: C901 - SPEC §5 steps 1-3 in order
    """Decide a VMI CREATE from the review and the mirror (SPEC §5 steps 1-3).

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

    devices = {d.name: d for d in view.devices if d.namespace == r.namespace}
    for name in r.device_names:
        device = devices.get(name)
        if device is None:
            return _deny(r, f"{vmi}: device {DEVICE_PREFIX}{name} does not exist in namespace {r.namespace}")
        if device.vm_name != r.name:
            return _deny(r, f"{vmi}: device {DEVICE_PREFIX}{name} belongs to VM {device.vm_name}, not to {r.name}")
    members = sorted((d for d in devices.values() if d.vm_name == r.name), key=lambda d: d.name)
    missing = [d.name for d in members if d.name not in seen]
    if missing:
        listed = ", ".join(DEVICE_PREFIX + m for m in missing)
        return _deny(r, f"{vmi} names only part of its set of {len(members)} devices; it must also name {listed}")
    classes = {c.name: c for c in view.classes}
    for device in members:
        if device.class_name not in classes:
            return _deny(
                r, f"{vmi}: device {DEVICE_PREFIX}{device.name} has class {device.class_name}, which does not exist"
            )

    nodes = {d.node for d in members}
    if all(d.phase is Phase.BOUND for d in members) and len(nodes) == 1:
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
    budget of its tenant, else None (SPEC §5 step 2).

    Uses the engine's ledger over the namespace's devices, pods and VMIs (the shared
    launcher reader decides which pods are launchers) and its ``budget_refusal``; Bound
    and Lost members already count, so only Pending ones can add usage.
    """
    namespace = key[0]
    ledger = build_ledger(
        classes=view.classes,
        devices=(d for d in view.devices if d.namespace == namespace),
        pods=(p for p in view.pods if p.namespace == namespace),
        vmis=(v for v in view.vmis if v.namespace == namespace),
    )
    limits = effective_limits((b for b in view.budgets if b.namespace == namespace), view.default_budget)
    candidate = tuple(
        dataclasses.replace(d, phase=Phase.BOUND, node="-") if d.phase is Phase.PENDING else d
        for d in sorted(members, key=lambda d: d.key)
    )
    return budget_refusal(ledger, limits, key, candidate)


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


# -- denials of the bind-and-wait (``webhooks.binding``): every message of the webhook is here --


def set_changed(review: Review) -> Verdict:
    """The set's rows changed between the decision and the bind-request write."""
    return _deny(
        review, f"VMI {review.namespace}/{review.name}: its set of GPU devices changed while it was checked; try again"
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


def _normal_toleration(raw: Mapping[str, Any]) -> tuple[str, str, str, str, Any]:
    return (
        str(raw.get("key") or ""),
        str(raw.get("operator") or "Equal"),
        str(raw.get("value") or ""),
        str(raw.get("effect") or ""),
        raw.get("tolerationSeconds"),
    )


def missing_tolerations(
    have: Sequence[Mapping[str, Any]], classes: Sequence[GpuClass]
) -> list[dict[str, object]]:
    """The classes' tolerations the VMI does not list yet, each once, in class order.

    The binder placed the set only where the classes' tolerations tolerate every blocking
    taint, so the launcher pod must carry them too (as RuntimeClass admission merges its
    scheduling tolerations into pods); one the VMI already has is not repeated.
    """
    seen = {_normal_toleration(t) for t in have}
    added = []
    for cls in classes:
        for toleration in cls.tolerations:
            spelled = toleration.as_kubernetes()
            normal = _normal_toleration(spelled)
            if normal not in seen:
                seen.add(normal)
                added.append(spelled)
    return added


def _patched(review: Review, view: MirrorView, node: str) -> Verdict:
    """Allow with the patch pinning the VMI to ``node``, unless its own constraints exclude it.

    The pin uses the node's own ``kubernetes.io/hostname`` label (not its name: they differ
    on EKS); a node without the label, or missing from the view, is pinned by name through
    a required node affinity.
    """
    nodes = {n.name: n for n in view.nodes}
    found = nodes.get(node)
    conflict = scheduling_conflict(review.scheduling, found, node)
    if conflict:
        return _deny(
            review,
            f"VMI {review.namespace}/{review.name}: its GPUs are on node {node}, "
            f"which the VMI's own scheduling constraints exclude: {conflict}",
        )
    classes = {c.name: c for c in view.classes}
    devices = {d.name: d for d in view.devices if d.namespace == review.namespace}
    resources = {}
    for name in review.device_names:
        cls = classes[devices[name].class_name]
        resources[name] = (cls.resource_name, cls.units_per_device)
    hostname = found.labels.get(HOSTNAME_LABEL) if found is not None else None
    wanted = [classes[devices[name].class_name] for name in review.device_names]
    ops = build_patch(
        review.vmi,
        node,
        resources,
        hostname=hostname or None,
        tolerations=missing_tolerations(review.scheduling.tolerations, wanted),
    )
    return Verdict(Action.PATCH, review.uid, node=node, patch=tuple(ops))


# -- patch and response --------------------------------------------------------------------


def _pointer(*parts: str) -> str:
    """An RFC 6901 pointer; ``/`` in a key becomes ``~1`` (``kubernetes.io~1hostname``)."""
    return str(jsonpointer.JsonPointer.from_parts(parts).path)


def _unique(base: str, taken: set[str]) -> str:
    candidate, n = base, 0
    while candidate in taken:
        n += 1
        candidate = f"{base}-{n}"
    taken.add(candidate)
    return candidate


def _pin_ops(spec: Mapping[str, Any], node: str, hostname: str | None) -> list[dict[str, Any]]:
    """The ops that pin the VMI: the hostname label in ``spec.nodeSelector``, else a
    ``metadata.name`` field requirement added to every required node affinity term (a new
    required affinity with one term where there is none), so the ORed terms all pin."""
    if hostname is not None:
        if isinstance(spec.get("nodeSelector"), Mapping):
            return [{"op": "add", "path": _pointer("spec", "nodeSelector", HOSTNAME_LABEL), "value": hostname}]
        return [{"op": "add", "path": _pointer("spec", "nodeSelector"), "value": {HOSTNAME_LABEL: hostname}}]
    pin = {"key": NAME_FIELD, "operator": "In", "values": [node]}
    affinity = copy.deepcopy(dict(spec.get("affinity") or {}))
    node_affinity = dict(affinity.get("nodeAffinity") or {})
    required = dict(node_affinity.get(REQUIRED_AFFINITY) or {})
    terms = [dict(t) for t in required.get("nodeSelectorTerms") or ()]
    if terms:
        for term in terms:
            term["matchFields"] = [*(term.get("matchFields") or ()), pin]
    else:
        terms = [{"matchFields": [pin]}]
    required["nodeSelectorTerms"] = terms
    node_affinity[REQUIRED_AFFINITY] = required
    affinity["nodeAffinity"] = node_affinity
    return [{"op": "add", "path": _pointer("spec", "affinity"), "value": affinity}]


def build_patch(
    vmi: Mapping[str, Any],
    node: str,
    resources: Mapping[str, tuple[str, int]],
    *,
    hostname: str | None,
    tolerations: Sequence[Mapping[str, Any]] = (),
) -> list[dict[str, Any]]:
    """JSONPatch ops that pin ``vmi`` to ``node`` and rewrite its gpuplane deviceNames.

    ``hostname`` is the node's own ``kubernetes.io/hostname`` label (None: the node has
    none, and the pin is a required node affinity on ``metadata.name``). ``resources``
    maps each named device to its class's (raw resource name, units per device). KubeVirt
    adds 1 of a deviceName's resource per entry, so a device of N units becomes N entries;
    entry names stay unique (``gpu0``, ``gpu0-1``, ...) across both device lists, as
    KubeVirt requires. Other labels of ``spec.nodeSelector`` stay as they are.
    ``tolerations`` are appended to ``spec.tolerations`` (the caller passes only those the
    VMI lacks).
    """
    spec = vmi.get("spec")
    if not isinstance(spec, Mapping):
        spec = {}
        ops: list[dict[str, Any]] = [{"op": "add", "path": _pointer("spec"), "value": {}}]
    else:
        ops = []
    ops.extend(_pin_ops(spec, node, hostname))
    if tolerations:
        if isinstance(spec.get("tolerations"), list):
            end = _pointer("spec", "tolerations", "-")
            ops.extend({"op": "add", "path": end, "value": dict(t)} for t in tolerations)
        else:
            ops.append({"op": "add", "path": _pointer("spec", "tolerations"), "value": [dict(t) for t in tolerations]})

    devices = ((spec.get("domain") or {}).get("devices")) or {}
    sections = {s: list(devices.get(s) or []) for s in DEVICE_SECTIONS}
    taken: set[str] = set()
    for entries in sections.values():
        for entry in entries:
            if not str(entry.get("deviceName") or "").startswith(DEVICE_PREFIX) and entry.get("name"):
                taken.add(str(entry["name"]))
    for section, entries in sections.items():
        if not any(str(e.get("deviceName") or "").startswith(DEVICE_PREFIX) for e in entries):
            continue
        rewritten: list[dict[str, Any]] = []
        for entry in entries:
            device_name = str(entry.get("deviceName") or "")
            if not device_name.startswith(DEVICE_PREFIX):
                rewritten.append(dict(entry))
                continue
            device = device_name.removeprefix(DEVICE_PREFIX)
            resource, units = resources[device]
            base = str(entry.get("name") or f"gpuplane-{device}")
            rewritten.extend({**entry, "deviceName": resource, "name": _unique(base, taken)} for _ in range(units))
        ops.append({"op": "replace", "path": _pointer("spec", "domain", "devices", section), "value": rewritten})
    return ops


def encode_patch(ops: Sequence[Mapping[str, Any]]) -> str:
    """Base64 of the RFC 6902 array, as ``response.patch`` carries it."""
    text = jsonpatch.JsonPatch([dict(op) for op in ops]).to_string()
    return base64.b64encode(text.encode()).decode("ascii")


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


def error_body(error: ReviewError) -> dict[str, Any]:
    """The JSON body of the HTTP 400 a malformed review gets."""
    return {"error": error.message, "field": error.field}


__all__ = [
    "Action",
    "MirrorView",
    "Named",
    "Requirement",
    "Review",
    "ReviewError",
    "Scheduling",
    "Term",
    "Verdict",
    "advisory_budget_refusal",
    "build_patch",
    "conclude",
    "decide",
    "encode_patch",
    "error_body",
    "missing_tolerations",
    "parse_review",
    "parse_scheduling",
    "response",
    "scheduling_conflict",
    "term_matches",
    "timed_out",
]
