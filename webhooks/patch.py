"""The JSONPatch the webhook answers a placed VMI with: pin it, rewrite its deviceNames, add tolerations.

Pure functions of the VMI as sent (a mapping) and what the decision found: the node, its
``kubernetes.io/hostname`` label, each device's raw resource and units, the classes'
tolerations. Django-free.
"""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from binder.engine import GpuClass
from binder.engine.matching import NAME_FIELD
from webhooks.review import DEVICE_PREFIX, DEVICE_SECTIONS, REQUIRED_AFFINITY

#: The node label the patch pins the VMI with: its value is the node's own label, which
#: may differ from the node's name (on EKS the name is the full DNS name, the label the short one).
HOSTNAME_LABEL = "kubernetes.io/hostname"


def _normal_toleration(raw: Mapping[str, Any]) -> tuple[str, str, str, str, Any]:
    return (
        str(raw.get("key") or ""),
        str(raw.get("operator") or "Equal"),
        str(raw.get("value") or ""),
        str(raw.get("effect") or ""),
        raw.get("tolerationSeconds"),
    )


def missing_tolerations(have: Sequence[Mapping[str, Any]], classes: Sequence[GpuClass]) -> list[dict[str, object]]:
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


def _pointer(*parts: str) -> str:
    """An RFC 6901 pointer; ``~`` in a key becomes ``~0`` and ``/`` ``~1`` (``kubernetes.io~1hostname``)."""
    return "".join("/" + part.replace("~", "~0").replace("/", "~1") for part in parts)


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


#: Marks a VMI gpuplane pinned (its value the node): deploy/'s pin policy keeps the pin on the VMI
#: when KubeVirt's VM controller live-updates the VMI's scheduling fields from its VM's template.
PINNED_ANNOTATION = "gpuplane.io/pinned"


def _marker_ops(vmi: Mapping[str, Any], node: str) -> list[dict[str, Any]]:
    meta = vmi.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    if isinstance(annotations, Mapping):
        return [{"op": "add", "path": _pointer("metadata", "annotations", PINNED_ANNOTATION), "value": node}]
    return [{"op": "add", "path": _pointer("metadata", "annotations"), "value": {PINNED_ANNOTATION: node}}]


def build_patch(
    vmi: Mapping[str, Any],
    node: str,
    resources: Mapping[str, tuple[str, int]],
    *,
    hostname: str | None,
    tolerations: Sequence[Mapping[str, Any]] = (),
) -> list[dict[str, Any]]:
    """JSONPatch ops that pin ``vmi`` to ``node``, mark it pinned (:data:`PINNED_ANNOTATION`)
    and rewrite its gpuplane deviceNames.

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
    ops.extend(_marker_ops(vmi, node))
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
    """Base64 of the RFC 6902 array, as ``response.patch`` carries it.

    The ops are built here (always ``op``, ``path`` and ``value``), so they are encoded as
    they are, with orjson; what it refuses (a lone surrogate or an integer beyond 64 bits
    copied from the VMI as sent) is encoded by the standard library, escaped.
    """
    array = [dict(op) for op in ops]
    try:
        text = orjson.dumps(array)
    except orjson.JSONEncodeError:
        text = json.dumps(array).encode()
    return base64.b64encode(text).decode("ascii")


__all__ = ["HOSTNAME_LABEL", "build_patch", "encode_patch", "missing_tolerations"]
