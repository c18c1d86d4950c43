"""gpuplane's own custom resources (API group ``gpuplane.io``): GPUClass, GPU (an order of
one device, with its class choices and the webhook's bind annotations) and GPUBudget, each
read into plain row values for the mirror.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from binder.engine.choices import MAX_ALTERNATIVES
from binder.kube.core import parse_tolerations
from binder.kube.fields import NAME_MAX, REQUEST_ID_MAX, Parsed, Reader, check_api, quote

GROUP = "gpuplane.io"
BIND_REQUEST_ANNOTATION = "gpuplane.io/bind-request"
#: The VMI's own nodeSelector, as JSON, written by the webhook with the bind request.
BIND_NODE_SELECTOR_ANNOTATION = "gpuplane.io/bind-node-selector"
#: When the webhook allowed a VMI pinned to the set (RFC 3339), on the set's first member.
ADMITTED_ANNOTATION = "gpuplane.io/admitted"
#: ``"true"`` (any case) keeps a VM's set on its node: making room never moves it.
KEEP_NODE_ANNOTATION = "gpuplane.io/keep-node"
PHASES = ("Pending", "Bound", "Lost")


def parse_gpu_class(obj: Mapping[str, Any]) -> Parsed:
    r = Reader(obj)
    check_api(r, (f"{GROUP}/v1alpha1",))
    name = r.name()
    resource = r.string("spec.resourceName", required=True, max_length=NAME_MAX)
    if "/" not in resource:
        raise r.fail("spec.resourceName", f"must be an extended resource name with a '/', got {quote(resource)}")
    return Parsed(
        "GPUClass",
        "",
        name,
        {
            "resource_name": resource,
            "units_per_device": r.integer("spec.unitsPerDevice", default=1, minimum=1),
            "node_selector": r.string_map("spec.nodeSelector"),
            "tolerations": parse_tolerations(r, "spec.tolerations"),
            "display_name": r.string("spec.displayName", max_length=NAME_MAX),
            "created": r.timestamp("metadata.creationTimestamp"),
            "status_allocatable": r.integer("status.allocatable", default=0),
            "status_bound": r.integer("status.bound", default=0),
            "status_lost": r.integer("status.lost", default=0),
        },
    )


def parse_bind_node_selector(r: Reader, annotations: Mapping[str, str]) -> dict[str, str]:
    """The ``gpuplane.io/bind-node-selector`` annotation: a JSON object of label -> value.

    Anything else is refused naming the annotation: guessing would place the set where
    the VMI's launcher cannot run, or nowhere.
    """
    raw = annotations.get(BIND_NODE_SELECTOR_ANNOTATION, "")
    field = f"metadata.annotations[{BIND_NODE_SELECTOR_ANNOTATION}]"
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        raise r.fail(field, f"is not JSON: {raw[:80]!r}") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise r.fail(field, f"must be a JSON object of label names to string values, got {raw[:80]!r}")
    return value


def parse_alternatives(r: Reader, class_name: str) -> list[str]:
    """``spec.alternativeClassNames``: further classes, in order of preference, after
    ``spec.className``: distinct names, none repeating ``spec.className``, at most
    ``MAX_ALTERNATIVES``. A list that breaks these is refused, naming the entry: guessing
    which duplicate the tenant meant would change what the order may be placed as."""
    path = "spec.alternativeClassNames"
    entries = r.listing(path)
    if len(entries) > MAX_ALTERNATIVES:
        raise r.fail(path, f"must list at most {MAX_ALTERNATIVES} classes, got {len(entries)}")
    names: list[str] = []
    for index, entry in enumerate(entries):
        at = f"{path}[{index}]"
        if not isinstance(entry, str) or not entry:
            raise r.fail(at, f"must be a class name, got {quote(entry)}")
        name = r.limited(at, entry, NAME_MAX)
        if name == class_name:
            raise r.fail(at, f"repeats spec.className {quote(name)}")
        if name in names:
            raise r.fail(at, f"lists {quote(name)} twice")
        names.append(name)
    return names


def parse_gpu(obj: Mapping[str, Any]) -> Parsed:
    r = Reader(obj)
    check_api(r, (f"{GROUP}/v1alpha1",))
    name, namespace = r.name(), r.namespace()
    phase = r.string("status.phase", default="Pending")
    if phase not in PHASES:
        raise r.fail("status.phase", f"must be one of {', '.join(PHASES)}, got {quote(phase)}")
    node = r.string("status.node", max_length=NAME_MAX)
    if phase == "Bound" and not node:
        raise r.fail("status.node", "is required when status.phase is Bound")
    if phase != "Bound" and node:
        raise r.fail("status.node", f"must be empty when status.phase is {phase}")
    annotations = r.string_map("metadata.annotations")
    class_name = r.string("spec.className", required=True, max_length=NAME_MAX)
    return Parsed(
        "GPU",
        namespace,
        name,
        {
            "class_name": class_name,
            "alternative_class_names": parse_alternatives(r, class_name),
            "vm_name": r.string("spec.vmName", required=True, max_length=NAME_MAX),
            "phase": phase,
            "node": node,
            "since": r.timestamp("status.since"),
            "reason": r.string("status.reason"),
            "bind_request": r.limited(
                f"metadata.annotations[{BIND_REQUEST_ANNOTATION}]",
                annotations.get(BIND_REQUEST_ANNOTATION, ""),
                REQUEST_ID_MAX,
            ),
            "bind_node_selector": parse_bind_node_selector(r, annotations),
            "answered_request": r.string("status.answeredRequest", max_length=REQUEST_ID_MAX),
            "answer": r.string("status.answer"),
            "created": r.timestamp("metadata.creationTimestamp"),
            "admitted": r.time_value(
                f"metadata.annotations[{ADMITTED_ANNOTATION}]", annotations.get(ADMITTED_ANNOTATION)
            ),
            "keep_node": annotations.get(KEEP_NODE_ANNOTATION, "").strip().lower() == "true",
            "status_class_name": r.string("status.className", max_length=NAME_MAX) if phase != "Pending" else "",
            **_lending_status(r, phase),
        },
    )


#: ``status.reclaimFor``: ``<namespace>/<vm>``: a namespace (63), a slash, a DNS-1123 subdomain (253).
RECLAIM_FOR_MAX = 63 + 1 + 253


def _lending_status(r: Reader, phase: str) -> dict[str, Any]:
    """A GPU's ``status.borrowed`` and ``status.reclaimFor``: held (Bound or Lost) devices only."""
    held = phase in ("Bound", "Lost")
    mark = r.string("status.reclaimFor", max_length=RECLAIM_FOR_MAX)
    if mark and "/" not in mark:
        raise r.fail("status.reclaimFor", f"must be <namespace>/<vm>, got {quote(mark)}")
    return {"borrowed": r.boolean("status.borrowed") and held, "reclaim_for": mark if held else ""}


def parse_gpu_budget(obj: Mapping[str, Any]) -> Parsed:
    r = Reader(obj)
    check_api(r, (f"{GROUP}/v1alpha1",))
    name, namespace = r.name(), r.namespace()
    limits = {
        r.key("spec.limits", k): r.count(f"spec.limits[{k}]", v, minimum=0) for k, v in r.mapping("spec.limits").items()
    }
    used = {
        r.key("status.used", k): r.count(f"status.used[{k}]", v, minimum=0) for k, v in r.mapping("status.used").items()
    }
    borrowing = {
        r.key("spec.borrowing", k): r.count(f"spec.borrowing[{k}]", v, minimum=0)
        for k, v in r.mapping("spec.borrowing").items()
    }
    return Parsed("GPUBudget", namespace, name, {"limits": limits, "used": used, "borrowing": borrowing})
