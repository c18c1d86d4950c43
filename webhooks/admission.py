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
#: The node label the patch pins the VMI with.
HOSTNAME_LABEL = "kubernetes.io/hostname"
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
    other namespaces are ignored); ``classes`` are all GPU classes. ``enabled`` and
    ``default_budget`` are the settings ``GPUPLANE_ENABLED`` and
    ``GPUPLANE_DEFAULT_BUDGET``.
    """

    namespace: str
    enabled: bool = True
    devices: tuple[Device, ...] = ()
    classes: tuple[GpuClass, ...] = ()
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
    return Review(
        uid=uid,
        namespace=namespace,
        name=name,
        operation=operation,
        dry_run=dry_run,
        vmi=obj,
        named=tuple(named),
    )


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


def _patched(review: Review, view: MirrorView, node: str) -> Verdict:
    classes = {c.name: c for c in view.classes}
    devices = {d.name: d for d in view.devices if d.namespace == review.namespace}
    resources = {}
    for name in review.device_names:
        cls = classes[devices[name].class_name]
        resources[name] = (cls.resource_name, cls.units_per_device)
    return Verdict(Action.PATCH, review.uid, node=node, patch=tuple(build_patch(review.vmi, node, resources)))


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


def build_patch(vmi: Mapping[str, Any], node: str, resources: Mapping[str, tuple[str, int]]) -> list[dict[str, Any]]:
    """JSONPatch ops that pin ``vmi`` to ``node`` and rewrite its gpuplane deviceNames.

    ``resources`` maps each named device to its class's (raw resource name, units per
    device). KubeVirt adds 1 of a deviceName's resource per entry, so a device of N
    units becomes N entries; entry names stay unique (``gpu0``, ``gpu0-1``, ...) across
    both device lists, as KubeVirt requires. The node selector is added to (or
    created as) ``spec.nodeSelector`` without touching other labels there.
    """
    spec = vmi.get("spec")
    ops: list[dict[str, Any]] = []
    if not isinstance(spec, Mapping):
        return [{"op": "add", "path": _pointer("spec"), "value": {"nodeSelector": {HOSTNAME_LABEL: node}}}]
    selector = spec.get("nodeSelector")
    if isinstance(selector, Mapping):
        ops.append({"op": "add", "path": _pointer("spec", "nodeSelector", HOSTNAME_LABEL), "value": node})
    else:
        ops.append({"op": "add", "path": _pointer("spec", "nodeSelector"), "value": {HOSTNAME_LABEL: node}})

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
    "Review",
    "ReviewError",
    "Verdict",
    "advisory_budget_refusal",
    "build_patch",
    "conclude",
    "decide",
    "encode_patch",
    "error_body",
    "parse_review",
    "response",
    "timed_out",
]
