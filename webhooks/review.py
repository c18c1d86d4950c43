"""Reading an AdmissionReview: the strict, Django-free parser of what the VMI webhook is sent.

A malformed review is the caller's fault and must never become a 500 (or, worse, an
allow): :func:`parse_review` checks every field the decision reads, on the way to each
``deviceName``, and raises :class:`ReviewError` naming the field; the HTTP side answers
400 with :func:`error_body`. Only a VMI that names gpuplane devices has its scheduling
constraints (nodeSelector, required node affinity, tolerations) read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from binder.engine.matching import FIELD_OPERATORS, LABEL_OPERATORS, Requirement, Term
from binder.kube.objects import text_problem

#: A VMI names a gpuplane device with ``deviceName: gpuplane.io/<GPU name>``.
DEVICE_PREFIX = "gpuplane.io/"
REQUIRED_AFFINITY = "requiredDuringSchedulingIgnoredDuringExecution"
REVIEW_API_VERSION = "admission.k8s.io/v1"
REVIEW_KIND = "AdmissionReview"
VMI_GROUP = "kubevirt.io"
VMI_KIND = "VirtualMachineInstance"
#: The lists of ``spec.domain.devices`` whose entries carry a ``deviceName``.
DEVICE_SECTIONS = ("gpus", "hostDevices")
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
class Scheduling:
    """Where the VMI itself says it may run: checked against the node holding its GPUs,
    so a pin never silently overrides the user's own constraints.

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
    # ASCII text can only be refused for a NUL: the scan for lone surrogates (per character,
    # in Python) is for the rest; every review's dozen strings are almost always ASCII.
    problem = None if value.isascii() and "\x00" not in value else text_problem(value)
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


def error_body(error: ReviewError) -> dict[str, Any]:
    """The JSON body of the HTTP 400 a malformed review gets."""
    return {"error": error.message, "field": error.field}


__all__ = [
    "DEVICE_PREFIX",
    "Named",
    "Requirement",
    "Review",
    "ReviewError",
    "Scheduling",
    "Term",
    "error_body",
    "parse_review",
    "parse_scheduling",
]
